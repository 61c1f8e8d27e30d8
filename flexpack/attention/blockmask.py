"""FlexAttention block masks from per-block segment ranges, without evaluating the T x T grid.

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

import types
import warnings
from typing import Callable

import torch
from torch import Tensor
from torch._dynamo.exc import BackendCompilerFailed
from torch._inductor.exc import InductorError
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

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


def _num_segments(keys: tuple[Tensor, ...]) -> int:
    n = 1
    new = torch.zeros_like(keys[0], dtype=torch.bool)
    for k in keys:
        new[1:] |= k[1:] != k[:-1]
    return n + int(new[1:].sum())


def compile_fresh(fn: Callable, tag: str, backend: str | Callable = "inductor") -> Callable:
    """``torch.compile(dynamic=False)`` of a private copy of ``fn``.

    Dynamo keeps one cache per code object with a limit of 8 entries, after which it silently
    falls back to eager (for FlexAttention: a very slow reference path). Pad mode has tens of
    shapes, so every shape signature gets its own code object and therefore its own cache.
    """
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    return torch.compile(copy, dynamic=False, backend=backend)


def _closure_split(fn: Callable) -> tuple[list[Tensor], tuple] | None:
    """(tensors, other values) of ``fn``'s closure, in cell order; ``None`` if a cell holds anything
    but tensors and plain scalars (e.g. other mask_mods), which a captured graph could not re-bind."""
    tensors, scalars = [], []
    for cell in fn.__closure__ or ():
        v = cell.cell_contents
        if isinstance(v, Tensor):
            tensors.append(v)
        elif isinstance(v, (int, float, bool, str, type(None))):
            scalars.append(v)
        else:
            return None
    return tensors, tuple(scalars)


def _graph_inputs(
    mask_mod: Callable, q_keys: tuple[Tensor, ...], kv_keys: tuple[Tensor, ...]
) -> tuple[list[Tensor], tuple[int, ...], tuple] | None:
    """The distinct tensors a build reads (closure, q and kv keys), the pattern that maps the
    positions of ``closure + q_keys + kv_keys`` onto them (the same tensor often plays several
    roles), and the closure's scalar values; ``None`` when the closure cannot be re-bound."""
    split = _closure_split(mask_mod)
    if split is None:
        return None
    unique: list[Tensor] = []
    pattern = []
    for t in (*split[0], *q_keys, *kv_keys):
        i = next((j for j, u in enumerate(unique) if u is t), None)
        if i is None:
            i = len(unique)
            unique.append(t)
        pattern.append(i)
    return unique, tuple(pattern), split[1]


def _rebind(fn: Callable, tensors: list[Tensor]) -> Callable:
    """A copy of ``fn`` whose closure tensors are ``tensors`` (in cell order), scalars kept."""
    it = iter(tensors)
    cells = tuple(types.CellType(next(it) if isinstance(c.cell_contents, Tensor) else c.cell_contents)
                  for c in fn.__closure__ or ())
    return types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)


class _CapturedBuild:
    """One compiled build signature recorded as a CUDA graph and replayed.

    The compiled build is ~20 small kernels; launched from Python they cost more host time than
    the GPU needs to run them. Here the mask's tensors are copied into static buffers, the graph
    is replayed (one launch) and its outputs are copied out into fresh tensors (one foreach op),
    so that a BlockMask never aliases the graph's memory: an earlier BlockMask stays valid after
    the next build. The graph bakes in the mask's non-tensor closure values (e.g. a window), so
    those are part of the builder's key.
    """

    def __init__(
        self, fn: Callable, mask_mod: Callable, args: tuple, unique: list[Tensor], pattern: tuple[int, ...]
    ) -> None:
        q_keys, kv_keys, *rest = args
        self.pattern = pattern
        self.static = [t.clone() for t in unique]
        nq, nkv = len(q_keys), len(kv_keys)
        ncl = len(pattern) - nq - nkv
        slot = [self.static[i] for i in pattern]
        static_args = (_rebind(mask_mod, slot[:ncl]), tuple(slot[ncl:ncl + nq]), tuple(slot[ncl + nq:]), *rest)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture (allocator, lazy init)
            fn(*static_args)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.outs = list(fn(*static_args))

    def fits(self, unique: list[Tensor], pattern: tuple[int, ...]) -> bool:
        """Whether these distinct input tensors fit the static buffers."""
        return pattern == self.pattern and all(
            t.shape == s.shape and t.dtype == s.dtype and t.device == s.device for t, s in zip(unique, self.static)
        )

    def __call__(self, inputs: list[Tensor]) -> tuple[Tensor, ...]:
        torch._foreach_copy_(self.static, inputs)
        self.graph.replay()
        return tuple(torch._foreach_add(self.outs, 0))  # fresh copies (int32 + 0 is exact)


