"""LeRobot datasets, the latent cache and the dataset items the collates consume.

Nothing here imports lerobot at module import time: every module imports it inside the
functions that need it, so ``import flexpack.data`` (and ``flexpack.data.lengths``'s pure
helpers) work without lerobot installed.

Modules:
    lengths   latent frames per episode from LeRobot metadata (no data loaded)
    cache     the latent/text cache on disk (safetensors, atomic writes, paths)
    problems  every problem ``check-dataset`` reports, and the errors the dataset raises
    actions   action alignment to latent frames, normalization, channel mapping
    action_stats  exact pooled statistics of every action/state dimension (``LATENTS/stats.json``)
    stats_report  what the normalization clips per dimension (for ``check-dataset``)
    segments  annotated segments (per-frame task runs) and the latent frames each one gets
    dataset   ``LatentEpisodeDataset``
    encoders  video encoders (``pool`` stand-in, ``wan-vae:PATH``)
    text      text encoders (``hash`` stand-in)
    encode    ``flexpack encode``;  synthetic: ``flexpack make-dataset``;  check: ``flexpack check-dataset``
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "latent_frames": "flexpack.data.lengths",
    "dataset_latent_frames": "flexpack.data.lengths",
    "LatentEpisodeDataset": "flexpack.data.dataset",
    "DatasetProblemError": "flexpack.data.problems",
    "Problem": "flexpack.data.problems",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'flexpack.data' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
