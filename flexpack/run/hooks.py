"""What runs after an optimizer step besides the step itself: one protocol for validation, sampling
and any other per-step work.

The loop builds each hook once, before the first step, from a :class:`HookContext` (a
:data:`HookFactory` returns ``None`` when its config switches it off), and after every step calls
``hook.after_step(model, step, ema=ema)`` on every rank (hooks may be collective). A hook returns a
:class:`HookReport` on the steps it ran; the loop sends its row (and images) through its one metrics
writer, so no hook opens ``metrics.jsonl`` itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from torch import nn

from flexpack.data.normalization import ActionStats
from flexpack.run.root import Run


@dataclass(frozen=True, kw_only=True)
class HookContext:
    """What a hook is built from: the training run (config, model config, geometry, device, rank) and
    the action statistics the weights are trained with (restored ones after a resume)."""

    run: Run
    action_stats: ActionStats | None = None  # the statistics in use (checkpointed with the weights); None: no actions


@dataclass(frozen=True, kw_only=True)
class HookReport:
    """One metrics row (with its ``step``) and PNG files to log beside it (``{tag: path}``)."""

    row: dict[str, Any]
    images: Mapping[str, Path] = field(default_factory=dict)


class AfterStep(Protocol):
    def after_step(self, model: nn.Module, step: int, *, ema: Any = None) -> HookReport | None:
        """Run after optimizer step ``step`` (1-based count of steps done), on every rank."""


HookFactory = Callable[[HookContext], "AfterStep | None"]
