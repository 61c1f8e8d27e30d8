"""Weights that hold a NaN or an infinity, named before any step or sample.

A checkpoint, an export or a ``model.pretrained`` file can be intact byte for byte (its manifest or safetensors
header agrees) and still hold non-finite weights: saved from a run that diverged, or damaged before it was
written. Training from them fails at the first step with a non-finite loss, which looks like a learning-rate
problem; sampling from them gives NaN metrics. :func:`check_finite` names the first such tensor where the
weights are read, in one line (``ValueError``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from flexpack.parallel.parallelize import world


def nonfinite(t: torch.Tensor) -> str | None:
    """``"3 NaN and 0 infinite of 4,096 values"`` for a floating tensor holding any, else None (this rank's
    shard of a DTensor)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    if hasattr(local, "dequantize") and hasattr(local, "qmap"):  # torchao's low-bit optimizer states
        local = local.dequantize()
    if not (local.is_floating_point() or local.is_complex()) or bool(torch.isfinite(local).all()):
        return None
    nan = int(torch.isnan(local).sum())
    inf = int((~torch.isfinite(local)).sum()) - nan
    return f"{nan:,} NaN and {inf:,} infinite of {local.numel():,} values"


def first_nonfinite(tensors: Mapping[str, Any]) -> tuple[str, str] | None:
    """(name, what) of the first tensor of ``tensors`` holding a non-finite value, nested mappings read as
    ``outer.inner`` (a checkpoint state: ``{"model": {...}, "ema": {...}}``); None when every value is finite."""
    for name, value in tensors.items():
        if isinstance(value, Mapping):
            found = first_nonfinite(value)
            if found is not None:
                return f"{name}.{found[0]}", found[1]
        elif isinstance(value, torch.Tensor):
            what = nonfinite(value)
            if what is not None:
                return str(name), what
    return None


def check_finite(tensors: Mapping[str, Any], where: str, fix: str, *, collective: bool = True) -> None:
    """ValueError ``"{where}: weight NAME holds ... ; {fix}"`` for the first non-finite tensor of ``tensors``.
    ``collective`` (every rank calls it, each holding its shards): every rank raises or none (one that went on
    would wait forever in its next collective), naming the lowest rank's; else (full tensors, the same on every
    rank that reads them) each rank checks alone."""
    found = first_nonfinite(tensors)
    if collective and world()[1] > 1:
        seen: list[Any] = [None] * world()[1]
        dist.all_gather_object(seen, found)
        found = next((f for f in seen if f is not None), None)
    if found is not None:
        raise ValueError(f"{where}: weight {found[0]!r} holds non-finite values ({found[1]}); {fix}")
