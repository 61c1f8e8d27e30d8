"""Episode lengths from LeRobot metadata, without loading data or latents.

Latent frames per episode follow :func:`flexpack.packing.lengths.latent_frames` (the VAE's
temporal stride; one definition, shared with the packing core).
"""

from __future__ import annotations

import json
import os
from typing import Any

from flexpack.packing.lengths import latent_frames, used_video_frames  # noqa: F401  (used_video_frames re-exported)


def open_metadata(root: str | os.PathLike) -> Any:
    """``LeRobotDatasetMetadata`` of a local dataset; never downloads.

    Raises FileNotFoundError naming ``meta/info.json`` when ``root`` holds no LeRobot dataset, or
    naming the metadata file that is missing (lerobot would fetch a missing one from the hub), and
    ValueError naming ``meta/info.json`` when it is not LeRobot metadata.
    """
    from flexpack.data.hub import resolve_root

    root = resolve_root(root)  # a path, or a LeRobot repo id in lerobot's cache
    info_file = root / "meta" / "info.json"
    if not info_file.is_file():
        raise FileNotFoundError(f"{info_file}: not a LeRobot dataset (no meta/info.json under {root})")
    from lerobot.datasets.dataset_metadata import LeRobotDatasetMetadata

    try:
        info = json.loads(info_file.read_text(encoding="utf-8"))
        counts = {"episodes": int(info["total_episodes"]), "tasks": int(info["total_tasks"])}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{info_file}: not LeRobot v3 metadata ({type(exc).__name__}: {exc})") from None
    for what, path in (("tasks", root / "meta" / "tasks.parquet"), ("episodes", root / "meta" / "episodes")):
        if counts[what] > 0 and not path.exists():
            raise FileNotFoundError(f"{path}: missing, but {info_file} lists {counts[what]} {what}")
    try:
        return LeRobotDatasetMetadata(f"local/{root.name}", root=root)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{info_file}: lerobot cannot read this dataset's metadata "
                         f"({type(exc).__name__}: {exc})") from exc


def episode_video_frames(meta: Any) -> list[int]:
    """Video frames per episode, in the order of ``meta.episodes``, without loading data."""
    if meta.episodes is None:
        return []
    return [int(n) for n in meta.episodes["length"]]


def episode_indices(meta: Any) -> list[int]:
    """The dataset's episode indices, in the order of ``meta.episodes`` (lerobot: 0..N-1)."""
    if meta.episodes is None:
        return []
    return [int(i) for i in meta.episodes["episode_index"]]


def dataset_latent_frames(root: str | os.PathLike, stride: int = 4) -> list[int]:
    """Latent frames per episode (episode order) of the LeRobot dataset at ``root``."""
    return [latent_frames(n, stride) for n in episode_video_frames(open_metadata(root))]
