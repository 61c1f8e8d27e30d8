"""The compiled block-mask builder: its binary searches equal torch.searchsorted, it compiles (CPU
inductor here, CUDA on the GPU) without falling back to eager, and on CUDA it builds every shape the
samplers produce at the token budgets of the configs, on the model's fixed segment grids: one compiled
signature per mask and pack shape, whatever the episode count."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from flexpack.attention.blockmask import BlockMaskBuilder, fast_block_mask
from flexpack.attention.masks import make_mask
from flexpack.attention.segments import SCAN_CHUNK, _ordered, count_below, prefix_sum
from flexpack.packing.layout import SequenceLayout
from test_blockmask import assert_same_block_mask, layout_for

ROOT = Path(__file__).resolve().parents[1]
# any of these warnings means a shape was built eagerly or launched without its CUDA graph
FALLBACK = r".*(building eagerly|capturing the block-mask build as a CUDA graph failed).*"


def test_count_below_equals_searchsorted_on_random_inputs() -> None:
    """The unrolled binary search the compiled builder uses instead of torch.searchsorted."""
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 5, 8, 63, 64, 65, 585):
        for dtype in (torch.int32, torch.int64):
            seq = torch.randint(0, max(2, n // 3), (3, n), generator=g).sort(-1).values.to(dtype)
            values = torch.randint(-2, n // 3 + 3, (3, n + 7), generator=g).to(dtype)  # below, inside, above
            got = count_below(seq, values)
            assert got.dtype == torch.int32 and got.equal(torch.searchsorted(seq, values, out_int32=True)), (n, dtype)
    seg = torch.arange(10).repeat_interleave(3)  # 1-D, as the segment starts use it
    assert count_below(seg, torch.arange(12)).tolist() == [3 * s for s in range(10)] + [30, 30]
    assert count_below(seg[:0], torch.arange(3)).tolist() == [0, 0, 0]


def test_prefix_sum_equals_cumsum_and_scans_at_most_a_chunk(monkeypatch) -> None:
    """The chunked running sum the builder uses instead of one long scan: equal to cumsum along any
    dim, at lengths around the chunk's powers (1, 32, 33, 585 = the failing H200 grid, 1024, 1025),
    and no scan it asks for is longer than SCAN_CHUNK."""
    g = torch.Generator().manual_seed(3)
    longest = []
    real = torch.Tensor.cumsum

    def watched(self, dim, *a, **k):
        longest.append(self.shape[dim])
        return real(self, dim, *a, **k)

    monkeypatch.setattr(torch.Tensor, "cumsum", watched)
    for n in (1, 2, 31, 32, 33, 64, 585, 1024, 1025, 74_880):
        for shape, dim in (((n,), 0), ((3, n), 1), ((n, 5), 0), ((2, 4, n), -1)):
            x = torch.randint(0, 3, shape, generator=g, dtype=torch.int32)
            got = prefix_sum(x, dim)
            assert got.dtype == torch.int32 and got.equal(real(x, dim, dtype=torch.int32)), (shape, dim)
    assert max(longest) == SCAN_CHUNK


@pytest.mark.slow
def test_compiled_builder_on_cpu_equals_eager_without_fallback(one_thread) -> None:
    """Inductor (CPU) compiles the whole build, gathers included; results equal create_block_mask's."""
    rng = random.Random(5)
    lay, kw, kv_len = layout_for(rng, "teacher_forcing")
    mod = make_mask(lay, "teacher_forcing", **kw)
    T = lay.num_tokens
    builder = BlockMaskBuilder(compile=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=FALLBACK)
        got = builder(mod, T, kv_len, max_segments=(T, kv_len))
    assert len(builder._compiled) == 1 and builder._compiled[next(iter(builder._compiled))].__name__ != "_structure"
    assert_same_block_mask(got, create_block_mask(mod, 1, 1, T, kv_len, device="cpu"))
    m = torch.rand(2, 40, 40, generator=torch.Generator().manual_seed(1)) < 0.4
    n, idx = torch.compile(_ordered, dynamic=False)(m)
    assert n.equal(m.sum(-1).int()) and idx.equal(torch.argsort(m.int(), dim=-1, descending=True, stable=True).int())


