"""Build what a config describes: its plan over ``data.root`` (:func:`build_data`, the dataset with
its sampler and collate: :mod:`flexpack.run.root`) and the model.

Shared by :mod:`flexpack.training.loop` and :mod:`flexpack.tools.verify`, so both see the same micro-batches.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from flexpack.models.wan_config import WanVAConfig
from flexpack.parallel.parallelize import world
from flexpack.run.checks import config_terms
from flexpack.run.config import TrainConfig
from flexpack.run.root import Plan, plan_for


def open_dataset(cfg: TrainConfig, episodes: Sequence[int] | None = None, *, segments: bool | str | None = None,
                 model: WanVAConfig | None = None) -> Any:
    """The config's ``LatentEpisodeDataset`` over ``episodes`` (dataset episode indices; all by default);
    ``segments`` overrides ``data.segments`` (sampling takes whole episodes). ``model``: the resolved
    model config, where the caller has it (its ``action_channels`` are the dataset's action width)."""
    from flexpack.data import LatentEpisodeDataset

    d, m = cfg.data, cfg.model.wan_config() if model is None else model
    if not d.root:
        raise ValueError("data.root is empty: set it to a LeRobot dataset folder with a latent cache")
    return LatentEpisodeDataset(
        d.root, latents_dir=d.latents_dir, action_dim=max(m.action_channels, 1), action_steps=d.action_steps,
        stride=d.stride, cameras=list(d.cameras) if d.cameras else None, normalize=d.normalize,
        segments=d.segments if segments is None else segments,
        episodes=list(episodes) if episodes is not None else None, action_stats=d.action_stats,
    )


def build_data(cfg: TrainConfig, rank: int = 0, world_size: int = 1, *, split: str = "train",
               model: WanVAConfig | None = None) -> Plan:
    """The run's :class:`~flexpack.run.root.Plan` over ``data.root``: dataset, this rank's sampler
    and the matching collate, checked to fit the model. ``split``: the training episodes or the
    held-out ``"val"`` ones (:mod:`flexpack.training.validation`); ``model``: the resolved model config
    where the caller has it."""
    from flexpack.data.episodes import EpisodeSource
    from flexpack.run.holdout import split_episodes

    d = cfg.data
    if not d.root:
        raise ValueError("data.root is empty: set it to a LeRobot dataset folder with a latent cache")
    m = cfg.model.wan_config() if model is None else model
    episodes = None
    with config_terms(cfg):
        if d.val_fraction or d.val_episodes:
            episodes = split_episodes(EpisodeSource(d.root).episodes, d, d.root)[split == "val"]
        ds = open_dataset(cfg, episodes, model=m)
    return plan_for(ds, cfg, rank=rank, world_size=world_size, model=m)


def build_model(cfg: TrainConfig, model: WanVAConfig | None = None) -> nn.Module:
    """The config's WanVA: random init, or ``model.pretrained`` loaded. Under several ranks a
    pretrained model comes back on the meta device: :func:`materialize` fills it once sharded.
    ``model``: the resolved model config (a plan's ``model``; default: resolved here)."""
    from flexpack.models import WanVA
    from flexpack.run.pretrained import load_single

    torch.manual_seed(cfg.runtime.seed)  # every rank starts from the same weights
    wcfg = cfg.model.wan_config() if model is None else model
    if not cfg.model.pretrained:
        return WanVA(wcfg)
    if world()[1] > 1:
        with torch.device("meta"):
            return WanVA(wcfg)
    return load_single(WanVA, cfg.model.pretrained, wcfg, cfg.runtime.seed)


def materialize(model: nn.Module, cfg: TrainConfig, device: torch.device, wcfg: WanVAConfig | None = None) -> None:
    """After ``parallelize``: load ``model.pretrained`` into a model left on the meta device, each
    rank reading only its shards (a no-op for a model that holds weights already). ``wcfg``: the
    resolved model config (a plan's ``model``)."""
    from flexpack.run.pretrained import is_meta, load_pretrained

    if is_meta(model):
        wcfg = cfg.model.wan_config() if wcfg is None else wcfg
        load_pretrained(model, cfg.model.pretrained, wcfg, device=device, seed=cfg.runtime.seed)
