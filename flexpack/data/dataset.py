"""``LatentEpisodeDataset``: one item per episode (or per annotated segment) from the latent
cache and the LeRobot data.

Item contract (what the collates consume)::

    latent        float32 (C, F, H, W)   cached bf16 latent; several cameras joined along W
    action        float32 (Ca, F, A)     normalized actions aligned to latent frames (see
                                         ``flexpack.data.actions``); 0 where absent
    action_mask   bool    (Ca, F, A)     True where the channel is in the dataset and the step exists
    text          float32 (L, Dt)        cached embedding of the item's task, zero padded
    text_len      int                    valid rows of ``text``
    episode_index int                    the dataset's episode index
    task          str                    the segment's task; a whole episode's frame-0 task
    length        int                    F (latent frames)
    segment       int                    the task run's number in the episode; −1 = whole episode
    frame_range   (int, int)             video frames [start, stop) of the segment (whole: (0, n))
    latent_range  (int, int)             the item's latent frames [f0, f1) in the episode's latent

Latent frame 0 covers video frame 0 only; frame f >= 1 covers video frames 4(f−1)+1 … 4f
(stride 4). With ``action_steps == stride`` every action step is one video frame; latent frame 0
has only its last step (video frame 0). ``lengths()`` gives F per item from metadata alone.

Segments (``segments=``): LeRobot v3 stores a ``task_index`` per frame; a segment is a maximal
run of one task inside an episode. ``"auto"`` (default) splits the episodes that have more than
one run into one item per segment and keeps the others whole; ``True`` makes every run an item
(a one-run episode gives one segment spanning it); ``False`` gives whole episodes only. A segment
of video frames [s, e) gets the latent frames whose covered video frames all fall inside it
(latent frame 0 covers frame 0, frame f >= 1 covers 4f−3 … 4f), the actions of those frames and
its own task's text; runs too short for one whole latent frame give no item. The exact rule and
its consequences are in ``flexpack.data.segments``. An episode whose data rows do not match its
metadata length stays whole, so loading it reports the problem.

Errors: every problem ``flexpack check-dataset`` reports is raised here when the item is loaded,
as a subclass of ``DatasetProblemError`` (``MissingFileError`` is a FileNotFoundError, the others
ValueErrors) whose message names the file and the episode.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flexpack.data import action_stats as action_stats_mod
from flexpack.data import cache
from flexpack.data.actions import ActionNormalizer, align_actions, channel_map
from flexpack.data.episodes import EpisodeSource
from flexpack.data.hub import resolve_root
from flexpack.data.lengths import latent_frames
from flexpack.data.problems import Problem, inspect_latent, inspect_text, raise_first, resolve_cameras
from flexpack.data.segments import Segment, episode_segments, task_runs


class LatentEpisodeDataset(torch.utils.data.Dataset):
    def __init__(
        self,
        root: str | os.PathLike,
        *,
        latents_dir: str | os.PathLike | None = None,
        action_dim: int = 32,
        action_steps: int = 4,
        stride: int = 4,
        cameras: list[str] | None = None,
        normalize: bool = True,
        action_key: str = "action",
        action_channels: list[int] | None = None,
        episodes: list[int] | None = None,
        segments: bool | str = "auto",
        video_backend: str = "pyav",
        action_stats: str = "pooled",
        action_offset: int = 0,
    ) -> None:
        """
        Args:
            root: the LeRobot dataset's folder.
            latents_dir: the latent cache (default ``root/latents``).
            action_dim: the model's fixed action width Ca.
            action_steps: action steps A per latent frame; must divide ``stride``.
            stride: the VAE's temporal stride (must match the cache's).
            cameras: camera keys or short names, in width order (default: all video keys).
            normalize: map actions with the dataset's stats (q01/q99 -> [−1, 1], else mean/std).
            action_stats: ``"pooled"`` = exact quantiles over all frames (``LATENTS/stats.json``
                written by ``flexpack encode``, computed here where it is missing or stale);
                ``"lerobot"`` = ``meta/stats.json`` (see :mod:`flexpack.data.action_stats`).
            action_key: the feature holding actions.
            action_channels: model channel of each dataset action column (default 0..D−1).
            action_offset: video frames every action step is taken earlier (``flexpack.data.actions``).
            episodes: subset of episode indices (default: all, in metadata order).
            segments: ``"auto"`` = one item per task run in episodes with several runs, else the
                whole episode; ``True`` = one item per task run everywhere; ``False`` = whole
                episodes (reads no per-frame task_index at construction).
        """
        self.root = resolve_root(root)  # a path, or a LeRobot repo id in lerobot's cache
        self.latents_dir = Path(latents_dir) if latents_dir is not None else cache.default_latents_dir(self.root)
        self.source = EpisodeSource(self.root, video_backend=video_backend)
        meta = self.source.meta
        self.cameras = resolve_cameras(self.source.video_keys, cameras, self.source.info_file)
        self.stride, self.action_steps, self.action_dim = stride, action_steps, action_dim
        self.action_offset = action_offset
        if action_steps < 1 or stride % action_steps:
            raise ValueError(f"action_steps must divide stride ({stride}), got {action_steps}")
        if action_key not in meta.features:
            raise ValueError(f"{self.source.info_file}: no feature {action_key!r} (features {sorted(meta.features)})")
        self.action_key = action_key
        columns = int(np.prod(meta.features[action_key]["shape"]))
        self.channels = channel_map(columns, action_dim, action_channels)
        self.action_stats = action_stats
        stats = (action_stats_mod.feature_stats(self.source, self.latents_dir, action_key, action_stats)
                 if normalize else None)
        self.normalizer = (
            ActionNormalizer.from_stats(stats, columns, action_key) if normalize else ActionNormalizer.identity(columns)
        )
        frames_of = dict(zip(self.source.episodes, self.source.video_frames))
        if episodes is None:
            episodes = list(self.source.episodes)
        unknown = [e for e in episodes if e not in frames_of]
        if unknown:
            raise ValueError(f"{self.root}: episodes {unknown} are not in the dataset ({len(frames_of)} episodes)")
        self.episodes = list(episodes)
        self._frames_of = {e: frames_of[e] for e in self.episodes}
        if segments not in (True, False, "auto"):
            raise ValueError(f"segments must be True, False or 'auto', got {segments!r}")
        self.segments = segments
        self._tasks = self.source.tasks()  # task_index -> task string
        # one entry per item: (episode, its segment or None for the whole episode)
        self.items: list[tuple[int, Segment | None]] = self._items(segments)

    def _items(self, segments: bool | str) -> list[tuple[int, Segment | None]]:
        if segments is False:
            return [(e, None) for e in self.episodes]
        task_of_frame = self.source.frame_task_indices(self.episodes)
        known = self._tasks
        out: list[tuple[int, Segment | None]] = []
        for ep in self.episodes:
            tasks_T = task_of_frame[ep]
            unknown = sorted(set(tasks_T.tolist()) - set(known))
            if unknown:
                raise ValueError(f"{self.source.data_file(ep)}: episode {ep} has task_index {unknown} "
                                 f"not listed in {self.root}/meta/tasks.parquet")
            if len(tasks_T) != self._frames_of[ep]:  # inconsistent rows: loading it reports the problem
                out.append((ep, None))
                continue
            if segments is True or len(task_runs(tasks_T)) > 1:
                out += [(ep, seg) for seg in episode_segments(ep, tasks_T, self.stride)]
            else:
                out.append((ep, None))
        return out

    def __len__(self) -> int:
        return len(self.items)

    def lengths(self) -> list[int]:
        """Latent frames F of every item, from metadata and (for segments) the per-frame
        task_index column; no latent is read."""
        return [latent_frames(self._frames_of[ep], self.stride) if seg is None else seg.frames
                for ep, seg in self.items]

    def latent_file(self, i: int) -> Path:
        return cache.latent_path(self.latents_dir, self.cameras, self.items[i][0])

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"item {i} out of range for {len(self)} items")
        i %= len(self)
        episode, seg = self.items[i]
        n_video = self._frames_of[episode]
        actions_TD = self.source.column(episode, self.action_key).astype(np.float32).reshape(-1, self.channels.shape[0])
        problems, latent, _ = inspect_latent(
            self.latent_file(i), episode=episode, video_frames=n_video, cameras=self.cameras,
            stride=self.stride, action_rows=actions_TD.shape[0],
        )
        raise_first(problems)
        bad = int((~np.isfinite(actions_TD)).sum())
        if bad:
            raise_first([Problem("nonfinite", episode, self.source.data_file(episode),
                                 f"{self.action_key!r} has {bad} NaN/Inf values")])
        if seg is None:  # a whole episode speaks the task of its first frame
            task_index = int(self.source.column(episode, "task_index")[0])
        else:
            task_index = seg.task_index
        task = self._tasks.get(task_index)
        if task is None:
            raise ValueError(f"{self.source.data_file(episode)}: episode {episode} has task_index {task_index} "
                             f"not listed in {self.root}/meta/tasks.parquet")
        problems, text, head = inspect_text(
            cache.text_path(self.latents_dir, task_index), episode=episode, task=task, task_index=task_index
        )
        raise_first(problems)
        frames = latent.shape[1]
        action, mask = align_actions(
            self.normalizer(actions_TD), frames=frames, action_steps=self.action_steps,
            stride=self.stride, action_dim=self.action_dim, channels=self.channels, offset=self.action_offset,
        )
        f0, f1 = (0, frames) if seg is None else (seg.f0, seg.f1)
        return {
            "latent": latent[:, f0:f1].contiguous(),
            "action": action[:, f0:f1].contiguous(),
            "action_mask": mask[:, f0:f1].contiguous(),
            "text": text,
            "text_len": head.text_len,
            "episode_index": episode,
            "task": task,
            "length": f1 - f0,
            "segment": -1 if seg is None else seg.segment,
            "frame_range": (0, n_video) if seg is None else (seg.start, seg.stop),
            "latent_range": (f0, f1),
        }
