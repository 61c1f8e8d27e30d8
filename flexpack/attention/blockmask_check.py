"""Helpers that read block masks and segment masks back, for tests and benchmarks: the dense block flags of
a ``BlockMask`` (:func:`block_structure`) and the exact count of (query, key) pairs a mask allows
(:func:`unmasked_pairs`, what TFLOP/s counts are made of)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from .segments import _segments


def unmasked_pairs(mask_mod: Callable) -> int:
    """Exact count of the (query, key) pairs a segment mask allows, from its segments (no T x T
    grid): the mask is constant over a pair of segments, so each allowed segment pair counts
    ``len(q segment) * len(kv segment)``. ``mask_mod``: a mask carrying ``q_keys`` / ``kv_keys``
    (what :func:`flexpack.attention.masks.make_mask` returns). Benchmarks count TFLOP/s by it."""
    nq, nk = len(mask_mod.q_keys[0]), len(mask_mod.kv_keys[0])
    sq, rq, *_ = _segments(mask_mod.q_keys, nq, nq)
    sk, rk, *_ = _segments(mask_mod.kv_keys, nk, nk)
    Sq, Sk = int(sq[-1]) + 1, int(sk[-1]) + 1
    lq = torch.bincount(sq, minlength=Sq).double()
    lk = torch.bincount(sk, minlength=Sk).double()
    z = torch.zeros((), dtype=torch.long, device=sq.device)
    m = mask_mod(z, z, rq[:Sq, None], rk[None, :Sk]).double()  # (Sq, Sk) one representative token each
    return int(lq @ m @ lk)


def block_structure(bm: BlockMask) -> tuple[Tensor, Tensor]:
    """(partial, full) dense (Nbq, Nbk) bool block flags of a BlockMask, for comparisons."""
    nq, nk = bm.kv_indices.shape[-2], bm.kv_indices.shape[-1]

    def dense(num: Tensor, idx: Tensor) -> Tensor:
        num, idx = num.reshape(nq), idx.reshape(nq, nk)
        keep = torch.arange(nk, device=idx.device)[None, :] < num[:, None]
        out = torch.zeros(nq, nk + 1, dtype=torch.bool, device=idx.device)
        out[torch.arange(nq, device=idx.device)[:, None], torch.where(keep, idx.long(), nk)] = True
        return out[:, :nk]

    full = dense(bm.full_kv_num_blocks, bm.full_kv_indices) if bm.full_kv_num_blocks is not None else None
    partial = dense(bm.kv_num_blocks, bm.kv_indices)
    return partial, full if full is not None else torch.zeros_like(partial)
