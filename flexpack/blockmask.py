"""FlexAttention block masks from per-block segment ranges, without evaluating the T x T grid.

Idea: the masks of :mod:`flexpack.masks` depend only on a few per-token keys (episode, copy,
chunk, ...), listed on each mask_mod as ``q_keys`` / ``kv_keys``. A *segment* is a maximal run of
tokens whose keys are all equal, so the mask is constant on every (q-segment, kv-segment)
rectangle. Tokens keep episodes contiguous, so a 128-token block covers a contiguous range of
segments ``[lo, hi]``, each with at least one token inside the block. Hence, exactly:

* a block pair is *non-empty* iff some segment pair of its rectangle is allowed;
* it is *full* iff every segment pair is allowed and neither block runs past the sequence end
  (``create_block_mask`` pads the grid with ``False``, so such blocks are partial there too).

We evaluate the mask once per segment pair (S x S, S ~ T / tokens-per-frame), take a 2-D prefix
sum and read every block rectangle with four gathers: O(S^2 + Nb^2) work in ~20 tensor ops, no
host sync when the caller passes segment bounds, and all shapes static per layout signature, so
the whole build can be ``torch.compile``'d once per signature on CUDA.

The result is the same ``BlockMask`` that ``create_block_mask`` builds (identical partial/full
block sets and index order: True blocks first, ascending), tested in ``tests/test_blockmask.py``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

BLOCK = 128
# above this many segments per side the S x S grid stops being cheap: use create_block_mask
MAX_SEGMENTS = 8192


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _segments(keys: tuple[Tensor, ...], length: int, s_max: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Segment id per token, a representative token per segment, and each block's segment range."""
    dev = keys[0].device
    new = torch.zeros(length, dtype=torch.bool, device=dev)
    new[0] = True
    for k in keys:
        new[1:] |= k[1:] != k[:-1]
    seg = new.long().cumsum(0) - 1  # (T,)
    tok = torch.arange(length, device=dev)
    # any token of a segment represents it (the mask is constant there); absent ids keep 0
    rep = torch.zeros(s_max, dtype=torch.long, device=dev).scatter_reduce_(0, seg, tok, "amax", include_self=False)
    nb = _cdiv(length, BLOCK)
    starts = torch.arange(nb, device=dev) * BLOCK
    ends = (starts + BLOCK).clamp(max=length) - 1
    over = starts + BLOCK > length  # the last block runs past the end: never full
    return seg, rep, seg[starts], seg[ends], over


def _ordered(m: Tensor) -> tuple[Tensor, Tensor]:
    """(..., N) bool -> (count, indices) with True columns first, ascending (= stable argsort desc)."""
    mi = m.to(torch.int32)
    t = mi.cumsum(-1)
    n = t[..., -1:]
    f = (1 - mi).cumsum(-1)
    pos = torch.where(m, t - 1, n + f - 1).long()
    cols = torch.arange(m.shape[-1], device=m.device, dtype=torch.int32).expand_as(mi)
    idx = torch.empty_like(mi).scatter_(-1, pos, cols)
    return n[..., 0].contiguous(), idx


def _classify(
    seg_mask: Tensor, lq: Tensor, hq: Tensor, oq: Tensor, lk: Tensor, hk: Tensor, ok: Tensor
) -> tuple[Tensor, Tensor]:
    """(Nbq, Nbk) partial and full block flags from the segment mask and block segment ranges."""
    sq, sk = seg_mask.shape
    p = torch.zeros(sq + 1, sk + 1, dtype=torch.int32, device=seg_mask.device)
    p[1:, 1:] = seg_mask.to(torch.int32).cumsum(0).cumsum(1)
    rows_hi, rows_lo = p[hq + 1], p[lq]  # (Nbq, Sk+1)
    count = rows_hi[:, hk + 1] - rows_lo[:, hk + 1] - rows_hi[:, lk] + rows_lo[:, lk]
    area = (hq - lq + 1)[:, None] * (hk - lk + 1)[None, :]
    full = (count == area) & ~oq[:, None] & ~ok[None, :]
    partial = (count > 0) & ~full
    return partial, full


