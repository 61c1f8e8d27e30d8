"""Segment-range block masks equal create_block_mask's: same partial/full blocks, same order."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import and_masks, create_block_mask

from flexpack.attention.blockmask import BlockMaskBuilder, fast_block_mask
from flexpack.attention.blockmask_check import block_structure
from flexpack.attention.masks import (
    all_of,
    dense_mask,
    document_mask,
    make_mask,
    teacher_forcing_mask,
    valid_frame_mask,
)
from flexpack.attention.segments import _ordered, range_mask_mod
from flexpack.packing.layout import SequenceLayout, TokenLayout

KINDS = ("document", "valid", "chunk_causal", "teacher_forcing", "text")


def assert_same_block_mask(a, b) -> None:
    pa, fa = block_structure(a)
    pb, fb = block_structure(b)
    assert pa.equal(pb), "partial blocks differ"
    assert fa.equal(fb), "full blocks differ"
    assert a.seq_lengths == b.seq_lengths and a.BLOCK_SIZE == b.BLOCK_SIZE
    # ordering is normalized the same way as create_block_mask (True blocks first, ascending)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert getattr(a, name).equal(getattr(b, name)), name


def layout_for(rng: random.Random, kind: str, big: bool = False) -> tuple[TokenLayout, dict, int]:
    copies = 1 if kind == "chunk_causal" else rng.choice([1, 2])
    E = rng.randint(1, 12)
    tpf = rng.choice([5, 9, 36, 37]) if big else rng.choice([1, 3, 7])
    lens = [rng.randint(1, 12 if big else 40) for _ in range(E)]
    text = [rng.randint(0, 9) for _ in lens]
    if rng.random() < 0.3:
        sl = SequenceLayout.from_rows([[n] for n in lens], max(lens) + rng.randint(0, 3), mode="pad", text_len=text)
    else:
        sl = SequenceLayout.from_rows([lens], sum(lens) + rng.randint(0, 7), text_len=text)
    lay = sl.tokens(tpf - 1 if tpf > 1 else 1, 1 if tpf > 1 else 0, copies=copies)
    kw: dict = {}
    if kind in ("chunk_causal", "teacher_forcing"):
        kw["chunk_size"] = rng.randint(1, 4)
    if kind == "teacher_forcing":
        kw["window"] = rng.choice([None, 0, 2])
    if kind == "text":
        kw["text_tokens"] = 9
    kv_len = 9 * E if kind == "text" else lay.num_tokens
    return lay, kw, kv_len


@pytest.mark.parametrize("kind", KINDS)
def test_fast_block_mask_equals_create_block_mask(kind: str) -> None:
    rng = random.Random(KINDS.index(kind))
    for trial in range(12):
        lay, kw, kv_len = layout_for(rng, kind, big=trial % 2 == 0)
        mod = make_mask(lay, kind, **kw)
        want = create_block_mask(mod, 1, 1, lay.num_tokens, kv_len, device="cpu")
        assert_same_block_mask(fast_block_mask(mod, lay.num_tokens, kv_len), want)
        # the bounded (sync-free) path gives the same result
        cells = lay.frames.num_rows * lay.frames.frames_per_row * lay.copies + 1
        bound = (cells, 2 * lay.text_len.numel() + 1 if kind == "text" else cells)
        assert_same_block_mask(fast_block_mask(mod, lay.num_tokens, kv_len, max_segments=bound), want)


@pytest.mark.parametrize("kind", KINDS)
def test_range_mask_mod_equals_the_mask(kind: str) -> None:
    """The kernels' mask_mod (key ranges per query) has the mask's values on every token pair."""
    rng = random.Random(100 + KINDS.index(kind))
    names = set()
    for trial in range(30):
        lay, kw, kv_len = layout_for(rng, kind, big=trial % 3 == 0)
        mod = make_mask(lay, kind, **kw)
        want = dense_mask(mod, lay.num_tokens, kv_len)
        cells = lay.frames.num_rows * lay.frames.frames_per_row * lay.copies + 1
        bound = (cells, 2 * lay.text_len.numel() + 1 if kind == "text" else cells)
        for ms in (None, bound):
            bm = fast_block_mask(mod, lay.num_tokens, kv_len, max_segments=ms)
            names.add(bm.mask_mod.__name__)
            assert dense_mask(bm.mask_mod, lay.num_tokens, kv_len).equal(want), (trial, kw, ms)
    assert names <= {"one_range", "two_ranges"} and names, names
    if kind in ("teacher_forcing", "valid"):
        assert "two_ranges" in names  # the random layouts did exercise two copies


def test_fixed_segment_bounds_depend_on_the_shape_alone() -> None:
    """Inside ``fixed_segment_bounds`` two packs of one shape holding 3 and 90 episodes get the same
    segment grid (one builder signature: no compile for the second), the per-frame maximum; outside
    it the grid follows the episode count; both build the block mask create_block_mask builds."""
    from flexpack.attention.flex import FlexAttnFunc

    attn = FlexAttnFunc("flex", compile_block_mask=False)
    frames = 256
    few = SequenceLayout.from_rows([[100, 80, 60]], frames, text_len=[4, 4, 4]).tokens(3, 1)
    many = SequenceLayout.from_rows([[2] * 90], frames, text_len=[4] * 90).tokens(3, 1)
    assert attn.prepare(few, "document").segment_bounds() != attn.prepare(many, "document").segment_bounds()
    with attn.fixed_segment_bounds():
        bounds = [attn.prepare(lay, "document").segment_bounds() for lay in (few, many)]
        prep = attn.prepare(many, "document")
    assert bounds == [(frames + 1, frames + 1)] * 2
    assert not attn.prepare(few, "document").fixed_bounds  # only inside the block
    want = create_block_mask(prep.mask_mod, 1, 1, many.num_tokens, many.num_tokens, device="cpu")
    assert_same_block_mask(prep.block_mask(), want)


@pytest.mark.parametrize("kind", KINDS)
def test_host_segment_bounds_cover_the_real_counts(kind: str) -> None:
    """The bounds computed on the host (no sync) are >= the real segment counts, tight, and the
    prepared block mask built on them equals create_block_mask's."""
    from flexpack.attention.flex import FlexAttnFunc
    from flexpack.attention.segments import num_segments

    attn = FlexAttnFunc("flex", compile_block_mask=False)
    rng = random.Random(200 + KINDS.index(kind))
    for trial in range(25):
        lay, kw, kv_len = layout_for(rng, kind, big=trial % 2 == 0)
        prep = attn.prepare(lay, kind, **kw)
        mod = prep.mask_mod
        real = (num_segments(mod.q_keys), num_segments(mod.kv_keys))
        assert real[0] <= mod.segments[0] and real[1] <= mod.segments[1], (trial, mod.segments, real)
        if kind != "valid":  # valid counts a (never used here) invalid tail per copy
            assert mod.segments[0] <= real[0] + 1, (trial, mod.segments, real)
        sq, sk = prep.segment_bounds()
        cells = lay.frames.num_rows * lay.frames.frames_per_row * lay.copies + 1
        kv_cells = 2 * lay.text_len.numel() + 1 if kind == "text" else cells
        assert sq >= min(mod.segments[0], cells) and sk >= min(mod.segments[1], kv_cells)
        assert sq & (sq - 1) == 0 or sq == cells  # a power of two, or the per-frame bound if smaller
        want = create_block_mask(mod, 1, 1, lay.num_tokens, kv_len, device="cpu")
        assert_same_block_mask(prep.block_mask(), want)


