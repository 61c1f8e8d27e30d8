"""flexpack: packed, variable-length robot episodes for video/VLA diffusion transformers.

Three wings, each importing only downwards:

    packing/    samplers, bin packing, collates, the sequence layout, waste stats (every user)
    attention/  mask_mods, block masks, ``FlexAttnFunc`` (any model; needs only the layout types)
    training/   config, build, train loop, objective, noise, parallelism, checkpoints, profiling, metrics, verify

beside ``data/`` (LeRobot datasets, latent and text caches, encoders) and ``models/`` (the Wan
DiT). ``flexpack.atomic``, ``flexpack.errors`` and the command line stay at the top. The names users write most are
re-exported here and imported on first use, so ``import flexpack`` stays cheap and never
imports lerobot (``flexpack.data`` imports it lazily).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "LengthBucketBatchSampler": "flexpack.packing.batch_sampler",
    "TokenBudgetBatchSampler": "flexpack.packing.batch_sampler",
    "PadCollate": "flexpack.packing.collate",
    "PackCollate": "flexpack.packing.collate",
    "Batch": "flexpack.packing.collate",
    "SequenceLayout": "flexpack.packing.layout",
    "TokenLayout": "flexpack.packing.layout",
    "FlexAttnFunc": "flexpack.attention.flex",
    "WanVA": "flexpack.models.wan",
    "WanVAConfig": "flexpack.models.wan_config",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'flexpack' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
