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

from flexpack.models.registry import DataConventions
from flexpack.run.checks import config_terms
from flexpack.run.config import TrainConfig
from flexpack.run.root import EpisodeDataset, Run, Split, run_for

SPLITS = ("train", "val")


def open_dataset(cfg: TrainConfig, episodes: Sequence[int] | None = None, *,
                 segments: bool | str | None = None) -> EpisodeDataset:
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


def check_conventions(cfg: TrainConfig, conv: DataConventions) -> list[str] | None:
    """The dataset's action columns and cameras against the model family's conventions, each mismatch in
    one line naming the file, the model config field with where its value came from (the override, model.pretrained's
    config.json or the preset), and what is missing; returns the cameras to read (in order)."""
    from flexpack.data.episodes import EpisodeSource
    from flexpack.data.problems import resolve_cameras
    from flexpack.run.pretrained import field_source

    src = EpisodeSource(cfg.data.root)
    if conv.action_channels is not None and "action" in src.meta.features:
        columns = int(math.prod(src.meta.features["action"]["shape"]))
        want = list(conv.action_channels)
        if columns != len(want):
            raise ValueError(f"{src.info_file}: 'action' has {columns} columns, but {conv.action_channels_field} = "
                             f"{want} (from {field_source(cfg.model, conv.action_channels_field)}) places {len(want)}: "
                             f"{_unplaced(want, columns)}; {_channels_advice(cfg, conv, columns)}")
    cameras = list(cfg.data.cameras) if cfg.data.cameras else None
    if conv.cameras:
        keys = src.video_keys

        def field() -> str:  # read only for an error: model.pretrained's config.json may be opened
            return f"{conv.cameras_field} = {list(conv.cameras)} (from {field_source(cfg.model, conv.cameras_field)})"

        absent = [c for c in conv.cameras if c not in keys]
        if absent:
            raise ValueError(f"{src.info_file}: camera{'s' if len(absent) > 1 else ''} {absent} of {field()} "
                             f"{'are' if len(absent) > 1 else 'is'} not in the dataset, whose cameras are {keys}; "
                             "train on a dataset with those cameras (the model joins them on width in this order) or "
                             f"set model.overrides.{conv.cameras_field} to cameras of this one")
        chosen = resolve_cameras(keys, cameras, src.info_file) if cameras else list(conv.cameras)
        if chosen != list(conv.cameras):
            raise ValueError(f"{src.info_file}: the model joins cameras on width in the order of {field()}, but "
                             f"data.cameras = {chosen}; drop data.cameras or set it to that list")
        cameras = chosen
    return cameras


def _unplaced(want: list[int], columns: int) -> str:
    """What a channel list of the wrong length leaves out: channels without a column, or columns without a channel."""
    if columns < len(want):
        return f"channel(s) {want[columns:]} would have no column"
    return f"column(s) {list(range(len(want), columns))} would have no channel"


def _channels_advice(cfg: TrainConfig, conv: DataConventions, columns: int) -> str:
    """How to place ``columns`` action columns in the family's action space of ``conv.action_dim`` channels."""
    from flexpack.run.pretrained import field_source

    if columns <= conv.action_dim:
        return (f"set model.overrides.action_channels = {columns} (channels 0..{columns - 1} of the "
                f"{conv.action_dim}-d action space) or model.overrides.{conv.action_channels_field} to the {columns} "
                "channels the dataset's columns fill, in column order")
    space = f"{conv.action_dim_field} = {conv.action_dim}, from {field_source(cfg.model, conv.action_dim_field)}"
    fix = ("" if cfg.model.pretrained else
           f", or train a model of a wider action space (model.overrides.{conv.action_dim_field} >= {columns})")
    return (f"the model's action space has {conv.action_dim} channels ({space}), too few for {columns} columns: "
            f"keep at most {conv.action_dim} of the dataset's action columns{fix}")


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
