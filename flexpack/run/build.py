"""The datasets a config describes over ``data.root`` and its train / held-out split: what
:func:`flexpack.run.compose.compose` opens for each role (training, validation, sampling), so all see the same
episodes; the model comes from :meth:`~flexpack.run.root.Run.build_model` (:mod:`flexpack.run.model`).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from flexpack.data.formats import is_bundle
from flexpack.errors import moved_names
from flexpack.models.registry import DataConventions
from flexpack.run.checks import config_terms
from flexpack.run.config import TrainConfig
from flexpack.run.pretrained import check_camera_layout
from flexpack.run.resolve import config_family, model_config_of
from flexpack.run.root import EpisodeDataset, Split


def open_dataset(cfg: TrainConfig, episodes: Sequence[int] | None = None, *,
                 segments: bool | str | None = None, text_dropout: bool = True, model_cfg: Any = None,
                 family: Any = None) -> EpisodeDataset:
    """The config's ``LatentEpisodeDataset`` over ``episodes`` (dataset episode indices; all by default);
    ``segments`` overrides ``data.segments`` (sampling takes whole episodes). The action width, the
    channels the dataset's action columns fill and the cameras are the model family's data conventions
    (:class:`~flexpack.models.registry.DataConventions`; WanVA: its ``action_channels``, column j ->
    channel j, ``data.cameras``). ``model_cfg`` / ``family``: the run's (default: resolved here)."""
    from flexpack.data import LatentEpisodeDataset

    d = cfg.data
    model_cfg = model_config_of(cfg) if model_cfg is None else model_cfg
    fam = config_family(cfg) if family is None else family
    conv = fam.conventions(model_cfg)
    if d.datasets:
        return open_mixture(cfg, conv, episodes, text_dropout=text_dropout)
    if not d.root:
        raise ValueError("data.root is empty: set it to a LeRobot dataset folder with a latent cache")
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
    cameras = list(conv.cameras) or (list(d.cameras) if d.cameras else None)
    if conv.cameras and d.cameras and list(d.cameras) != list(conv.cameras):
        raise ValueError(f"data.cameras = {list(d.cameras)}, but the model composes {list(conv.cameras)} in this "
                         f"order ({conv.cameras_key}); drop data.cameras or make them agree")
    return BundleDataset(
        d.root, cameras=cameras, camera_layout=d.camera_layout, action_dim=conv.action_dim,
        action_channels=list(conv.action_channels) if conv.action_channels is not None else None,
        action_steps=d.action_steps, normalize=d.normalize, norm_stat=read_norm_stat(d.norm_stat),
        action_transform=d.action_transform, cfg_prob=d.cfg_prob if text_dropout else 0.0, seed=d.seed,
        missing=d.missing, episodes=list(episodes) if episodes is not None else None,
    )


def open_mixture(cfg: TrainConfig, conv: DataConventions, episodes: Sequence[int] | None = None, *,
                 text_dropout: bool = True) -> EpisodeDataset:
    """The config's :class:`~flexpack.data.mixture.MixtureDataset` (``[[data.datasets]]``): one
    :class:`~flexpack.data.bundle.BundleDataset` per entry with its own options (the family's where it sets
    none), ``episodes`` as mixture-wide ids; sources of one ``embodiment`` share their pooled statistics."""
    from flexpack.data.bundle import BundleDataset
    from flexpack.data.formats import read_norm_stat
    from flexpack.data.mixture import MixtureDataset, entry_name, pooled_model_space

    d = cfg.data
    counts = entry_episode_counts(cfg)
    offsets = [sum(counts[:k]) for k in range(len(counts))]
    sources: list[BundleDataset | None] = []
    for k, e in enumerate(d.datasets):
        local = None if episodes is None else [g - offsets[k] for g in episodes if 0 <= g - offsets[k] < counts[k]]
        if local is not None and not local:
            sources.append(None)
            continue
        channels = e.action_channels if e.action_channels is not None else conv.action_channels
        try:
            sources.append(BundleDataset(
                e.root, cameras=list(e.cameras or conv.cameras or ()) or None, camera_layout=e.camera_layout,
                action_dim=conv.action_dim, action_channels=list(channels) if channels is not None else None,
                action_steps=d.action_steps, normalize=d.normalize, norm_stat=read_norm_stat(e.norm_stat),
                action_transform=e.action_transform, cfg_prob=d.cfg_prob if text_dropout else 0.0,
                seed=d.seed + 7919 * k, missing=d.missing, episodes=local))
        except ValueError as exc:
            raise ValueError(f"data.datasets[{k}] ({e.root}): {exc}") from None
    for group in {e.embodiment for e in d.datasets if e.embodiment and not e.norm_stat}:
        members = [s for s, e in zip(sources, d.datasets) if s is not None and e.embodiment == group
                   and not e.norm_stat]
        if d.normalize and len(members) > 1:
            q01, q99 = pooled_model_space(members)
            for s in members:
                s.q01, s.q99 = q01, q99
    names = [entry_name(e) for e in d.datasets]
    # weights shape training epochs; held-out loss and sampling see every held-out item once
    weighted = d.datasets[0].weight is not None and text_dropout
    weights = [float(e.weight) for e in d.datasets] if weighted else None
    return MixtureDataset(sources, names, counts, weights)


