"""Reading a run's checkpoint for ``export``, and writing files others can read.

- :func:`load_checkpoint`: the checkpoint's own ``config.json`` (not the run's first one: a run
  started over with another model keeps the first) with ``--set`` overrides, and a
  single-process model (and EMA) holding its weights.
- :func:`ordinary_modes`, :func:`remove_stale`: exported files readable by teammates (safetensors
  writes 0600), and the ``.tmp-OUT-PID`` folders of killed exports removed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def load_checkpoint(
    found: Path, run: Path, ema: bool, overrides: Sequence[str]
) -> tuple[Any, Any, Any, dict[str, Any]]:
    """The checkpoint's config (its own config.json, else the run's first) with ``overrides``, and a
    single-process model (and EMA) with its weights; returns (config, model, ema or None, train_state)."""
    from flexpack.models import WanVA
    from flexpack.run.config import load_config
    from flexpack.run.state import checkpoint
    from flexpack.run.state.trained import run_config
    from flexpack.training.ema import EMA

    source = run_config(run, found)
    if ema and not checkpoint.has_ema(found):
        raise ValueError(f"{found}: holds no EMA weights (trained with optim.ema_decay = 0); export without --ema")
    cfg = load_config(source, overrides)
    formats = cfg.model.model_family().export_formats
    if "diffusers" not in formats:  # what this export writes; other formats hang off the family's entry
        raise ValueError(f"{found}: a model.family = {cfg.model.family!r} checkpoint; flexpack export writes the "
                         f"'diffusers' format, this family's are {list(formats)} (not written by flexpack export yet)")
    wcfg = cfg.model.wan_config()
    with torch.device("meta"):
        model = WanVA(wcfg)
    model.to_empty(device="cpu")  # every tensor is overwritten by the checkpoint
    averaged = EMA(model, 0.5) if ema else None  # the decay is irrelevant: only loaded, never updated
    state = checkpoint.load(found, model, restore_rng=False, ema=averaged)
    return cfg, model, averaged, state


def ordinary_modes(folder: Path) -> None:
    """Files ``0666`` and folders ``0777`` minus the umask: safetensors writes its files private (0600)."""
    from flexpack.atomic import _umask

    mask = _umask()
    for p in [folder, *folder.rglob("*")]:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def remove_stale(out: Path) -> None:
    """Remove ``.tmp-OUT-PID`` folders of exports that were killed (their PID no longer runs here)."""
    from flexpack.atomic import remove_dead_temporaries

    for p in remove_dead_temporaries(out.parent, f".tmp-{out.name}-*"):
        print(f"export: removed {p} (a killed export)", file=sys.stderr)
