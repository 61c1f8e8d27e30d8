"""``parallel.activation_checkpointing = "selective"``: per-op activation checkpointing of the blocks.

Each block runs inside ``torch.utils.checkpoint`` with a policy
(``create_selective_checkpoint_contexts``): the outputs of matmuls (bf16 and float8) and of
attention are saved, everything else — norms, AdaLN modulation, RoPE, gates, casts, activations —
is recomputed in the backward. The expensive half of a block is never run twice, and the
elementwise tensors (fp32 norms and residual casts are the largest activations of a Wan block)
are not kept. Memory lands between no checkpointing and full checkpointing.

With compiled blocks the checkpoint is traced into the block's graph (the block is wrapped first,
then compiled, as torchtitan orders op-level checkpointing and compile), and the forward/backward
partitioner follows the policy; without compile the policy runs eagerly through dispatch modes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten


def save_list() -> set[Any]:
    """The ops whose outputs are kept for the backward."""
    ops: set[Any] = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
                     _aten._scaled_mm.default,  # float8 GEMMs (torchao)
                     # float8 scale reductions: tiny outputs, full passes to redo
                     _aten.max.default, _aten.amax.default,
                     _aten._scaled_dot_product_efficient_attention.default,
                     _aten._scaled_dot_product_flash_attention.default,
                     _aten._scaled_dot_product_cudnn_attention.default,
                     _aten._scaled_dot_product_flash_attention_for_cpu.default}
    hop = getattr(torch.ops.higher_order, "flex_attention", None)
    if hop is not None:  # FlexAttention (Triton and FLASH backends) traced into compiled blocks
        ops.add(hop)
    return ops


_SAVE: set[Any] | None = None


def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save matmul and attention outputs; recompute the rest."""
    global _SAVE
    if _SAVE is None:
        _SAVE = save_list()
    return CheckpointPolicy.MUST_SAVE if func in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def context_fn() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(policy)


def wrap(block: torch.nn.Module) -> torch.nn.Module:
    """``block`` inside a non-reentrant checkpoint with the selective policy (state-dict keys unchanged)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    # no dropout or other randomness in a block: no RNG state to stash and replay
    return checkpoint_wrapper(block, context_fn=context_fn, preserve_rng_state=False)
