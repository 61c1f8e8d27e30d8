"""The model of a config: built (random init, or ``model.pretrained`` loaded through its family) and,
after ``parallelize``, materialized (a sharded pretrained model loads its shards).
:meth:`~flexpack.run.root.Run.build_model` runs the whole sequence.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flexpack.models.registry import ModelFamily
from flexpack.parallel.parallelize import world
from flexpack.run.config import TrainConfig
from flexpack.run.resolve import config_family, model_config_of


def build_model(cfg: TrainConfig, model: Any = None, family: ModelFamily | None = None) -> nn.Module:
    """The model of ``model`` (the resolved model config of ``family``; default the config's own): random
    init, or ``model.pretrained`` loaded. Under several ranks a pretrained model comes back on the meta
    device: :func:`materialize` fills it once sharded. (:meth:`~flexpack.run.root.Run.build_model` does
    the whole sequence.)"""
    from flexpack.run.pretrained import load_single

    model = model_config_of(cfg) if model is None else model
    family = config_family(cfg) if family is None else family
    torch.manual_seed(cfg.runtime.seed)  # every rank starts from the same weights
    if not cfg.model.pretrained:
        return family.build(model)
    if world()[1] > 1:
        with torch.device("meta"):
            return family.build(model)
    return load_single(family, cfg.model.pretrained, model, cfg.runtime.seed)


def materialize(module: nn.Module, cfg: TrainConfig, device: torch.device, model: Any = None,
                family: ModelFamily | None = None) -> None:
    """After ``parallelize``: load ``model.pretrained`` into a model left on the meta device, each
    rank reading only its shards, then LoRA adapters drawn (a no-op for a model that holds weights already)."""
    from flexpack.run.pretrained import is_meta, load_pretrained

    if is_meta(module):
        model = model_config_of(cfg) if model is None else model
        family = config_family(cfg) if family is None else family
        load_pretrained(module, cfg.model.pretrained, model, family, device=device, seed=cfg.runtime.seed)
        if cfg.lora.rank:  # the adapters of a sharded LoRA model, drawn as a single process draws them
            from flexpack.run.lora import init_adapters

            init_adapters(module, cfg.runtime.seed)