def entry_episode_counts(cfg: TrainConfig) -> list[int]:
    """Episodes of every ``data.datasets`` entry (each a bundle root or a v2.1 dataset), read from metadata."""
    from flexpack.data.bundle_files import find_datasets
    from flexpack.data.v21 import Dataset21

    return [sum(len(Dataset21.open(f).episodes) for f in find_datasets(e.root)) for e in cfg.data.datasets]


def episodes_of(cfg: TrainConfig) -> list[int]:
    """Every episode index of ``data.root`` (a bundle's: its (dataset, episode) pairs numbered in order)."""
    from flexpack.data.episodes import EpisodeSource

    if cfg.data.datasets:
        return list(range(sum(entry_episode_counts(cfg))))
    if is_bundle(cfg.data):
        from flexpack.data.bundle_files import find_datasets
        from flexpack.data.v21 import Dataset21

        return list(range(sum(len(Dataset21.open(f).episodes) for f in find_datasets(cfg.data.root))))
    return list(EpisodeSource(cfg.data.root).episodes)


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
    from flexpack.run.holdout import split_episodes

    d = cfg.data
    if not d.root and not d.datasets:
        raise ValueError("data.root is empty: set it to a LeRobot dataset folder with a latent cache")
    if not (d.val_fraction or d.val_episodes):
        return Split()
    with config_terms(cfg):
        train, held = split_episodes(episodes_of(cfg), d, d.root)
    return Split(train=tuple(train), held_out=tuple(held))


def sample_dataset(cfg: TrainConfig, episodes: Sequence[int] | None = None, *,
                   held_out: Sequence[int] | None = None, **run: Any) -> EpisodeDataset:
    """The config's dataset with whole episodes (no task segments, no text dropout), as sampling takes them:
    ``episodes`` (dataset episode indices, each checked to exist), ``held_out`` (the split's held-out ones: ``sample
    --val``, the sampling hook), or all."""
    d = cfg.data
    if not d.root and not d.datasets:
        raise ValueError("data.root is empty: set it to a LeRobot dataset folder with a latent cache")
    if held_out is not None:
        if not (d.val_fraction or d.val_episodes):
            raise ValueError("--val needs held-out episodes: the config sets neither data.val_fraction nor "
                             "data.val_episodes (pass --episodes instead)")
        episodes = held_out
    elif episodes is not None:
        known = episodes_of(cfg)
        bad = sorted(set(episodes) - set(known))
        if bad:
            raise ValueError(f"episodes {bad} are not in {d.root} (it has {len(known)} episodes: "
                             f"{known[0]}..{known[-1]})")
    return open_dataset(cfg, episodes, segments=False, text_dropout=False, **run)


# build_run moved to flexpack.run.compose (which imports this module)
__getattr__ = moved_names(__name__, {"build_run": "flexpack.run.compose"})
