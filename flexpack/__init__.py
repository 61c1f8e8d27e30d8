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
import importlib.abc
import importlib.util
import sys
from types import ModuleType
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


# Module paths that moved with no file left behind (so that git follows each file to its new place): old path ->
# new module. Importing an old path works until flexpack 0.3 and warns, naming the new place (CHANGELOG.md).
MOVED_MODULES = {
    "flexpack.models.wan": "flexpack.families.wan.model",
    "flexpack.models.wan_config": "flexpack.families.wan.config",
    "flexpack.models.wan_convert": "flexpack.families.wan.convert",
    "flexpack.models.lingbot": "flexpack.families.lingbot.model",
    "flexpack.models.lingbot_config": "flexpack.families.lingbot.config",
    "flexpack.models.lingbot_convert": "flexpack.families.lingbot.convert",
    "flexpack.models.lingbot_family": "flexpack.families.lingbot.family",
    "flexpack.flow.lingbot": "flexpack.families.lingbot.objective",
    "flexpack.sampling.lingbot": "flexpack.families.lingbot.sampler",
    "flexpack.tools.export_lerobot": "flexpack.families.lingbot.export_lerobot",
    "flexpack.tools.export_upstream": "flexpack.families.lingbot.export_upstream",
    "flexpack.tools.export_bundle": "flexpack.families.lingbot.export_bundle",
    "flexpack.attention.mask_lingbot": "flexpack.families.lingbot.mask",
    "flexpack.tools.config_doc": "flexpack.run.config_doc",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path of :data:`MOVED_MODULES` (last on ``sys.meta_path``: only where no file answers) as a
    module that warns once and reads every name from the new one (``flexpack.training.deprecated.moved``)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED_MODULES else None

    def exec_module(self, module: ModuleType) -> None:
        from flexpack.training.deprecated import moved

        module.__getattr__ = moved(module.__name__, importlib.import_module(MOVED_MODULES[module.__name__]))


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
