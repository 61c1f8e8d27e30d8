"""flexpack: packed, variable-length robot episodes for video/VLA diffusion transformers.

The package is a stack of layers, each importing only downwards (docs/ARCHITECTURE.md):

    packing/    samplers, bin packing, collates, the sequence layout, waste stats (every user)
    attention/  mask_mods, block masks, ``FlexAttnFunc`` (any model; needs only the layout types)
    models/     what model families share (blocks, RoPE, the registry); data/: LeRobot datasets and caches
    run/        config, the composition root, pretrained weights, run state (checkpoints, resume)
    training/   loop, step, validation; sampling/: solvers, metrics, media; tools/: export, verify
    families/   one folder per model family (wan/, lingbot/): model, config, objective, sampler, exports

``flexpack.atomic``, ``flexpack.errors`` and the command line stay at the top. The names users write most
(:data:`__all__`) are re-exported here and imported on first use, so ``import flexpack`` stays cheap and
never imports lerobot (``flexpack.data`` imports it lazily).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# the public names: what users import from flexpack (a name moved elsewhere keeps its old path for one minor
# version with a DeprecationWarning; CHANGELOG.md lists each move)
__all__ = [
    "Batch",
    "FlexAttnFunc",
    "LatentEpisodeDataset",
    "LengthBucketBatchSampler",
    "LingbotConfig",
    "LingbotVA",
    "PackCollate",
    "PadCollate",
    "SequenceLayout",
    "TokenBudgetBatchSampler",
    "TokenLayout",
    "TrainConfig",
    "WanVA",
    "WanVAConfig",
    "load_config",
    "train",
]

# name -> the module that defines it, imported on first use
_LAZY = {
    "Batch": "flexpack.packing.collate",
    "FlexAttnFunc": "flexpack.attention.flex",
    "LatentEpisodeDataset": "flexpack.data",
    "LengthBucketBatchSampler": "flexpack.packing.batch_sampler",
    "LingbotConfig": "flexpack.families.lingbot.config",
    "LingbotVA": "flexpack.families.lingbot.model",
    "PackCollate": "flexpack.packing.collate",
    "PadCollate": "flexpack.packing.collate",
    "SequenceLayout": "flexpack.packing.layout",
    "TokenBudgetBatchSampler": "flexpack.packing.batch_sampler",
    "TokenLayout": "flexpack.packing.layout",
    "TrainConfig": "flexpack.run.config",
    "WanVA": "flexpack.families.wan.model",
    "WanVAConfig": "flexpack.families.wan.config",
    "load_config": "flexpack.run.config",
    "train": "flexpack.training.loop",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'flexpack' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