class BlockMaskBuilder:
    """Builds block masks from mask_mods of :mod:`flexpack.attention.masks`; optionally compiled (CUDA).

    ``compile=True`` wraps the structure computation in ``torch.compile(dynamic=False)``: one
    compilation per (mask code, q_len, kv_len, segment bounds) signature, each with its own
    dynamo cache (:func:`compile_fresh`), none when only the layout's contents change (closures
    are compared by code, their tensors are graph inputs).

    ``range_mods=True`` (default) gives the BlockMask, for masks with a ``runs`` bound, a
    :func:`range_mask_mod` with the same values as the mask (the kernels evaluate it inside
    partial blocks); ``False`` keeps the mask's own mask_mod there.

    ``cuda_graphs`` (default: on with ``compile`` on CUDA) records each compiled signature as a
    CUDA graph on its first build and replays it afterwards (:class:`_CapturedBuild`): a build
    is then a copy in, one replay and a copy out instead of ~20 launches. Each graph keeps its
    working memory (segment grid and block tables) allocated, one per signature: pad mode with
    many shapes holds many. Masks whose closure holds other mask_mods (``all_of``, the "valid"
    mask) are not captured and run the compiled build.
    """

    def __init__(
        self,
        compile: bool = False,
        compile_backend: str | Callable = "inductor",
        range_mods: bool = True,
        cuda_graphs: bool | None = None,
    ) -> None:
        self.compile = compile
        self.range_mods = range_mods
        self.cuda_graphs = compile if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and not compile:
            raise ValueError("cuda_graphs=True needs compile=True (the graph records the compiled build)")
        self._backend = compile_backend
        self._compiled: dict[tuple, Callable] = {}
        self._graphs: dict[tuple, _CapturedBuild | None] = {}

    def _fn(self, mask_mod: Callable, *args) -> tuple[Tensor, ...]:
        if not self.compile:
            return _structure(mask_mod, *args)
        key = (getattr(mask_mod, "__code__", None), *args[2:])
        if key not in self._compiled:
            self._compiled[key] = compile_fresh(_structure, f"s{len(self._compiled)}", self._backend)
        inputs = _graph_inputs(mask_mod, args[0], args[1]) if self.cuda_graphs and args[0][0].is_cuda else None
        if inputs is not None:
            unique, pattern, scalars = inputs
            graph = self._graph((*key, scalars, args[0][0].device), key, mask_mod, args, unique, pattern)
            if graph is not None and graph.fits(unique, pattern):
                return graph(unique)
        return self._run_compiled(key, mask_mod, args)

    def _run_compiled(self, key: tuple, mask_mod: Callable, args: tuple) -> tuple[Tensor, ...]:
        try:
            return self._compiled[key](mask_mod, *args)
        except (BackendCompilerFailed, InductorError) as e:
            # Seen on the H200 (torch 2.11): inductor codegen fails for the teacher-forcing
            # structure at some segment counts. The eager build gives the same block mask.
            msg = " ".join(str(e).split())[:400]
            warnings.warn(f"compiling the block-mask builder failed ({type(e).__name__}: {msg}); "
                          "building eagerly for this shape")
            self._compiled[key] = _structure
            return _structure(mask_mod, *args)

    def _graph(
        self, gkey: tuple, key: tuple, mask_mod: Callable, args: tuple, unique: list[Tensor], pattern: tuple[int, ...]
    ) -> _CapturedBuild | None:
        """The CUDA graph of ``gkey`` (compile key, closure scalars, device), captured on first use;
        ``None`` after an eager fallback or a failed capture."""
        if gkey not in self._graphs:
            self._run_compiled(key, mask_mod, args)  # compiles a new signature outside the capture
            graph = None
            if self._compiled[key] is not _structure:
                try:
                    graph = _CapturedBuild(self._compiled[key], mask_mod, args, unique, pattern)
                except RuntimeError as e:
                    msg = " ".join(str(e).split())[:300]
                    warnings.warn(f"capturing the block-mask build as a CUDA graph failed ({msg}); "
                                  "launching the compiled build instead")
            self._graphs[gkey] = graph
        return self._graphs[gkey]

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
        runs = (getattr(mask_mod, "runs", None) or 0) if self.range_mods else 0
        t = self._fn(mask_mod, q_keys, kv_keys, q_len, kv_len, sq, sk, runs if runs in (1, 2) else 0)
        return BlockMask(
            seq_lengths=(q_len, kv_len),
            kv_num_blocks=t[0], kv_indices=t[1], full_kv_num_blocks=t[2], full_kv_indices=t[3],
            q_num_blocks=t[4], q_indices=t[5], full_q_num_blocks=t[6], full_q_indices=t[7],
            BLOCK_SIZE=(BLOCK, BLOCK), mask_mod=range_mask_mod(*t[8:]) if len(t) > 8 else mask_mod,
        )


def fast_block_mask(
    mask_mod: Callable, q_len: int, kv_len: int, *, max_segments: tuple[int, int] | None = None, range_mods: bool = True
) -> BlockMask:
    """Eager :class:`BlockMaskBuilder` call (see there)."""
    return BlockMaskBuilder(compile=False, range_mods=range_mods)(mask_mod, q_len, kv_len, max_segments=max_segments)


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
