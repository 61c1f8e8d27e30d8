"""Exact pooled statistics of every action and state dimension, over all frames of a dataset.

Why not LeRobot's: LeRobot 0.6 aggregates per-episode statistics into dataset-level ``q01``/``q99``
by a count-weighted mean of the episodes' quantiles. That is not a quantile of the frames. A
sine-like column then gets bounds well inside its range (a quarter of its frames clipped to ±1
after normalization), and a column that is constant within each episode but differs between
episodes gets ``q01 == q99`` (every value normalized to 0).

Here every numeric column (``float*`` / ``int*`` features: ``action``, ``observation.state``, ...) is read
from the parquet files in one pass and its quantiles, mean, std, min and max are computed over
all frames with numpy (``np.quantile``, linear interpolation). ``flexpack encode`` writes them
to ``LATENTS/stats.json`` (atomically); the dataset, training, ``check-dataset`` and ``export``
read them (``data.action_stats = "pooled"``, the default). ``"lerobot"`` uses ``meta/stats.json``.
Whatever is read or computed goes through :func:`check` (:mod:`flexpack.data.stats_check`) first.

File layout::

    {"format": "flexpack-stats-v1", "frames": N, "episodes": E,
     "features": {"action": {"min": [...], "max": [...], "mean": [...], "std": [...],
                             "q01": [...], "q10": [...], "q50": [...], "q90": [...], "q99": [...],
                             "count": N}, ...}}
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from flexpack.atomic import atomic_path
from flexpack.data.stats_check import check_stats

STATS_FORMAT = "flexpack-stats-v1"
STATS_FILE = "stats.json"
QUANTILES = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}
MODES = ("pooled", "lerobot")
# bookkeeping columns LeRobot writes as numbers: not signals to normalize
_SKIP = {"timestamp", "frame_index", "episode_index", "index", "task_index"}


def stats_path(latents_dir: str | os.PathLike) -> Path:
    return Path(latents_dir) / STATS_FILE


def numeric_features(features: dict[str, dict]) -> list[str]:
    """The dataset's numeric features (actions, states, ...), bookkeeping columns excluded."""
    return [k for k, f in features.items() if str(f.get("dtype", "")).startswith(("float", "int")) and k not in _SKIP]


def _column(table: Any, name: str) -> np.ndarray:
    col = table.column(name).combine_chunks()
    if hasattr(col.type, "value_type"):  # (fixed-size) list column -> (rows, D)
        return col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), -1).astype(np.float64)
    return col.to_numpy(zero_copy_only=False).astype(np.float64).reshape(-1, 1)


def describe(values_ND: np.ndarray) -> dict[str, Any]:
    """min, max, mean, std, the quantiles of :data:`QUANTILES` and the count, per column of (N, D)."""
    x = np.asarray(values_ND, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"need (frames, dims) values with at least one frame, got shape {x.shape}")
    out: dict[str, Any] = {"min": x.min(0), "max": x.max(0), "mean": x.mean(0), "std": x.std(0)}
    q = np.quantile(x, list(QUANTILES.values()), axis=0)
    out.update({k: q[i] for i, k in enumerate(QUANTILES)})
    out = {k: v.tolist() for k, v in out.items()}
    out["count"] = int(x.shape[0])
    return out


def read_columns(source: Any, keys: list[str]) -> dict[str, np.ndarray]:
    """Every frame's values of ``keys`` ((N, D) float64 each), from the parquet files of the
    episodes ``source`` (an :class:`~flexpack.data.episodes.EpisodeSource`) lists."""
    import pyarrow.parquet as pq

    files = sorted({source.data_file(ep) for ep in source.episodes})
    wanted = set(source.episodes)
    parts: dict[str, list[np.ndarray]] = {k: [] for k in keys}
    for path in files:
        try:
            table = pq.read_table(path, columns=["episode_index", *keys])
        except Exception as exc:  # missing file or column: name both
            raise ValueError(f"{path}: cannot read columns {keys} for the action statistics: {exc}") from exc
        rows = np.isin(table.column("episode_index").to_numpy(), list(wanted))
        for k in keys:
            parts[k].append(_column(table, k)[rows])
    return {k: np.concatenate(v, 0) for k, v in parts.items()}


