"""Read access to a local LeRobot dataset through lerobot: metadata, an episode's rows, its videos.

lerobot is imported only when a method needs it. The parquet rows are read through
``LeRobotDataset``'s memory-mapped table (built once per process, lazily, so the object can be
pickled into DataLoader workers), never by loading whole files per item.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flexpack.data.hub import resolve_root
from flexpack.data.lengths import episode_indices, episode_video_frames, open_metadata


class EpisodeSource:
    def __init__(self, root: str | os.PathLike, video_backend: str = "pyav") -> None:
        self.root = resolve_root(root)  # a path, or a LeRobot repo id in lerobot's cache
        self.meta = open_metadata(self.root)
        self.video_backend = video_backend
        self.episodes: list[int] = episode_indices(self.meta)
        self.video_frames: list[int] = episode_video_frames(self.meta)
        if not self.episodes:
            raise ValueError(f"{self.info_file}: the dataset has no episodes")
        self._position = {ep: i for i, ep in enumerate(self.episodes)}
        self._dataset: Any = None
        self._row_of_index: np.ndarray | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_dataset": None, "_row_of_index": None}

    @property
    def info_file(self) -> Path:
        return self.root / "meta" / "info.json"

    @property
    def video_keys(self) -> list[str]:
        return list(self.meta.video_keys)

    def _row(self, episode: int) -> dict:
        if episode not in self._position:
            raise KeyError(f"{self.root}: no episode {episode} (episodes {self.episodes[:5]}…)")
        return self.meta.episodes[self._position[episode]]

    def task(self, episode: int) -> tuple[str, int]:
        """The episode's task string (its first, where it has several) and the task index."""
        task = str(self._row(episode)["tasks"][0])
        index = self.meta.get_task_index(task)
        if index is None:
            raise ValueError(f"{self.root}/meta/tasks.parquet: task {task!r} of episode {episode} is not listed")
        return task, int(index)

    def episode_tasks(self, episode: int) -> list[tuple[str, int]]:
        """Every task the episode's frames are annotated with (metadata order), with its index."""
        out = []
        for task in self._row(episode)["tasks"]:
            index = self.meta.get_task_index(str(task))
            if index is None:
                raise ValueError(f"{self.root}/meta/tasks.parquet: task {task!r} of episode {episode} is not listed")
            out.append((str(task), int(index)))
        return out

    def tasks(self) -> dict[int, str]:
        """Every task index -> task string."""
        return {int(i): str(t) for t, i in zip(self.meta.tasks.index, self.meta.tasks["task_index"])}

    def data_file(self, episode: int) -> Path:
        return self.root / self.meta.get_data_file_path(self._position[episode])

    # -- parquet rows ------------------------------------------------------------------------
    def _table(self) -> Any:
        if self._dataset is None:
            from lerobot.datasets.lerobot_dataset import LeRobotDataset

            # lerobot fetches missing data files from the hub; a local dataset must have them all
            missing = sorted({str(p) for p in map(self.data_file, self.episodes) if not p.is_file()})
            if missing:
                raise FileNotFoundError(f"{missing[0]}: data file missing ({len(missing)} of the dataset's data files)")

            self._dataset = LeRobotDataset(f"local/{self.root.name}", root=self.root, video_backend=self.video_backend)
            index = self._column_all("index").astype(np.int64)
            self._row_of_index = None if np.array_equal(index, np.arange(len(index))) else np.argsort(index)
        return self._dataset.hf_dataset.data

    def _column_all(self, name: str) -> np.ndarray:
        return self._dataset.hf_dataset.data.column(name).to_numpy()

    def column(self, episode: int, name: str) -> np.ndarray:
        """The episode's rows of column ``name``: (rows,) or (rows, D), from the parquet data."""
        table = self._table()
        if name not in table.column_names:
            raise KeyError(f"{self.data_file(episode)}: no column {name!r} (columns {table.column_names})")
        row = self._row(episode)
        start, stop = int(row["dataset_from_index"]), int(row["dataset_to_index"])
        if self._row_of_index is None:
            part = table.slice(start, stop - start)
        else:
            part = table.take(self._row_of_index[start:stop].tolist())
        eps = part.column("episode_index").to_numpy()
        if len(eps) != stop - start or (eps != episode).any():
            raise ValueError(f"{self.data_file(episode)}: rows {start}..{stop} do not all belong to episode {episode}")
        col = part.column(name).combine_chunks()
        if hasattr(col, "flatten") and hasattr(col.type, "value_type"):  # (fixed-size) list column
            values = col.flatten().to_numpy(zero_copy_only=False)
            return values.reshape(len(col), -1)
        return col.to_numpy(zero_copy_only=False)

    def frame_task_indices(self, episodes: list[int] | None = None) -> dict[int, np.ndarray]:
        """Per-frame ``task_index`` (frame order) of each episode, read from the parquet files'
        ``episode_index``/``frame_index``/``task_index`` columns only (no LeRobotDataset, no videos).
        An episode with no rows maps to an empty array."""
        import pyarrow.parquet as pq

        episodes = list(self.episodes) if episodes is None else list(episodes)
        files: dict[Path, list[int]] = {}
        for ep in episodes:
            files.setdefault(self.data_file(ep), []).append(ep)
        out: dict[int, np.ndarray] = {}
        for path, eps in files.items():
            try:
                table = pq.read_table(path, columns=["episode_index", "frame_index", "task_index"])
            except Exception as exc:  # missing file, or a column lerobot v3 always writes
                raise ValueError(f"{path}: cannot read the per-frame task_index of episodes {eps}: {exc}") from exc
            ep_col = table.column("episode_index").to_numpy()
            frame_col = table.column("frame_index").to_numpy()
            task_col = table.column("task_index").to_numpy().astype(np.int64)
            for ep in eps:
                rows = np.flatnonzero(ep_col == ep)
                out[ep] = task_col[rows[np.argsort(frame_col[rows], kind="stable")]]
        return out

    def row_counts(self) -> dict[int, int]:
        """Rows per episode index actually present in the parquet data."""
        self._table()
        eps, counts = np.unique(self._column_all("episode_index"), return_counts=True)
        return {int(e): int(c) for e, c in zip(eps, counts)}

    # -- videos --------------------------------------------------------------------------------
    def video_file(self, episode: int, camera: str) -> Path:
        return self.root / self.meta.get_video_file_path(self._position[episode], camera)

    def decode(self, episode: int, camera: str, frames: int) -> torch.Tensor:
        """The first ``frames`` video frames of ``camera`` in ``episode``: (T, 3, H, W) uint8."""
        from lerobot.datasets.video_utils import decode_video_frames

        timestamps = self.column(episode, "timestamp")[:frames].astype(np.float64)
        offset = float(self._row(episode)[f"videos/{camera}/from_timestamp"])
        path = self.video_file(episode, camera)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: video of camera {camera!r} for episode {episode} does not exist")
        try:
            video = decode_video_frames(path, (timestamps + offset).tolist(), 1e-4, self.video_backend,
                                        return_uint8=True)
        except Exception as exc:  # pyav/torchcodec raise assorted types on a damaged file
            raise ValueError(f"{path}: cannot decode camera {camera!r} of episode {episode} "
                             f"({type(exc).__name__}: {exc})") from exc
        if video.shape[0] != frames:
            raise ValueError(f"{path}: decoded {video.shape[0]} frames of episode {episode}, expected {frames}")
        return video