def test_range_bounds_pinned_for_teacher_forcing() -> None:
    # one episode of 4 frames, 1 token per frame, chunk 2: noisy tokens 0-3, clean tokens 4-7
    lay = SequenceLayout.from_rows([[4]], 4).tokens(copies=2)
    bm = fast_block_mask(teacher_forcing_mask(lay, 2), 8, 8)
    rows = dense_mask(bm.mask_mod, 8, 8).int().tolist()
    assert rows == [
        [1, 1, 0, 0, 0, 0, 0, 0],  # noisy chunk 0: its own chunk only
        [1, 1, 0, 0, 0, 0, 0, 0],
        [0, 0, 1, 1, 1, 1, 0, 0],  # noisy chunk 1: its own chunk + clean chunk 0 (two ranges)
        [0, 0, 1, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 0, 0],  # clean chunk 0: clean chunk 0
        [0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 1, 1],  # clean chunk 1: clean chunks 0-1
        [0, 0, 0, 0, 1, 1, 1, 1],
    ]


def test_masks_without_a_range_bound_keep_their_own_mask_mod() -> None:
    lay = SequenceLayout.from_rows([[3, 2]], 6).tokens(2, 1, copies=2)
    two = teacher_forcing_mask(lay, 1)
    mod = all_of(two, valid_frame_mask(lay))  # valid_frame alone has no bound
    assert mod.runs is None
    assert fast_block_mask(mod, lay.num_tokens, lay.num_tokens).mask_mod is mod
    assert all_of(two, two).runs is None  # two unions of two ranges: up to three ranges
    assert all_of(two, document_mask(lay)).runs == 2
    off = fast_block_mask(two, lay.num_tokens, lay.num_tokens, range_mods=False)
    assert off.mask_mod is two
    with pytest.raises(ValueError, match="1 or 2 ranges"):
        range_mask_mod(torch.zeros(3, dtype=torch.int32))