def compute(source: Any) -> dict[str, Any]:
    """The pooled statistics of every numeric feature of ``source``'s dataset (the file's content)."""
    keys = numeric_features(source.meta.features)
    columns = read_columns(source, keys)
    frames = int(next(iter(columns.values())).shape[0]) if columns else 0
    for k, v in columns.items():
        bad = int((~np.isfinite(v)).sum())
        if bad:  # check-dataset names the episodes; statistics over NaN would poison every value
            raise ValueError(f"{source.root}: feature {k!r} has {bad} NaN/Inf values; "
                             "run flexpack check-dataset to find the episodes")
    return {"format": STATS_FORMAT, "frames": frames, "episodes": len(source.episodes),
            "features": {k: describe(v) for k, v in columns.items()}}


def write(latents_dir: str | os.PathLike, stats: dict[str, Any]) -> Path:
    path = stats_path(latents_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps(stats, indent=1) + "\n")
    return path


def read(latents_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The stored statistics, or None where there is no file. ValueError naming a damaged one."""
    path = stats_path(latents_dir)
    if not path.is_file():
        return None
    try:
        stats = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot be read as JSON ({exc}); rerun flexpack encode to rewrite it") from exc
    if not isinstance(stats, dict) or stats.get("format") != STATS_FORMAT:
        raise ValueError(f"{path}: not a {STATS_FORMAT} file; rerun flexpack encode to rewrite it")
    return stats


def total_frames(source: Any) -> int:
    return int(sum(source.video_frames))


def current(stats: dict[str, Any] | None, source: Any) -> bool:
    """Whether stored statistics cover this dataset (its frame and episode counts)."""
    return (stats is not None and stats.get("frames") == total_frames(source)
            and stats.get("episodes") == len(source.episodes))


def check(stats: dict[str, Any], source: Any, where: str) -> None:
    """Every feature of a statistics file through :func:`~flexpack.data.stats_check.check_stats`, with
    its width from the dataset's metadata; one line naming ``where``, the feature and the column."""
    features = stats.get("features")
    if not isinstance(features, dict):
        raise ValueError(f"{where}: no table of features; rerun flexpack encode to rewrite it")
    for key, feature in features.items():
        shape = source.meta.features.get(key, {}).get("shape")
        width = int(np.prod(shape)) if shape is not None else np.asarray(feature.get("q01", [])).size
        check_stats(feature, width=width, where=where, feature=key)


def pooled(source: Any, latents_dir: str | os.PathLike) -> dict[str, Any]:
    """The stored pooled statistics when they cover this dataset's frames; else computed now
    (the same numbers: ``encode`` only saves the pass). Checked either way (:func:`check`)."""
    stats = read(latents_dir)
    if current(stats, source):
        check(stats, source, str(stats_path(latents_dir)))
        return stats
    stats = compute(source)
    check(stats, source, f"the statistics computed from {source.root} (no current {stats_path(latents_dir)})")
    return stats


def lerobot_stats(source: Any, keys: list[str] | None = None) -> dict[str, Any]:
    """LeRobot's statistics (``meta/stats.json``) of ``keys`` (default: every numeric feature), checked."""
    keys = numeric_features(source.meta.features) if keys is None else keys
    stats = {k: v for k, v in (source.meta.stats or {}).items() if k in keys}
    check({"features": stats}, source, str(Path(source.root) / "meta" / "stats.json"))
    return stats


def feature_stats(source: Any, latents_dir: str | os.PathLike, key: str, mode: str) -> dict[str, Any] | None:
    """The statistics of feature ``key`` under ``mode`` (``"pooled"`` or ``"lerobot"``), checked."""
    if mode not in MODES:
        raise ValueError(f"data.action_stats must be one of {MODES}, got {mode!r}")
    if mode == "lerobot":
        return lerobot_stats(source, [key]).get(key)
    return pooled(source, latents_dir)["features"].get(key)
