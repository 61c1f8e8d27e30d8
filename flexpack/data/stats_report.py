"""What the normalization does to each action and state dimension, for ``flexpack check-dataset``.

Per dimension of every numeric feature: the share of frames that ``2(x − q01)/(q99 − q01) − 1``
clips to ±1 under the pooled statistics (exact over all frames) and under LeRobot's
(``meta/stats.json``), and whether ``q99 − q01`` is degenerate (≈ 0: every value maps to 0).
Warnings are for the statistics training uses (``--action-stats``) and for clipped shares above
``--clip-warn``; they do not change the exit status (the data are not broken, only their bounds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from flexpack.data import action_stats
from flexpack.data.stats_check import CONSTANT_WIDTH as _EPS  # a narrower q01..q99 maps to 0


@dataclass(frozen=True)
class DimReport:
    feature: str
    dim: int
    low: float  # q01 of the chosen statistics
    high: float  # q99 of the chosen statistics
    clipped: dict[str, float]  # statistics mode -> share of frames outside [q01, q99]
    degenerate: dict[str, bool]  # statistics mode -> q99 − q01 <= eps


def clipped_share(x_N: np.ndarray, low: float, high: float) -> float:
    return float(((x_N < low) | (x_N > high)).mean()) if len(x_N) else 0.0


def _bounds(stats: dict[str, Any] | None, dims: int) -> tuple[np.ndarray, np.ndarray] | None:
    if not stats or "q01" not in stats or "q99" not in stats:
        return None
    low = np.asarray(stats["q01"], dtype=np.float64).reshape(-1)
    high = np.asarray(stats["q99"], dtype=np.float64).reshape(-1)
    return (low, high) if low.shape == high.shape == (dims,) else None


def report(source: Any, latents_dir: Any, mode: str = "pooled") -> list[DimReport]:
    """One :class:`DimReport` per dimension of every numeric feature of ``source``'s dataset."""
    keys = action_stats.numeric_features(source.meta.features)
    values = action_stats.read_columns(source, keys)
    pooled = action_stats.pooled(source, latents_dir)["features"]
    out = []
    for key in keys:
        x_ND = values[key]
        dims = x_ND.shape[1]
        bounds = {"pooled": _bounds(pooled.get(key), dims),
                  "lerobot": _bounds((source.meta.stats or {}).get(key), dims)}
        chosen = bounds[mode] or bounds["pooled"]
        for d in range(dims):
            clipped = {m: clipped_share(x_ND[:, d], b[0][d], b[1][d]) for m, b in bounds.items() if b is not None}
            degenerate = {m: bool(b[1][d] - b[0][d] <= _EPS) for m, b in bounds.items() if b is not None}
            out.append(DimReport(key, d, float(chosen[0][d]), float(chosen[1][d]), clipped, degenerate))
    return out


def lines(rows: list[DimReport], mode: str, threshold: float) -> tuple[list[str], list[str]]:
    """A table (one line per dimension) and the warnings for ``mode`` above ``threshold``."""
    table = [f"normalization bounds ({mode} statistics used; clipped = frames outside q01..q99, mapped to ±1):",
             f"  {'dimension':<28} {'q01':>10} {'q99':>10} {'clipped pooled':>15} {'clipped lerobot':>16}"]
    warnings = []
    for r in rows:
        name = f"{r.feature}[{r.dim}]"
        cells = [f"{100 * r.clipped[m]:.1f} %" + (" (q01=q99)" if r.degenerate[m] else "") if m in r.clipped else "-"
                 for m in ("pooled", "lerobot")]
        table.append(f"  {name:<28} {r.low:>10.4g} {r.high:>10.4g} {cells[0]:>15} {cells[1]:>16}")
        if r.degenerate.get(mode):
            warnings.append(f"warning: {name}: {mode} q01 = q99 = {r.low:.6g}: normalization maps every frame to 0"
                            + ("; data.action_stats = \"pooled\" keeps its spread" if mode == "lerobot"
                               and not r.degenerate.get("pooled", True) else ""))
        elif r.clipped.get(mode, 0.0) > threshold:
            warnings.append(f"warning: {name}: {100 * r.clipped[mode]:.1f} % of frames are clipped to ±1 by the {mode} "
                            f"q01/q99 (threshold {100 * threshold:.1f} %)")
    return table, warnings
