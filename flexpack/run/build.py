"""Build what a config describes over ``data.root``: its split and its :class:`~flexpack.run.root.Run`
(:func:`build_run`: the dataset of one split with its sampler and collate); the model comes from
:meth:`~flexpack.run.root.Run.build_model` (:mod:`flexpack.run.model`).

Shared by :mod:`flexpack.training.loop`, :mod:`flexpack.tools.verify` and sampling, so all see the
same micro-batches.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from flexpack.data.formats import is_bundle
from flexpack.models.registry import DataConventions
from flexpack.run.checks import config_terms
from flexpack.run.config import TrainConfig
from flexpack.run.pretrained import check_camera_layout
from flexpack.run.root import EpisodeDataset, Run, Split, run_for

SPLITS = ("train", "val")


def open_dataset(cfg: TrainConfig, episodes: Sequence[int] | None = None, *,
                 segments: bool | str | None = None, text_dropout: bool = True) -> EpisodeDataset:
    """The config's ``LatentEpisodeDataset`` over ``episodes`` (dataset episode indices; all by default);
    ``segments`` overrides ``data.segments`` (sampling takes whole episodes). The action width, the
    channels the dataset's action columns fill and the cameras are the model family's data conventions
    (:class:`~flexpack.models.registry.DataConventions`; WanVA: its ``action_channels``, column j ->
    channel j, ``data.cameras``)."""
    from flexpack.data import LatentEpisodeDataset

    d, model_cfg, fam = cfg.data, cfg.model.resolved(), cfg.model.model_family()
    if not d.root:
        raise ValueError("data.root is empty: set it to a LeRobot dataset folder with a latent cache")
    conv = fam.conventions(model_cfg)
    if is_bundle(d):
        ds = open_bundle(cfg, conv, episodes, text_dropout=text_dropout)
        for layout in sorted({it.layout for it in ds.items}):
            check_camera_layout(cfg.model.pretrained, fam, layout, str(d.root))
        return ds
    check_camera_layout(cfg.model.pretrained, fam, "width_concat")
    cameras = list(d.cameras) if d.cameras else None
    if conv.action_channels is not None or conv.cameras:
        cameras = check_conventions(cfg, conv)
    return LatentEpisodeDataset(
        d.root, latents_dir=d.latents_dir, action_dim=conv.action_dim, action_steps=d.action_steps,
        stride=d.stride, cameras=cameras, normalize=d.normalize, action_offset=conv.action_offset,
        action_channels=list(conv.action_channels) if conv.action_channels is not None else None,
        segments=d.segments if segments is None else segments,
        episodes=list(episodes) if episodes is not None else None, action_stats=d.action_stats,
    )


def open_bundle(cfg: TrainConfig, conv: DataConventions, episodes: Sequence[int] | None = None, *,
                text_dropout: bool = True) -> EpisodeDataset:
    """The config's :class:`~flexpack.data.bundle.BundleDataset` (``data.format = "lingbot-bundle"``): cameras
    in the family's order (``obs_cam_keys``) unless ``data.cameras`` names them, actions scattered to the
    family's channels, ``data.action_steps`` steps a latent frame."""
    from flexpack.data.bundle import BundleDataset
    from flexpack.data.formats import read_norm_stat

    d = cfg.data
    cameras = list(d.cameras) if d.cameras else list(conv.cameras) or None
    return BundleDataset(
        d.root, cameras=cameras, camera_layout=d.camera_layout, action_dim=conv.action_dim,
        action_channels=list(conv.action_channels) if conv.action_channels is not None else None,
        action_steps=d.action_steps, normalize=d.normalize, norm_stat=read_norm_stat(d.norm_stat),
        action_transform=d.action_transform, cfg_prob=d.cfg_prob if text_dropout else 0.0, seed=d.seed,
        missing=d.missing,
        episodes=list(episodes) if episodes is not None else None,
    )


def episodes_of(cfg: TrainConfig) -> list[int]:
    """Every episode index of ``data.root`` (a bundle's: its (dataset, episode) pairs numbered in order)."""
    from flexpack.data.episodes import EpisodeSource

    if is_bundle(cfg.data):
        from flexpack.data.bundle_files import find_datasets
        from flexpack.data.v21 import Dataset21

        return list(range(sum(len(Dataset21.open(f).episodes) for f in find_datasets(cfg.data.root))))
    return list(EpisodeSource(cfg.data.root).episodes)


def check_conventions(cfg: TrainConfig, conv: DataConventions) -> list[str] | None:
    """The dataset's action columns and cameras against the model family's conventions, each mismatch in
    one line naming the file, the config key and what is missing; returns the cameras to read (in order)."""
    from flexpack.data.episodes import EpisodeSource
    from flexpack.data.problems import resolve_cameras

    src = EpisodeSource(cfg.data.root)
    if conv.action_channels is not None and "action" in src.meta.features:
        columns = int(math.prod(src.meta.features["action"]["shape"]))
        want = list(conv.action_channels)
        if columns != len(want):
            missing = want[columns:]
            what = (f"channel(s) {missing} would have no column" if missing
                    else f"column(s) {list(range(len(want), columns))} would have no channel")
            raise ValueError(f"{src.info_file}: 'action' has {columns} columns, but {conv.action_channels_key} = "
                             f"{want} places {len(want)}: {what}; set it to the {columns} channels the dataset "
                             f"fills (model.overrides.action_channels = {columns} fills channels 0..{columns - 1})")
    cameras = list(cfg.data.cameras) if cfg.data.cameras else None
    if conv.cameras:
        keys = src.video_keys
        absent = [c for c in conv.cameras if c not in keys]
        chosen = resolve_cameras(keys, cameras, src.info_file) if cameras else list(conv.cameras)
        if absent or chosen != list(conv.cameras):
            got = f"data.cameras = {chosen}" if cameras else f"the dataset's cameras {keys}"
            raise ValueError(f"{src.info_file}: the model joins cameras {list(conv.cameras)} on width in this order "
                             f"({conv.cameras_key}), but {got}"
                             + (f" lack {absent}" if absent else "") + "; encode the dataset with those cameras")
        cameras = chosen
    return cameras


def split_of(cfg: TrainConfig) -> Split:
    """The train / held-out episodes of ``data.root`` (:mod:`flexpack.run.holdout`); every episode trains
    when the config holds none out."""
    from flexpack.run.holdout import split_episodes

    d = cfg.data
    if not d.root:
        raise ValueError("data.root is empty: set it to a LeRobot dataset folder with a latent cache")
    if not (d.val_fraction or d.val_episodes):
        return Split()
    with config_terms(cfg):
        train, held = split_episodes(episodes_of(cfg), d, d.root)
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
        ds = open_dataset(cfg, episodes, text_dropout=split == "train")
    return run_for(ds, cfg, rank=rank, world_size=world_size, device=device, split=parts)
