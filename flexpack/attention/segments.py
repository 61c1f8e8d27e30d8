"""The segment algorithm behind flexpack's block masks: per-block structure from per-segment ranges,
without evaluating the T x T grid (the builder with its compile and CUDA-graph cache:
:mod:`flexpack.attention.blockmask`; helpers that compare and count: :mod:`flexpack.attention.blockmask_check`).

Idea: the masks of :mod:`flexpack.attention.masks` depend only on a few per-token keys (episode, copy,
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
the whole build can be ``torch.compile``'d once per signature on CUDA, and that compiled build
recorded once as a CUDA graph and replayed (the ~20 small kernels otherwise cost more host time
in launches than the GPU needs to run them).

The result is the same ``BlockMask`` that ``create_block_mask`` builds (identical partial/full
block sets and index order: True blocks first, ascending), tested in ``tests/test_blockmask.py``.

Three refinements make the kernels and the build fast:

* The segment grid is as small as the mask's host-side bound allows (``mask_mod.segments``, see
  :mod:`flexpack.attention.masks`; :class:`~flexpack.attention.flex.PreparedMask` rounds it up to a power of
  two so that shapes, and compiles, change rarely): 64 x 64 for a document mask instead of one
  cell per frame.
* For masks with a ``runs`` bound the BlockMask carries :func:`range_mask_mod` instead of the
  mask's own mask_mod: every query's allowed keys are at most two token ranges ``[lo, hi)``,
  read from the same segment grid. Inside partial blocks the kernels then compare indices with
  per-row bounds instead of gathering several per-token keys on both sides (on the H200 this made
  FA4 teacher forcing 13 % faster fwd+bwd, 34 % forward; BENCHMARKS.md).
* No sort: block indices are ordered by two batched binary searches over running counts
  (:func:`_ordered`), and self-attention segments its tokens once for both sides. The searches
  are unrolled gathers (:func:`count_below`), not ``torch.searchsorted``: inductor's Triton code
  for searchsorted is a data-dependent loop whose codegen failed on the H200 for some shapes.
* No long scans: every running count is built from scans of at most :data:`SCAN_CHUNK` elements
  (:func:`prefix_sum`). Inductor turns a long scan over few rows into a split scan, whose Triton code
  generation failed on the H200 for a (32 x 585) block grid.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

BLOCK = 128
# above this many segments per side the S x S grid stops being cheap: use create_block_mask
MAX_SEGMENTS = 8192
# the longest scan the builder asks inductor for: at most this many elements per scan it never splits
# a scan across thread blocks (its split heuristic starts above 32 elements)
SCAN_CHUNK = 32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def count_below(sorted_seq: Tensor, values: Tensor) -> Tensor:
    """``torch.searchsorted(sorted_seq, values)`` (left side) along the last dim, as int32, without
    a data-dependent loop.

    Binary lifting: ``pos`` is the count of elements ``< value`` found so far; for each power of two
    ``step`` from the largest ``<= N`` down to 1 it advances to ``pos + step`` when element
    ``pos + step - 1`` is still ``< value``. The loop runs at trace time (``log2 N`` steps, fixed by
    the shape), so compiled code is one fused kernel of gathers and selects. Inductor lowers
    ``torch.searchsorted`` to a ``while`` loop over a per-element interval instead, and its Triton
    code generation failed for some block-mask shapes on the H200 ("Loop-carried variable low has
    initial type int32[1] but is re-assigned to int32[4] in loop"), which made the builder fall back
    to eager.

    ``sorted_seq``: (..., N) non-decreasing; ``values``: (..., M) with the same leading dims (or
    1-D both). Result: (..., M) int32, each in ``[0, N]``.
    """
    n = sorted_seq.shape[-1]
    pos = torch.zeros(values.shape, dtype=torch.int32, device=values.device)
    if n == 0:
        return pos
    step = 1 << (n.bit_length() - 1)
    while step:
        cand = pos + step
        # cand <= n keeps the probe inside the sequence; the clamp keeps the gather in bounds
        probe = torch.gather(sorted_seq, -1, (cand - 1).clamp(max=n - 1).long())
        pos = torch.where((cand <= n) & (probe < values), cand, pos)
        step >>= 1
    return pos


def prefix_sum(x: Tensor, dim: int = -1) -> Tensor:
    """Inclusive running sum of an integer tensor along ``dim`` (``x.cumsum(dim)``, same dtype),
    composed of scans of at most :data:`SCAN_CHUNK` elements.

    The dimension is cut into chunks of ``SCAN_CHUNK``: each chunk is scanned on its own, the chunk
    totals are scanned the same way (recursively, ``log_32 N`` levels) and added back. Inductor
    compiles each short scan as an ordinary one; a single long scan over few rows is lowered to a
    split scan, whose Triton codegen failed on the H200 ("list indices must be integers or slices,
    not NoneType") and sent the builder to eager.
    """
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    if n <= SCAN_CHUNK:
        out = x.cumsum(-1, dtype=x.dtype)
    else:
        m = _cdiv(n, SCAN_CHUNK)
        pad = x.new_zeros((*x.shape[:-1], m * SCAN_CHUNK - n))
        chunks = torch.cat([x, pad], -1).unflatten(-1, (m, SCAN_CHUNK)).cumsum(-1, dtype=x.dtype)
        totals = chunks[..., -1]
        before = prefix_sum(totals) - totals  # the sum of all earlier chunks
        out = (chunks + before[..., None]).flatten(-2)[..., :n]
    return out.movedim(-1, dim)


def _segments(
    keys: tuple[Tensor, ...], length: int, s_max: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Segment id per token, a representative token per segment, each block's segment range,
    and each segment's first token (``length`` for ids beyond the real count)."""
    dev = keys[0].device
    new = torch.zeros(length, dtype=torch.bool, device=dev)
    new[0] = True
    for k in keys:
        new[1:] |= k[1:] != k[:-1]
    seg = prefix_sum(new.to(torch.int32)).long() - 1  # (T,)
    # seg is sorted: the first token of segment s is where s starts; ids beyond the real count
    # point at the last token (any index works, no block rectangle reaches them)
    first = count_below(seg, torch.arange(s_max, device=dev)).long()
    rep = first.clamp(max=length - 1)
    nb = _cdiv(length, BLOCK)
    # block b covers tokens [b * BLOCK, min((b + 1) * BLOCK, length)); only the last block can run past
    # the end (then it is never full). Written without comparing index expressions: with a single block
    # inductor's Triton codegen failed on the H200 to compare ``128*0 + 128`` with the length.
    starts = torch.arange(nb, device=dev) * BLOCK
    ends = torch.cat([starts[1:] - 1, torch.full((1,), length - 1, dtype=starts.dtype, device=dev)])
    over = torch.zeros(nb, dtype=torch.bool, device=dev)
    over[-1] = nb * BLOCK > length
    return seg, rep, seg[starts], seg[ends], over, first


def _ranges(seg_mask: Tensor, seg_q: Tensor, first_k: Tensor, kv_len: int, runs: int) -> tuple[Tensor, ...]:
    """Per query token, ``runs`` key ranges ``[lo, hi)`` (int32) whose union is its allowed keys.

    A row's allowed kv segments are grouped into maximal runs of consecutive segments; run ``r``
    covers the tokens from its first segment's start to its last segment's end. Missing runs are
    empty (``lo == hi == kv_len``). Exact when no row has more than ``runs`` runs, which the
    masks of :mod:`flexpack.attention.masks` guarantee through their ``runs`` bound.
    """
    sk = seg_mask.shape[1]
    # segment j covers tokens [bound[j], bound[j + 1]); ids beyond the real count are empty
    bound = torch.cat([first_k, first_k.new_full((1,), kv_len)])
    allowed = seg_mask & (bound[1:] > bound[:-1])[None, :]
    col = torch.arange(sk, device=seg_mask.device)[None, :]

    def first(cond: Tensor) -> Tensor:  # (Sq,) first column where cond holds, else sk
        return torch.where(cond, col, sk).amin(1, keepdim=True)

    out, after = [], col.new_full((seg_mask.shape[0], 1), -1)
    for _ in range(runs):  # reductions only: inductor's scan codegen failed here on the H200
        start = first(allowed & (col > after))
        after = first(~allowed & (col > start))  # one past the run's last segment
        lo, hi = bound[start.clamp(max=sk)], bound[after.clamp(max=sk)]
        out += [lo[:, 0][seg_q].to(torch.int32), hi[:, 0][seg_q].to(torch.int32)]
    return tuple(out)


def range_mask_mod(*bounds: Tensor) -> Callable:
    """``mask_mod`` that keeps ``kv`` in ``[lo_r[q], hi_r[q])`` for one of the given ranges.

    ``bounds`` is ``(lo_1, hi_1[, lo_2, hi_2])``, each (Tq,) int32. Partial blocks then cost two
    compares per range on per-row values, instead of gathers of several per-token keys on both
    sides; the closure's code depends only on the number of ranges (no recompiles per layout).
    """
    if len(bounds) == 2:
        lo1, hi1 = bounds

        def one_range(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return (kv_idx >= lo1[q_idx]) & (kv_idx < hi1[q_idx])

        return one_range
    if len(bounds) == 4:
        lo1, hi1, lo2, hi2 = bounds

        def two_ranges(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return ((kv_idx >= lo1[q_idx]) & (kv_idx < hi1[q_idx])) | ((kv_idx >= lo2[q_idx]) & (kv_idx < hi2[q_idx]))

        return two_ranges
    raise ValueError(f"range_mask_mod takes 1 or 2 ranges (2 or 4 tensors), got {len(bounds)} tensors")


def _ordered(m: Tensor) -> tuple[Tensor, Tensor]:
    """(..., N) bool -> (count, indices) with True columns first, ascending (= stable argsort desc).

    Slot ``j < count`` holds the ``j``-th True column: the first column where the running count
    of Trues reaches ``j + 1``; slot ``j >= count`` the ``(j - count)``-th False column, alike.
    Two batched binary searches (:func:`count_below`) instead of a sort (the radix sort was a
    third of the GPU time of a build at 75k tokens); a cumsum + scatter formulation hit an
    inductor codegen bug at ~585 x 585 blocks.
    """
    mi = m.to(torch.int32)
    true_seen = prefix_sum(mi)
    n = true_seen[..., -1:]
    # slot j (0-based) wants the (j + 1)-th True, or the (j + 1 - n)-th False, column
    rank = torch.arange(1, m.shape[-1] + 1, dtype=torch.int32, device=m.device).expand_as(true_seen).contiguous()
    false_seen = rank - true_seen  # Falses among the first columns, as rank counts columns too
    in_true = count_below(true_seen, rank)
    in_false = count_below(false_seen, (rank - n).clamp(min=1))
    idx = torch.where(rank <= n, in_true, in_false)
    return n[..., 0].contiguous(), idx.contiguous()


def _classify(
    seg_mask: Tensor, lq: Tensor, hq: Tensor, oq: Tensor, lk: Tensor, hk: Tensor, ok: Tensor
) -> tuple[Tensor, Tensor]:
    """(Nbq, Nbk) partial and full block flags from the segment mask and block segment ranges."""
    sq, sk = seg_mask.shape
    p = torch.zeros(sq + 1, sk + 1, dtype=torch.int32, device=seg_mask.device)
    p[1:, 1:] = prefix_sum(prefix_sum(seg_mask.to(torch.int32), 0), 1)
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
    runs: int = 0,
) -> tuple[Tensor, ...]:
    """All eight BlockMask index tensors, shaped (1, 1, ...), then ``2 * runs`` range bounds."""
    sq, rq, lq, hq, oq, first_q = _segments(q_keys, q_len, sq_max)
    if (len(q_keys) == len(kv_keys) and all(a is b for a, b in zip(q_keys, kv_keys))
            and (q_len, sq_max) == (kv_len, sk_max)):
        rk, lk, hk, ok, first_k = rq, lq, hq, oq, first_q  # self-attention: one segmentation
    else:
        _, rk, lk, hk, ok, first_k = _segments(kv_keys, kv_len, sk_max)
    zero = torch.zeros((), dtype=torch.long, device=rq.device)
    seg_mask = mask_mod(zero, zero, rq[:, None], rk[None, :]).expand(sq_max, sk_max)
    partial, full = _classify(seg_mask, lq, hq, oq, lk, hk, ok)
    mats = (partial, full, partial.t(), full.t())
    if partial.shape[0] == partial.shape[1]:  # one sort for all four (fewer kernel launches)
        n, idx = _ordered(torch.stack(mats))
        pairs = [(n[i], idx[i]) for i in range(4)]
    else:
        pairs = [_ordered(m) for m in mats]
    ranges = _ranges(seg_mask, sq, first_k, kv_len, runs) if runs else ()
    return tuple(x[None, None] for pair in pairs for x in pair) + ranges


def num_segments(keys: tuple[Tensor, ...]) -> int:
    """Segments of a key tuple: maximal runs of tokens whose keys are all equal (one host read)."""
    n = 1
    new = torch.zeros_like(keys[0], dtype=torch.bool)
    for k in keys:
        new[1:] |= k[1:] != k[:-1]
    return n + int(new[1:].sum())
