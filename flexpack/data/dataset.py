"""``LatentEpisodeDataset``: one item per episode from the latent cache and the LeRobot data.

Item contract (what the collates consume)::

    latent        float32 (C, F, H, W)   cached bf16 latent; several cameras joined along W
    action        float32 (Ca, F, A)     normalized actions aligned to latent frames (see
                                         ``flexpack.data.actions``); 0 where absent
    action_mask   bool    (Ca, F, A)     True where the channel is in the dataset and the step exists
    text          float32 (L, Dt)        cached embedding of the episode's task, zero padded
    text_len      int                    valid rows of ``text``
    episode_index int                    the dataset's episode index
    task          str
    length        int                    F (latent frames)

Latent frame 0 covers video frame 0 only; frame f >= 1 covers video frames 4(f−1)+1 … 4f
(stride 4). With ``action_steps == stride`` every action step is one video frame; latent frame 0
has only its last step (video frame 0). ``lengths()`` gives F per item from metadata alone.

Items are whole episodes; per-task annotated segments inside an episode are not split out
(an episode with several tasks uses its first).

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

from flexpack.data import cache
from flexpack.data.actions import ActionNormalizer, align_actions, channel_map
from flexpack.data.episodes import EpisodeSource
from flexpack.data.lengths import latent_frames
from flexpack.data.problems import Problem, inspect_latent, inspect_text, raise_first, resolve_cameras


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
        video_backend: str = "pyav",
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
            action_key: the feature holding actions.
            action_channels: model channel of each dataset action column (default 0..D−1).
            episodes: subset of episode indices (default: all, in metadata order).
        """
        self.root = Path(root)
        self.latents_dir = Path(latents_dir) if latents_dir is not None else cache.default_latents_dir(self.root)
        self.source = EpisodeSource(self.root, video_backend=video_backend)
        meta = self.source.meta
        self.cameras = resolve_cameras(self.source.video_keys, cameras, self.source.info_file)
        self.stride, self.action_steps, self.action_dim = stride, action_steps, action_dim
        if action_steps < 1 or stride % action_steps:
            raise ValueError(f"action_steps must divide stride ({stride}), got {action_steps}")
        if action_key not in meta.features:
            raise ValueError(f"{self.source.info_file}: no feature {action_key!r} (features {sorted(meta.features)})")
        self.action_key = action_key
        columns = int(np.prod(meta.features[action_key]["shape"]))
        self.channels = channel_map(columns, action_dim, action_channels)
        stats = (meta.stats or {}).get(action_key)
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
        self._video_frames = [frames_of[e] for e in self.episodes]

    def __len__(self) -> int:
        return len(self.episodes)

    def lengths(self) -> list[int]:
        """Latent frames F of every item, from metadata (no latent or parquet read)."""
        return [latent_frames(n, self.stride) for n in self._video_frames]

    def latent_file(self, i: int) -> Path:
        return cache.latent_path(self.latents_dir, self.cameras, self.episodes[i])

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"item {i} out of range for {len(self)} episodes")
        i %= len(self)
        episode, n_video = self.episodes[i], self._video_frames[i]
        actions_TD = self.source.column(episode, self.action_key).astype(np.float32).reshape(-1, self.channels.shape[0])
        problems, latent, _ = inspect_latent(
            self.latent_file(i), episode=episode, video_frames=n_video, cameras=self.cameras,
            stride=self.stride, action_rows=actions_TD.shape[0],
        )
        raise_first(problems)
        bad = int((~np.isfinite(actions_TD)).sum())
        if bad:
            raise_first([Problem("nonfinite", episode, self.source.data_file(episode), f"{self.action_key!r} has {bad} NaN/Inf values")])
        task, task_index = self.source.task(episode)
        problems, text, head = inspect_text(
            cache.text_path(self.latents_dir, task_index), episode=episode, task=task, task_index=task_index
        )
        raise_first(problems)
        frames = latent.shape[1]
        action, mask = align_actions(
            self.normalizer(actions_TD), frames=frames, action_steps=self.action_steps,
            stride=self.stride, action_dim=self.action_dim, channels=self.channels,
        )
        return {
            "latent": latent,
            "action": action,
            "action_mask": mask,
            "text": text,
            "text_len": head.text_len,
            "episode_index": episode,
            "task": task,
            "length": frames,
        }