def test_compile_failure_falls_back_to_the_eager_build() -> None:
    """An inductor failure (seen on the H200 for teacher forcing) must not fail the step."""
    calls = []

    def broken_backend(gm, example_inputs):
        calls.append(1)
        raise RuntimeError("codegen failed")

    lay, kw, kv_len = layout_for(random.Random(5), "teacher_forcing")
    mod = make_mask(lay, "teacher_forcing", **kw)
    builder = BlockMaskBuilder(compile=True, compile_backend=broken_backend)
    with pytest.warns(UserWarning, match="building eagerly"):
        got = builder(mod, lay.num_tokens, kv_len)
    assert calls, "the compiled path was not tried"
    assert_same_block_mask(got, create_block_mask(mod, 1, 1, lay.num_tokens, kv_len, device="cpu"))
    n = len(calls)
    assert_same_block_mask(builder(mod, lay.num_tokens, kv_len), got)  # no second compile attempt
    assert len(calls) == n


def test_plain_document_layout_many_segments() -> None:
    # 1 token per "frame": the frame bound is T, above MAX_SEGMENTS -> exact count path
    lens = [1000, 37, 5000, 129, 4000, 3000, 127]
    lay = SequenceLayout.from_lengths(lens, pad_to=sum(lens) + 300).tokens()
    mod = document_mask(lay)
    T = lay.num_tokens
    got = fast_block_mask(mod, T, T, max_segments=(T, T))
    assert_same_block_mask(got, create_block_mask(mod, 1, 1, T, T, device="cpu"))


def test_mask_without_keys_falls_back_to_create_block_mask() -> None:
    lay = SequenceLayout.from_rows([[3, 5]], 10).tokens(30, 6)
    mod = and_masks(document_mask(lay), valid_frame_mask(lay))  # torch's and_masks drops q_keys
    T = lay.num_tokens
    assert_same_block_mask(fast_block_mask(mod, T, T), create_block_mask(mod, 1, 1, T, T, device="cpu"))


def test_full_and_partial_blocks_pinned() -> None:
    # episodes of 256 and 200 tokens, then 56 pad: blocks 0-1 = doc 0, block 2 = doc 1,
    # block 3 = doc 1 + padding (partial with everything it touches)
    lay = SequenceLayout.from_lengths([256, 200], pad_to=512).tokens()
    partial, full = block_structure(fast_block_mask(document_mask(lay), 512, 512))
    assert full.int().tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]]
    assert partial.int().tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 1]]
    # a sequence end inside a block makes that block partial even when all its tokens match
    lay = SequenceLayout.from_lengths([200]).tokens()
    partial, full = block_structure(fast_block_mask(document_mask(lay), 200, 200))
    assert full.int().tolist() == [[1, 0], [0, 0]] and partial.int().tolist() == [[0, 1], [1, 1]]


