"""What a resume with changed settings does to the run, in a few lines said before its first step.

``config_history.jsonl`` records each changed key (:mod:`flexpack.run.state.runfolder`), but a changed
key does not say what it changes: a longer ``schedule.steps`` moves the end of the cosine decay and so the
learning rate at the very step the run resumes from; more ranks or micro-steps change how many tokens an
optimizer step trains on (the effective batch). :func:`effects` states both, with the numbers before and
after; the settings of the last start come from its changed keys (``changed``: key -> [before, after]) and
the ranks from the checkpoint's ``world_size``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from flexpack.run.config import DataConfig, OptimConfig, ScheduleConfig
from flexpack.training.lr_schedule import lr_at


@dataclass(frozen=True)
class _Sections:
    """The config sections a resume note reads, by the names its changed keys use (``data.max_tokens``)."""

    data: DataConfig
    optim: OptimConfig
    schedule: ScheduleConfig


def _value(cfg: _Sections, key: str) -> Any:
    section, name = key.split(".", 1)
    return getattr(getattr(cfg, section), name)


def _learning_rate(cfg: _Sections, changed: dict[str, list[Any]], step: int) -> str | None:
    if not any(k == "optim.lr" or k.startswith("schedule.") for k in changed):
        return None
    try:
        was_sched = replace(cfg.schedule, **{k.split(".", 1)[1]: v[0] for k, v in changed.items()
                                             if k.startswith("schedule.")})
    except (TypeError, ValueError):  # a key of an earlier version, or a value it no longer takes
        return None
    was_lr = changed["optim.lr"][0] if "optim.lr" in changed else cfg.optim.lr
    sched, parts = cfg.schedule, []
    if sched.decay == "cosine" and (was_sched.decay != "cosine" or was_sched.steps != sched.steps):
        was = f"at step {was_sched.steps}" if was_sched.decay == "cosine" else f"{was_sched.decay} before"
        parts.append(f"the cosine decay now ends at step {sched.steps} (was {was})")
    elif sched.decay != was_sched.decay:
        parts.append(f"the decay is now {sched.decay} (was {was_sched.decay} to step {was_sched.steps})")
    parts.append(f"lr at step {step} goes from {lr_at(step, was_lr, was_sched):.3g} "
                 f"to {lr_at(step, cfg.optim.lr, sched):.3g}")
    if sched.rewarmup_steps:
        parts.append(f"re-warmed over schedule.rewarmup_steps = {sched.rewarmup_steps} steps from "
                     f"{lr_at(step, cfg.optim.lr, sched, resumed_at=step):.3g}")
    return "learning rate: " + "; ".join(parts)


def _per_step(cfg: _Sections, changed: dict[str, list[Any]], world: int, old_world: int) -> str | None:
    per = "data.max_tokens" if cfg.data.mode == "pack" else "data.batch_size"
    keys = (per, "optim.accum_steps")
    now = (*(_value(cfg, k) for k in keys), world)
    was = (*(changed[k][0] if k in changed else _value(cfg, k) for k in keys), old_world)
    if was == now:
        return None
    what = "tokens (token budget)" if cfg.data.mode == "pack" else "episodes"
    return (f"{what} per optimizer step ({per} x optim.accum_steps x ranks): "
            f"{was[0]} x {was[1]} x {was[2]} = {was[0] * was[1] * was[2]:,} -> "
            f"{now[0]} x {now[1]} x {now[2]} = {now[0] * now[1] * now[2]:,}")


def effects(data: DataConfig, optim: OptimConfig, schedule: ScheduleConfig, changed: dict[str, list[Any]], *,
            step: int, world: int, old_world: int) -> list[str]:
    """What resuming at ``step`` with the config's ``data``, ``optim`` and ``schedule`` sections on ``world`` ranks
    changes against the last start (its changed keys ``changed`` and its ``old_world`` ranks): the learning rate and
    the work of one optimizer step."""
    cfg = _Sections(data, optim, schedule)
    return [line for line in (_learning_rate(cfg, changed, step), _per_step(cfg, changed, world, old_world)) if line]
