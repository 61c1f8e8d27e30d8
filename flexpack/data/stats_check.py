"""Statistics that cannot be right are refused wherever they are read.

One NaN in ``q01``, an infinite ``q99`` or swapped quantiles make a column normalize to a constant or
to noise, silently, and the values travel into every checkpoint, export and sample. :func:`check_stats`
is the one check every reader calls (the dataset, ``encode``, ``check-dataset``, ``train`` and a resume,
``verify``, ``sample``, ``export``), on the statistics of one feature:

- every present entry (``min max mean std q01 q10 q50 q90 q99``) has one finite number per column of
  the feature;
- ``min <= q01 <= q10 <= q50 <= q90 <= q99 <= max`` for the entries present, ``mean`` within
  ``[min, max]``, ``0 <= std <= max - min`` (each up to :data:`CONSTANT_WIDTH` plus float rounding);
- the normalization width (``q99 - q01``, or ``std`` without quantiles) is either at most
  :data:`CONSTANT_WIDTH` (1e-8): a *constant* column (every frame, or all but the outer 2 %, the same
  value), which normalizes to 0 as before, and ``check-dataset`` warns about it; or at least the floor
  :data:`WIDTH_FLOOR` ``· max(1, |q01|, |q99|)`` (1e-6 for values up to 1, relative beyond). A width in
  between is float rounding, not a spread: dividing by it would blow rounding up to ±1.

A violation is a ``ValueError`` of one line naming the file (or checkpoint), the feature and the column.
:func:`check_normalizer` applies the same check to the ``{"mode", "low", "high"}`` record a checkpoint or
an export carries (read through :meth:`flexpack.data.normalization.ActionStats.from_json`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

CONSTANT_WIDTH = 1e-8  # the normalizer's: a narrower q01..q99 (or std) maps the column to 0 (or x - mean)
WIDTH_FLOOR = 1e-6  # a wider spread must be at least this, times max(1, |bounds|)
ORDER = ("min", "q01", "q10", "q50", "q90", "q99", "max")
KEYS = (*ORDER, "mean", "std")


def _tolerance(*values: float) -> float:
    return CONSTANT_WIDTH + 1e-12 * max([1.0, *(abs(v) for v in values)])


def _values(stats: Mapping[str, Any], key: str, width: int, name: str) -> np.ndarray:
    try:
        x = np.asarray(stats[key], dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: {key} is not a list of numbers") from None
    if x.shape != (width,):
        raise ValueError(f"{name}: {key} has {x.size} values, the feature has {width} columns")
    bad = np.flatnonzero(~np.isfinite(x))
    if bad.size:
        raise ValueError(f"{name} column {int(bad[0])}: {key} is {x[bad[0]]} (statistics must be finite numbers)")
    return x


def check_stats(stats: Any, *, width: int, where: str, feature: str) -> None:
    """Raise a one-line ValueError if the statistics of ``feature`` (``width`` columns) read from
    ``where`` cannot be right (see the module doc)."""
    name = f"{where}: feature {feature!r}"
    if not isinstance(stats, Mapping):
        raise ValueError(f"{name}: its statistics are not a table")
    v = {k: _values(stats, k, width, name) for k in KEYS if k in stats}
    present = [k for k in ORDER if k in v]
    for c in range(width):
        col = f"{name} column {c}"
        for a, b in zip(present, present[1:]):
            if v[a][c] > v[b][c] + _tolerance(v[a][c], v[b][c]):
                raise ValueError(f"{col}: {a} = {v[a][c]:.6g} > {b} = {v[b][c]:.6g} (they must not decrease: "
                                 f"{' <= '.join(present)})")
        if "mean" in v and "min" in v and "max" in v and not (
                v["min"][c] - _tolerance(v["min"][c]) <= v["mean"][c] <= v["max"][c] + _tolerance(v["max"][c])):
            raise ValueError(f"{col}: mean = {v['mean'][c]:.6g} lies outside [min, max] = "
                             f"[{v['min'][c]:.6g}, {v['max'][c]:.6g}]")
        if "std" in v:
            span = v["max"][c] - v["min"][c] if "min" in v and "max" in v else math.inf
            if not -_tolerance() <= v["std"][c] <= span + _tolerance(span if math.isfinite(span) else 0.0):
                raise ValueError(f"{col}: std = {v['std'][c]:.6g} is negative or wider than max - min")
        if "q01" in v and "q99" in v:
            _spread(col, "q99 - q01", v["q99"][c] - v["q01"][c], v["q01"][c], v["q99"][c])
        elif "std" in v and "mean" in v:
            _spread(col, "std", v["std"][c], v["mean"][c])


def _spread(col: str, what: str, spread: float, *bounds: float) -> None:
    floor = WIDTH_FLOOR * max([1.0, *(abs(b) for b in bounds)])
    if CONSTANT_WIDTH < spread < floor:
        raise ValueError(f"{col}: {what} = {spread:.3g} is above {CONSTANT_WIDTH:g} (a constant column) but below the "
                         f"floor {floor:.3g} ({WIDTH_FLOOR:g} x max(1, |bounds|)): float rounding, not a spread; "
                         "normalizing would blow it up to ±1")


def check_normalizer(state: Any, *, where: str, feature: str = "action", width: int | None = None) -> None:
    """:func:`check_stats` of a saved normalization state ``{"mode", "low", "high"}`` (a checkpoint's
    ``extra.action_normalizer``, an export's ``normalization.json``)."""
    if not isinstance(state, Mapping) or state.get("mode") not in ("quantile", "meanstd", "none"):
        raise ValueError(f"{where}: the {feature!r} normalization is not {{mode: quantile | meanstd | none, low, "
                         "high}")
    if state["mode"] == "none":
        return
    try:
        columns = len(state["low"]) if width is None else width
    except (KeyError, TypeError):
        raise ValueError(f"{where}: the {feature!r} normalization has no list of low values") from None
    names = ("q01", "q99") if state["mode"] == "quantile" else ("mean", "std")
    check_stats({names[0]: state.get("low"), names[1]: state.get("high")}, width=columns, where=where, feature=feature)
