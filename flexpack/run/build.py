"""Build what a config describes over ``data.root``: its split and its :class:`~flexpack.run.root.Run`
(:func:`build_run`: the dataset of one split with its sampler and collate); the model comes from
:meth:`~flexpack.run.root.Run.build_model` (:mod:`flexpack.run.model`).

Shared by :mod:`flexpack.training.loop`, :mod:`flexpack.tools.verify` and sampling, so all see the
same micro-batches.
"""

from __future__ import annotations

from typing import Sequence

import torch

from flexpack.run.checks import config_terms
from flexpack.run.config import TrainConfig
from flexpack.run.root import EpisodeDataset, Run, Split, run_for

SPLITS = ("train", "val")


def open_dataset(cfg: TrainConfig, episodes: Sequence[int] | None = None, *,
                 segments: bool | str | None = None) -> EpisodeDataset:
    """The config's ``LatentEpisodeDataset`` over ``episodes`` (dataset episode indices; all by default);
    ``segments`` overrides ``data.segments`` (sampling takes whole episodes). The model's
    ``action_channels`` are the dataset's action width."""
    from flexpack.data import LatentEpisodeDataset

    d, m = cfg.data, cfg.model.resolved()
    if not d.root:
        raise ValueError("data.root is empty: set it to a LeRobot dataset folder with a latent cache")
    return LatentEpisodeDataset(
        d.root, latents_dir=d.latents_dir, action_dim=max(m.action_channels, 1), action_steps=d.action_steps,
        stride=d.stride, cameras=list(d.cameras) if d.cameras else None, normalize=d.normalize,
        segments=d.segments if segments is None else segments,
        episodes=list(episodes) if episodes is not None else None, action_stats=d.action_stats,
    )


def split_of(cfg: TrainConfig) -> Split:
    """The train / held-out episodes of ``data.root`` (:mod:`flexpack.run.holdout`); every episode trains
    when the config holds none out."""
    from flexpack.data.episodes import EpisodeSource
    from flexpack.run.holdout import split_episodes

    d = cfg.data
    if not d.root:
        raise ValueError("data.root is empty: set it to a LeRobot dataset folder with a latent cache")
    if not (d.val_fraction or d.val_episodes):
        return Split()
    with config_terms(cfg):
        train, held = split_episodes(EpisodeSource(d.root).episodes, d, d.root)
    return Split(train=tuple(train), held_out=tuple(held))


def build_run(cfg: TrainConfig, rank: int = 0, world_size: int = 1, *, split: str = "train",
              device: torch.device | None = None) -> Run:
    """The :class:`~flexpack.run.root.Run` of ``cfg`` over ``data.root``: the episodes of ``split`` (the
    training ones, or the held-out ``"val"`` ones: :mod:`flexpack.training.validation`), this rank's
    sampler and the matching collate, checked to fit the model; on ``device`` (default
    ``runtime.device``)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    parts = split_of(cfg)
    episodes = parts.held_out if split == "val" else parts.train
    with config_terms(cfg):
        ds = open_dataset(cfg, episodes)
    return run_for(ds, cfg, rank=rank, world_size=world_size, device=device, split=parts)