# -- CUDA: every shape the samplers produce -------------------------------------------------------

TPF_VIDEO, TPF_ACTION, TEXT_TOKENS = 32, 4, 64
BUDGETS = (74_880, 18_720)  # tokens: the H200 pack budget (2080 frames) and a quarter of it


def reference_frames() -> list[int]:
    """Latent frames of the reference episode lengths (video frames ``n`` -> ``(n - 1) // 4 + 1``)."""
    lines = (ROOT / "data" / "episode_frames_ref.txt").read_text().splitlines()
    return [(int(x) - 1) // 4 + 1 for x in lines if x.strip() and not x.startswith("#")]


def sampler_packs(budget_frames: int, per_count: int = 1) -> list[list[int]]:
    """Packs (latent frames per episode) that the token-budget sampler draws from the reference
    episode lengths in its first epoch: up to ``per_count`` packs of every episode count it makes,
    every smaller count drawn from the same lengths, and a single cropped episode (crop=True)
    that fills the whole budget."""
    from flexpack.packing.batch_sampler import TokenBudgetBatchSampler

    frames = [min(f, budget_frames) for f in reference_frames()]
    sampler = TokenBudgetBatchSampler(frames, budget_frames, tokens_per_frame=1, seed=0)
    by_count: dict[int, list[list[int]]] = {}
    for idx in sampler:
        by_count.setdefault(len(idx), [])
        if len(by_count[len(idx)]) < per_count:
            by_count[len(idx)].append([frames[i] for i in idx])
    rng = random.Random(budget_frames)
    for n in range(1, max(by_count) + 1):  # counts this epoch did not make (another dataset's would)
        if n not in by_count:
            pick = rng.sample(frames, n)
            by_count[n] = [pick if sum(pick) <= budget_frames else sorted(frames)[:n]]
    packs = [p for n in sorted(by_count) for p in by_count[n]]
    return packs + [[budget_frames]]


def pad_rows(per_shape: int = 1, shapes: int = 3) -> list[list[int]]:
    """Pad-mode micro-batches (episode frames per row) from the length-bucket sampler: the first
    ``shapes`` distinct padded shapes it draws (each compiles its own builder signature)."""
    from flexpack.packing.batch_sampler import LengthBucketBatchSampler

    frames = reference_frames()
    seen: dict[tuple, list[int]] = {}
    for idx in LengthBucketBatchSampler(frames, 4, pad_multiple=8, tokens_per_frame=1, seed=0):
        lens = [frames[i] for i in idx]
        key = (len(lens), -(-max(lens) // 8) * 8)
        if key not in seen:
            seen[key] = lens
        if len(seen) == shapes:
            break
    return list(seen.values())


def sweep_cases() -> list[tuple[str, SequenceLayout, str, dict, int]]:
    """(name, frame layout, mask kind, prepare kwargs + copies, episodes) for every case of the sweep."""
    cases = []
    for budget in BUDGETS:
        frames = budget // (TPF_VIDEO + TPF_ACTION)
        for copies, kinds in ((1, (("document", {}), ("chunk_causal", {"chunk_size": 4}), ("text", {}))),
                              (2, (("teacher_forcing", {"chunk_size": 4}),
                                   ("teacher_forcing", {"chunk_size": 4, "window": 2})))):
            cap = frames // copies  # teacher forcing: the clean copy takes half the budget
            packs = sampler_packs(cap)
            slots = max(len(p) for p in packs)  # the run's text slots: the most episodes a pack holds
            for lens in packs:
                sl = SequenceLayout.from_rows([lens], cap, text_len=[7 + i % 5 for i in range(len(lens))])
                for kind, kw in kinds:
                    if kind == "text":
                        kw = {"text_tokens": TEXT_TOKENS, "text_slots": slots}
                    name = f"pack-{kind}{kw.get('window', '')}-{budget}-{len(lens)}eps"
                    cases.append((name, sl, kind, dict(kw, copies=copies), len(lens)))
    for lens in pad_rows():  # pad mode: one episode per row, padded to a multiple of 8 frames
        sl = SequenceLayout.from_rows([[n] for n in lens], -(-max(lens) // 8) * 8, mode="pad", text_len=[9] * len(lens))
        cases.append((f"pad-document-{len(lens)}x{max(lens)}", sl, "document", {"copies": 1}, len(lens)))
    return cases


def test_sweep_covers_every_episode_count_and_kind() -> None:
    """The CUDA sweep below is what the samplers make: episode counts 1..max per budget, every mask."""
    cases = sweep_cases()
    for budget in BUDGETS:
        counts = sorted({n for name, _, kind, _, n in cases if f"-{budget}-" in name and kind == "document"})
        assert counts[0] == 1 and counts == list(range(1, counts[-1] + 1)), (budget, counts)
    assert max(n for *_, n in cases) >= 10  # the full budget packs many reference episodes
    assert {kind for _, _, kind, _, _ in cases} == {"document", "chunk_causal", "text", "teacher_forcing"}
    assert any(name.startswith("pad-") for name, *_ in cases)


PARTS = [f"{b}-copies{c}" for b in BUDGETS for c in (1, 2)] + ["pad"]  # one test each: spread over workers


def part_of(name: str, sl: SequenceLayout, kw: dict) -> str:
    return "pad" if name.startswith("pad-") else f"{name.split('-')[2]}-copies{kw['copies']}"


def test_sweep_parts_cover_every_case() -> None:
    assert {part_of(name, sl, kw) for name, sl, _, kw, _ in sweep_cases()} == set(PARTS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiles the block-mask builder for the GPU)")
@pytest.mark.parametrize("part", PARTS)
def test_compiled_builder_compiles_every_sampler_shape_on_cuda(part: str) -> None:
    """Every (mask, budget, episode count) the samplers produce builds through the compiled builder
    and its CUDA graph, as training runs it (FlexAttnFunc.prepare on the fixed grids WanVA uses), with no
    eager fallback (the fallback warning is an error here), the eager builder's result, and one compiled
    signature per mask (and window) and shape, however many episode counts share it."""
    from flexpack.attention.flex import FlexAttnFunc

    attn = FlexAttnFunc("flex", fixed_segments=True)
    cases = [c for c in sweep_cases() if part_of(c[0], c[1], c[3]) == part]
    assert cases
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=FALLBACK)
        for name, sl, kind, kw, _ in cases:
            kw = dict(kw)
            copies = kw.pop("copies")
            lay = sl.tokens(TPF_VIDEO, TPF_ACTION, copies=copies).to("cuda")
            prep = attn.prepare(lay, kind, **kw)
            got = prep.block_mask()
            want = fast_block_mask(prep.mask_mod, prep.q_len, prep.kv_len)  # eager, equal to create_block_mask
            try:
                assert_same_block_mask(got, want)
            except AssertionError as e:
                raise AssertionError(f"{name}: {e}") from None
    builders = list(attn._builders.values())
    assert builders and all(b.compile for b in builders)
    graphs = [g for b in builders for g in b._graphs.values()]
    assert graphs and all(g is not None for g in graphs)  # every signature replays a CUDA graph
    shapes = {(kind, tuple(sl.frame_doc.shape)) for _, sl, kind, _, _ in cases}  # a window is a closure value
    assert sum(len(b._compiled) for b in builders) == len(shapes)
    if part != "pad":  # pack budgets: many episode counts share one fixed grid (pad rows differ in shape)
        assert len(shapes) < len(cases)
