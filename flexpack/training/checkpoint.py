"""Checkpoints: full (unsharded) state dicts, written by rank 0 into a folder that appears atomically.

Layout of ``RUN/checkpoints/step_00000040/``::

    model.pt          full model state dict (torch.save; load with weights_only=True)
    optim.pt          full optimizer state dict, keyed by parameter name
    rng.pt            rank 0's torch CPU (and CUDA) RNG state
    ema.pt            EMA weights by parameter name, when optim.ema_decay > 0
    train_state.json  {"step", "sampler" (the sampler's state_dict), "world_size", "extra"}

State dicts go through ``torch.distributed.checkpoint.state_dict`` (``get_state_dict`` /
``set_state_dict`` with ``full_state_dict=True``), so the same files come from and go into an
FSDP2-sharded model or a plain one. Saving is collective (every rank must call :func:`save`);
only rank 0 writes, into ``.tmp-step_…`` first, renamed to ``step_…`` when complete — a crash
never leaves a half-written ``step_…`` folder, and :func:`latest` ignores temporary ones.
Loading reads the files on every rank (a shared filesystem) and lets DCP shard them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from flexpack.training.checks import check_state_shapes
from flexpack.training.parallel import world

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoint folders under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / "train_state.json").is_file()]
    return sorted(found, key=lambda p: p.name)


def latest(root: str | os.PathLike) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def _barrier() -> None:
    if world()[1] > 1:
        dist.barrier()


def save(
    root: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    sampler_state: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    keep: int | None = None,
    ema: Any = None,
) -> Path:
    """Write checkpoint ``step`` (collective); keep the newest ``keep`` checkpoints. Returns its folder.
    ``ema``: a :class:`~flexpack.training.ema.EMA`, written as ``ema.pt`` (full tensors by name)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
    else:
        model_sd, optim_sd = get_model_state_dict(model, options=opts), None
    ema_sd = ema.full_state_dict() if ema is not None else None  # collective under FSDP
    rank, size = world()
    final = step_dir(root, step)
    if rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        torch.save(model_sd, tmp / "model.pt")
        if optim_sd is not None:
            torch.save(optim_sd, tmp / "optim.pt")
        if ema_sd is not None:
            torch.save(ema_sd, tmp / "ema.pt")
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, tmp / "rng.pt")
        state = {"step": step, "sampler": sampler_state, "world_size": size, "extra": extra or {}}
        (tmp / "train_state.json").write_text(json.dumps(state, indent=2) + "\n")
        if final.exists():  # re-saving a step: move the old one aside first (rename needs a free name)
            old = final.with_name(f".old-{final.name}-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        if keep is not None:
            for path in list_checkpoints(root)[:-keep]:
                shutil.rmtree(path, ignore_errors=True)
    _barrier()
    return final


def load(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
    ema: Any = None,
) -> dict[str, Any]:
    """Load a checkpoint folder into ``model`` (sharded or not) and ``optimizer``; return train_state.
    ``ema`` gets ``ema.pt``, or restarts at the loaded weights where the checkpoint has none."""
    path = Path(path)
    state_file = path / "train_state.json"
    if not state_file.is_file():
        raise ValueError(f"{path}: not a checkpoint folder (no train_state.json)")
    model_sd = torch.load(path / "model.pt", map_location="cpu", weights_only=True, mmap=True)
    check_state_shapes(path / "model.pt", model_sd, model)  # one line instead of torch's line per tensor
    opts = StateDictOptions(full_state_dict=True)
    if optimizer is not None:
        if not (path / "optim.pt").is_file():
            raise ValueError(f"{path}: has no optim.pt; load the model alone (optimizer=None)")
        optim_sd = torch.load(path / "optim.pt", map_location="cpu", weights_only=True, mmap=True)
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=opts)
    else:
        set_model_state_dict(model, model_sd, options=opts)
    if ema is not None:
        ema_file = path / "ema.pt"
        ema.load_state_dict(torch.load(ema_file, map_location="cpu", weights_only=True) if ema_file.is_file() else None)
    if restore_rng and (path / "rng.pt").is_file():
        rng = torch.load(path / "rng.pt", weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return json.loads(state_file.read_text())