@pytest.mark.parametrize("shape", [(7, 33), (4, 60, 60), (3, 1)])
def test_ordered_equals_stable_argsort(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    for p in (0.0, 0.4, 1.0):  # rows without Trues, mixed rows, rows without Falses
        m = torch.rand(shape, generator=g) < p
        n, idx = _ordered(m)
        assert n.equal(m.sum(-1).int()) and idx.dtype == torch.int32
        assert idx.equal(torch.argsort(m.int(), dim=-1, descending=True, stable=True).int())


def test_bad_key_shapes_raise() -> None:
    lay = SequenceLayout.from_rows([[3]], 4).tokens()
    with pytest.raises(ValueError, match="shapes"):
        fast_block_mask(document_mask(lay), 5, 5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_builder_on_gpu_matches_and_does_not_recompile() -> None:
    from flexpack.attention.flex import _COUNTER, FlexAttnFunc

    rng = random.Random(0)
    refs = [int(x) for x in open("data/episode_frames_ref.txt").read().split("\n")
            if x.strip() and not x.startswith("#")]
    builder = BlockMaskBuilder(compile=True, compile_backend=_COUNTER.backend)
    attn = FlexAttnFunc("flex")
    Fr = 2080
    for kind, copies in (("document", 1), ("chunk_causal", 1), ("teacher_forcing", 2)):
        seen: set = set()
        for step in range(3):  # a new layout each step: compiles only for a signature not seen before
            lens, total = [], 0
            while True:
                n = (rng.choice(refs) - 1) // 4 + 1
                if total + n > Fr // copies:
                    break
                lens.append(n)
                total += n
            lay = SequenceLayout.from_rows([lens], Fr // copies).tokens(32, 4, copies=copies).to("cuda")
            mod = make_mask(lay, kind, chunk_size=2 if kind != "document" else None)
            T = lay.num_tokens
            cells = Fr + 1
            before = _COUNTER.n
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = builder(mod, T, T, max_segments=(cells, cells))
                prep = attn.prepare(lay, kind, chunk_size=2 if kind != "document" else None)  # host bounds
            assert not [w for w in caught if "building eagerly" in str(w.message)], [str(w.message) for w in caught]
            # compiles happen only for a signature not seen before: the fixed per-frame bound
            # once, and each power-of-two bucket of host segment bounds once
            sigs = {("cells", T), ("bucket", T, prep.segment_bounds())}
            assert _COUNTER.n - before <= len(sigs - seen), f"{kind} step {step}: builder recompiled"
            seen |= sigs
            want = create_block_mask(mod, 1, 1, T, T, device="cuda")
            assert_same_block_mask(prep.block_mask(), want)
            assert_same_block_mask(got, want)
            if step == 0:  # the range mask_mod has the mask's values (T x T: once per kind)
                assert dense_mask(prep.block_mask().mask_mod, T, T, "cuda").equal(dense_mask(mod, T, T))


def test_graph_inputs_and_rebind() -> None:
    """The pieces a captured CUDA graph relies on (the capture itself runs in the GPU test)."""
    from flexpack.attention.blockmask import _graph_inputs, _rebind

    rng = random.Random(3)
    a, _, _ = layout_for(rng, "teacher_forcing")
    b, _, _ = layout_for(rng, "teacher_forcing")
    while b.num_tokens != a.num_tokens or b.copies != a.copies:
        b, _, _ = layout_for(rng, "teacher_forcing")
    ma, mb = teacher_forcing_mask(a, 2, window=1), teacher_forcing_mask(b, 2, window=1)
    unique, pattern, _ = _graph_inputs(ma, ma.q_keys, ma.kv_keys)
    # doc, copy and chunk each serve in the closure, as q keys and as kv keys: read once
    assert len(unique) == 3 and len(pattern) == 9 and set(pattern) == {0, 1, 2}
    unique_b, pattern_b, _ = _graph_inputs(mb, mb.q_keys, mb.kv_keys)
    assert pattern_b == pattern
    # a's mask re-bound to b's tensors is b's mask; the window (a scalar cell) is kept
    ncl = len([c for c in ma.__closure__ if isinstance(c.cell_contents, torch.Tensor)])
    moved = _rebind(ma, [unique_b[i] for i in pattern_b[:ncl]])
    T = a.num_tokens
    assert dense_mask(moved, T, T).equal(dense_mask(mb, T, T))
    assert not dense_mask(ma, T, T).equal(dense_mask(mb, T, T))
    # closures holding other mask_mods cannot be re-bound: not captured
    both = all_of(document_mask(a), valid_frame_mask(a))
    assert _graph_inputs(both, both.q_keys, both.kv_keys) is None
    with pytest.raises(ValueError, match="needs compile=True"):
        BlockMaskBuilder(compile=False, cuda_graphs=True)
    from flexpack.attention.flex import FlexAttnFunc

    with pytest.raises(ValueError, match="needs a compiled block-mask builder"):
        FlexAttnFunc("flex", compile_block_mask=False, graph_block_mask=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_builds_match_and_keep_earlier_masks() -> None:
    """Replayed builds equal create_block_mask's, masks built earlier stay intact (no aliasing of
    the graph's memory), masks differing only in a scalar (the window) get their own graph."""
    rng = random.Random(1)
    builder = BlockMaskBuilder(compile=True)
    Fr, built = 256, []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for kind, copies, kw in (("document", 1, {}), ("chunk_causal", 1, {"chunk_size": 2}),
                                 ("teacher_forcing", 2, {"chunk_size": 2, "window": None}),
                                 ("teacher_forcing", 2, {"chunk_size": 2, "window": 1})):
            for _ in range(3):
                lens, total = [], 0
                while total < Fr // copies - 4:
                    n = min(rng.randint(3, 60), Fr // copies - total)
                    lens.append(n)
                    total += n
                lay = SequenceLayout.from_rows([lens], Fr // copies).tokens(32, 4, copies=copies).to("cuda")
                mod = make_mask(lay, kind, **kw)
                T = lay.num_tokens
                got = builder(mod, T, T, max_segments=(Fr + 1, Fr + 1))
                built.append((got, mod, T))
    assert not [w for w in caught if "failed" in str(w.message)], [str(w.message) for w in caught]  # capture, compile
    assert len(builder._graphs) == 4 and all(g is not None for g in builder._graphs.values())
    for got, mod, T in built:  # checked after all builds: each still holds its own mask
        assert_same_block_mask(got, create_block_mask(mod, 1, 1, T, T, device="cuda"))
        assert dense_mask(got.mask_mod, T, T, "cuda").equal(dense_mask(mod, T, T))
