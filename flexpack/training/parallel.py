"""Parallelize a plain WanVA from outside: activation checkpointing, then FSDP2 per block, then the root.

The model file knows nothing of ranks. :func:`parallelize` wraps each transformer block in a
non-reentrant checkpoint wrapper (when asked), and — only when ``torch.distributed`` is
initialized with more than one rank — applies ``fully_shard`` to every block and finally to the
root module (embeddings, heads), over a 1-D mesh of all ranks. Parameters become DTensors
sharded on dim 0; each block's parameters are all-gathered for its forward and backward.

Checkpoint-wrapped blocks keep their state-dict keys (the wrapper strips its prefix), so
checkpoints load into unwrapped, unsharded models.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without an initialized process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def parallelize(
    model: nn.Module,
    *,
    device: torch.device,
    activation_checkpointing: bool = False,
    param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Apply AC → ``fully_shard`` per block → root, in place; returns ``model``.

    ``param_dtype`` (e.g. bf16) is the FSDP mixed-precision compute dtype of the parameters
    (gradients are reduced in fp32); ignored without FSDP.
    """
    blocks = model.blocks
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block)  # non-reentrant by default
    _, size = world()
    if size == 1:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (size,))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for i, block in enumerate(blocks):
        # the last block's parameters are needed again right away in backward: keep them gathered
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model
