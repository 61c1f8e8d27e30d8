"""The action statistics a model is trained with, as one typed record: :class:`ActionStats`.

A checkpoint carries them in ``train_state.json`` (``extra.action_normalizer``), an export in
``normalization.json``; both hold the JSON object ``{"mode", "low", "high"}`` (an export's beside its
layout keys), which :meth:`ActionStats.to_json` writes and :meth:`ActionStats.from_json` reads back,
checked (:func:`~flexpack.data.stats_check.check_normalizer`) so that a malformed record is one line
naming its file. Everything between (resume, sampling, the metrics, export) passes the record itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from flexpack.data.actions import ActionNormalizer
from flexpack.data.stats_check import check_normalizer

MODES = ("quantile", "meanstd", "none")


@dataclass(frozen=True, kw_only=True)
class ActionStats:
    """Per action column: ``mode`` ``"quantile"`` (``low`` q01, ``high`` q99), ``"meanstd"`` (mean, std) or
    ``"none"`` (identity; ``low`` zeros and ``high`` ones)."""

    mode: str
    low: tuple[float, ...]
    high: tuple[float, ...]

    def __post_init__(self) -> None:
        assert self.mode in MODES and len(self.low) == len(self.high), (self.mode, len(self.low), len(self.high))

    @property
    def columns(self) -> int:
        return len(self.low)

    @classmethod
    def of(cls, normalizer: ActionNormalizer) -> ActionStats:
        """The statistics a dataset's :class:`~flexpack.data.actions.ActionNormalizer` applies."""
        return cls(mode=normalizer.mode, low=_floats(normalizer.low), high=_floats(normalizer.high))

    def normalizer(self) -> ActionNormalizer:
        """The :class:`~flexpack.data.actions.ActionNormalizer` that applies these statistics."""
        return ActionNormalizer(self.mode, np.asarray(self.low, dtype=np.float64),
                                np.asarray(self.high, dtype=np.float64))

    def matches(self, other: ActionStats | None, *, rtol: float = 1e-6, atol: float = 1e-9) -> bool:
        """The same mode and, within float rounding, the same values (statistics recomputed from the same frames)."""
        return (other is not None and other.mode == self.mode and other.columns == self.columns
                and bool(np.allclose(self.low, other.low, rtol=rtol, atol=atol))
                and bool(np.allclose(self.high, other.high, rtol=rtol, atol=atol)))

    def to_json(self) -> dict[str, Any]:
        """``{"mode", "low", "high"}`` as checkpoints and exports store it."""
        return {"mode": self.mode, "low": list(self.low), "high": list(self.high)}

    @classmethod
    def from_json(cls, obj: Any, where: str, *, width: int | None = None) -> ActionStats:
        """The record ``obj`` read from ``where`` (a file, and the key it sits under), checked: a mode of
        :data:`MODES`, ``low`` and ``high`` one finite number per column (``width`` columns where given) and
        statistics that can be right; anything else is one ``ValueError`` line naming ``where``."""
        check_normalizer(obj, where=where, width=width)
        low, high = (_read(obj, k, where) for k in ("low", "high"))
        if len(low) != len(high) or (width is not None and len(low) != width):
            want = f"{width}" if width is not None else f"as many as low ({len(low)})"
            raise ValueError(f"{where}: the 'action' normalization has {len(low)} low and {len(high)} high values; "
                             f"expected {want} each")
        return cls(mode=obj["mode"], low=low, high=high)


def _floats(values: Any) -> tuple[float, ...]:
    return tuple(float(x) for x in np.asarray(values, dtype=np.float64).reshape(-1))


def _read(obj: Any, key: str, where: str) -> tuple[float, ...]:
    values = obj.get(key)
    if not isinstance(values, list):
        raise ValueError(f"{where}: the 'action' normalization has no list of {key} values")
    try:
        out = tuple(float(x) for x in values)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: the 'action' normalization's {key} is not a list of numbers") from None
    if not all(np.isfinite(out)):
        raise ValueError(f"{where}: the 'action' normalization's {key} holds a value that is not finite")
    return out
