"""Parallelize a plain model of any family from outside (its blocks where its family says they are): float8
linear layers (``parallel.float8``, :mod:`flexpack.parallel.float8`), regional compilation, activation
checkpointing (whole blocks, or per op: :mod:`flexpack.parallel.selective`), then FSDP2 per block, then the root.

The model file knows nothing of ranks. :func:`parallelize` compiles each block's forward
(``compile=True``: one inductor graph per block with FlexAttention inside, so AdaLN modulation,
norms, gates, RoPE and casts fuse around the kernels; every block shares the same compiled code,
so a 30-layer model compiles once), wraps transformer blocks in a non-reentrant checkpoint
wrapper around the compiled forward (all of them, or the first ``n``: selective checkpointing
trades memory for the recompute of the rest), and — only when ``torch.distributed`` is
initialized with more than one rank — applies ``fully_shard`` to every block and finally to the
root module (embeddings, heads), over a 1-D mesh of all ranks. Parameters become DTensors
sharded on dim 0; each block's parameters are all-gathered for its forward and backward.

Checkpoint-wrapped blocks keep their state-dict keys (the wrapper strips its prefix), so
checkpoints load into unwrapped, unsharded models.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from flexpack.attention.flex import GraphCounter, compile_count
from flexpack.errors import UserError
from flexpack.parallel.blocks import Blocks, block_list


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without an initialized process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def check_memory_budget(budget: float, compiled: bool, key: str, why: str) -> None:
    """The activation memory budget rule, written once: below 1 it applies to compiled blocks only
    (the partitioner that honours it runs when a block compiles). ``key``: the budget as the caller
    names it; ``why``: the rest of the line (why the blocks are not compiled, what to set)."""
    if budget < 1.0 and not compiled:
        raise UserError(f"{key} = {budget} applies to compiled blocks{why}")



BLOCK_GRAPHS = GraphCounter()  # the model's blocks (FlexAttnFunc counts its own graphs)


def compiled_graphs() -> int:
    """Graphs compiled so far: the model's blocks plus FlexAttnFunc's own (kernels, block-mask builders)."""
    return BLOCK_GRAPHS.n + compile_count()


def compile_blocks(model: nn.Module, *, fullgraph: bool = True, memory_budget: float = 1.0,
                   blocks: Blocks = "blocks") -> None:
    """Compile each block's ``forward`` (``blocks``: :func:`~flexpack.parallel.blocks.block_list`) in place
    (state-dict keys and module hooks unchanged, so FSDP's hooks stay outside the compiled code).
    Shapes are static: one graph per pack shape.

    ``memory_budget`` < 1: the forward/backward partition of each block keeps at most that share of
    the activations its default partition would save and recomputes the cheapest ops (by FLOPs:
    norms, modulation, RoPE, casts before any matmul) in the backward — selective checkpointing
    chosen by the compiler (``torch._functorch.config.activation_memory_budget``), blocks only."""
    import torch._dynamo

    # every block shares one code object; leave room for a few shapes (pad mode, text-slot buckets)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    backend = BLOCK_GRAPHS.backend if memory_budget >= 1.0 else partial(_budget_backend, memory_budget)
    for block in block_list(model, blocks):
        block.forward = torch.compile(block.forward, backend=backend, fullgraph=fullgraph, dynamic=False)


def _budget_backend(budget: float, gm: torch.fx.GraphModule, example_inputs: list):
    """The block backend with the partitioner's activation memory budget set while it compiles
    (the forward/backward split is decided then)."""
    import torch._functorch.config as functorch_config

    with functorch_config.patch(activation_memory_budget=budget):
        return BLOCK_GRAPHS.backend(gm, example_inputs)


@dataclass(frozen=True, kw_only=True)
class ParallelOptions:
    """How :func:`parallelize` wraps a model: float8 linears (``parallel.float8``), compiled blocks with
    their memory budget, activation checkpointing (``True`` every block, an int ``n`` the first ``n``,
    ``"selective"`` per op), the FSDP compute dtype of the parameters (e.g. bf16; None: fp32) and where the model
    keeps its blocks (its family's ``blocks``: :mod:`flexpack.parallel.blocks`)."""

    compile: bool = False
    activation_checkpointing: bool | int | str = False
    memory_budget: float = 1.0
    float8: str = "off"
    param_dtype: torch.dtype | None = None
    blocks: Blocks = "blocks"
    host_offload: bool = False  # under FSDP2: sharded parameters, gradients and the optimizer step on the host


def parallelize(model: nn.Module, *, device: torch.device, options: ParallelOptions = ParallelOptions()) -> nn.Module:
    """Apply float8 → compile → AC → ``fully_shard`` per block → root, in place; returns ``model``.

    ``options`` (:class:`ParallelOptions`): ``activation_checkpointing``: ``True`` checkpoints every
    block, an int ``n`` the first ``n``, ``"selective"`` every block per op
    (:mod:`flexpack.parallel.selective`: matmul and attention outputs kept, elementwise ops recomputed;
    wrapped before compile so the policy is traced).
    ``float8``: ``parallel.float8`` (:mod:`flexpack.parallel.float8`), applied first, to the blocks'
    linear layers; emulated off CUDA (the train loop checks for an sm89+ GPU before).
    ``param_dtype`` (e.g. bf16) is the FSDP mixed-precision compute dtype of the parameters
    (gradients are reduced in fp32); ignored without FSDP. ``compile``: :func:`compile_blocks`, with
    ``memory_budget`` (checkpointed blocks recompute their whole forward whatever the budget).
    ``host_offload`` (``optim.offload = "optimizer+gradients"`` under several ranks): FSDP2's
    ``CPUOffloadPolicy``, the shards, their gradients and so the optimizer step on the host; ignored without FSDP.
    """
    o = options
    blocks, float8, activation_checkpointing = block_list(model, o.blocks), o.float8, o.activation_checkpointing
    compile, memory_budget, param_dtype = o.compile, o.memory_budget, o.param_dtype
    _, size = world()
    if float8 != "off":  # torchtitan's order: float8 → compile → AC → FSDP2
        from flexpack.parallel import float8 as f8

        f8.convert(model, float8, fsdp=size > 1, emulate=device.type != "cuda", blocks=o.blocks)
    check_memory_budget(memory_budget, compile, "activation_memory_budget", "; compile is off")
    if activation_checkpointing == "selective":  # checkpoint first, then compile: the policy is traced
        from flexpack.parallel import selective

        for i in range(len(blocks)):
            blocks[i] = selective.wrap(blocks[i])
        if compile:
            compile_blocks(model, memory_budget=memory_budget, blocks=o.blocks)
        activation_checkpointing = False
    elif compile:  # inside the checkpoint: a recompute replays the compiled forward
        compile_blocks(model, memory_budget=memory_budget, blocks=o.blocks)
    n_ckpt = len(blocks) if activation_checkpointing is True else int(activation_checkpointing)
    if n_ckpt:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i in range(min(n_ckpt, len(blocks))):
            blocks[i] = checkpoint_wrapper(blocks[i])  # non-reentrant by default
    if size == 1:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (size,))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    # FSDP2's host offload: each shard (and its gradient) lives on the host, copied in per block for compute
    off = CPUOffloadPolicy(pin_memory=device.type == "cuda") if o.host_offload else OffloadPolicy()
    for i, block in enumerate(blocks):
        # the last block's parameters are needed again right away in backward: keep them gathered
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=off, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=off)
    return model


def plain_name(name: str) -> str:
    """The state-dict name of a parameter (activation-checkpoint wrappers removed)."""
    return name.replace("._checkpoint_wrapped_module", "")