def _structure(
    mask_mod: Callable,
    q_keys: tuple[Tensor, ...],
    kv_keys: tuple[Tensor, ...],
    q_len: int,
    kv_len: int,
    sq_max: int,
    sk_max: int,
) -> tuple[Tensor, ...]:
    """All eight BlockMask index tensors, shaped (1, 1, ...)."""
    _, rq, lq, hq, oq = _segments(q_keys, q_len, sq_max)
    _, rk, lk, hk, ok = _segments(kv_keys, kv_len, sk_max)
    zero = torch.zeros((), dtype=torch.long, device=rq.device)
    seg_mask = mask_mod(zero, zero, rq[:, None], rk[None, :]).expand(sq_max, sk_max)
    partial, full = _classify(seg_mask, lq, hq, oq, lk, hk, ok)
    out = []
    for m in (partial, full, partial.t(), full.t()):
        n, idx = _ordered(m)
        out += [n[None, None], idx[None, None]]
    return tuple(out)


def _num_segments(keys: tuple[Tensor, ...]) -> int:
    n = 1
    new = torch.zeros_like(keys[0], dtype=torch.bool)
    for k in keys:
        new[1:] |= k[1:] != k[:-1]
    return n + int(new[1:].sum())


class BlockMaskBuilder:
    """Builds block masks from mask_mods of :mod:`flexpack.masks`; optionally compiled (CUDA).

    ``compile=True`` wraps the structure computation in ``torch.compile(dynamic=False)``: one
    compilation per (mask code, q_len, kv_len, segment bounds) signature, none when only the
    layout's contents change (closures are compared by code, their tensors are graph inputs).
    """

    def __init__(self, compile: bool = False, compile_backend: str | Callable = "inductor") -> None:
        self.compile = compile
        self._fn = torch.compile(_structure, dynamic=False, backend=compile_backend) if compile else _structure

    def __call__(
        self,
        mask_mod: Callable,
        q_len: int,
        kv_len: int,
        *,
        max_segments: tuple[int, int] | None = None,
    ) -> BlockMask:
        """The BlockMask of ``mask_mod`` over a ``q_len x kv_len`` grid.

        ``max_segments`` bounds the segment counts of the q and kv sides (e.g. frames x copies
        of the layout, +1); with it no host sync happens and shapes depend only on the
        signature. Without it the exact counts are read back (one sync). Masks without
        ``q_keys`` (e.g. composed with torch's ``and_masks``) fall back to ``create_block_mask``.
        """
        q_keys = getattr(mask_mod, "q_keys", None)
        kv_keys = getattr(mask_mod, "kv_keys", None)
        if not q_keys or not kv_keys:
            dev = q_keys[0].device if q_keys else "cpu"
            return create_block_mask(mask_mod, 1, 1, q_len, kv_len, device=dev)
        for side, keys, n in (("q", q_keys, q_len), ("kv", kv_keys, kv_len)):
            bad = [tuple(k.shape) for k in keys if k.shape != (n,)]
            if bad:
                raise ValueError(f"{side}_keys of {mask_mod.__name__} have shapes {bad}, expected ({n},)")
        if max_segments is None:
            sq, sk = _num_segments(q_keys), _num_segments(kv_keys)
        else:
            sq, sk = min(max_segments[0], q_len), min(max_segments[1], kv_len)
        if max(sq, sk) > MAX_SEGMENTS:
            if max_segments is not None:  # the bound was loose; the real count may still be small
                return self(mask_mod, q_len, kv_len)
            return create_block_mask(mask_mod, 1, 1, q_len, kv_len, device=q_keys[0].device)
        t = self._fn(mask_mod, q_keys, kv_keys, q_len, kv_len, sq, sk)
        return BlockMask(
            seq_lengths=(q_len, kv_len),
            kv_num_blocks=t[0], kv_indices=t[1], full_kv_num_blocks=t[2], full_kv_indices=t[3],
            q_num_blocks=t[4], q_indices=t[5], full_q_num_blocks=t[6], full_q_indices=t[7],
            BLOCK_SIZE=(BLOCK, BLOCK), mask_mod=mask_mod,
        )


def fast_block_mask(mask_mod: Callable, q_len: int, kv_len: int, *, max_segments: tuple[int, int] | None = None) -> BlockMask:
    """Eager :class:`BlockMaskBuilder` call (see there)."""
    return BlockMaskBuilder(compile=False)(mask_mod, q_len, kv_len, max_segments=max_segments)


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
