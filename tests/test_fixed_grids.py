"""No recompiles after warm-up for any length distribution: block masks on the segment grid of the pack's
shape (one builder signature per mask and pack shape), and text key slots that bound every micro-batch of
every epoch (one shape of the compiled blocks' text keys)."""

from __future__ import annotations

import random

import pytest
import torch

from flexpack.attention.blockmask import BlockMaskBuilder, fast_block_mask
from flexpack.attention.flex import FlexAttnFunc
from flexpack.packing.batch_sampler import LengthBucketBatchSampler, TokenBudgetBatchSampler
from flexpack.packing.layout import SequenceLayout
from test_blockmask import assert_same_block_mask

FRAMES = 256  # frame budget of the packs below: 1-frame episodes fill it 256 times over
# episode counts on both sides of every power of two up to the budget
COUNTS = sorted({1, FRAMES} | {p + d for p in (2, 4, 8, 16, 32, 64, 128) for d in (-1, 0, 1)})
MASKS = (("document", 1, {}), ("chunk_causal", 1, {"chunk_size": 2}),
         ("teacher_forcing", 2, {"chunk_size": 2, "window": 1}), ("text", 1, {}))


def pack_of(n: int, frames: int, rng: random.Random) -> list[int]:
    """``n`` episode lengths (>= 1 frame) that fill ``frames`` frames up to a random slack."""
    total = max(n, frames - rng.randint(0, min(7, frames - n)))
    cuts = sorted(rng.sample(range(1, total), n - 1)) if n > 1 else []
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


def prepared(attn: FlexAttnFunc, lens: list[int], kind: str, copies: int, kw: dict, slots: int):
    frames = FRAMES // copies
    lay = SequenceLayout.from_rows([lens], frames, text_len=[3] * len(lens)).tokens(3, 1, copies=copies)
    if kind == "text":
        kw = {"text_tokens": 4, "text_slots": slots}
    return attn.prepare(lay, kind, **kw)


class CountingEager:
    """A dynamo backend that counts the graphs it gets and runs them eagerly (no inductor: fast on CPU)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.n += 1
        return gm.forward


@pytest.mark.parametrize("kind,copies,kw", MASKS, ids=[m[0] for m in MASKS])
def test_one_builder_signature_for_every_episode_count(kind: str, copies: int, kw: dict) -> None:
    """A stream of packs whose episode counts cross every power of two up to the budget: with the
    model's fixed grids the compiled builder keeps the signature of its first pack (its dynamo cache
    compiles nothing more) and builds the same block masks as the eager builder; the power-of-two
    grids of a plain FlexAttnFunc change with the count (and would compile anew)."""
    rng = random.Random(len(kind))
    counts = [c for c in COUNTS if c <= FRAMES // copies]
    slots = counts[-1]  # the run's text slots: the most episodes a pack can hold
    fixed, rounded = FlexAttnFunc("flex", fixed_segments=True), FlexAttnFunc("flex")
    counter = CountingEager()
    builder = BlockMaskBuilder(compile=True, compile_backend=counter, cuda_graphs=False)
    bounds, rounded_bounds, after_warmup = set(), set(), None
    for i, n in enumerate(counts):
        lens = pack_of(n, FRAMES // copies, rng)
        prep = prepared(fixed, lens, kind, copies, kw, slots)
        bounds.add(prep.segment_bounds())
        rounded_bounds.add(prepared(rounded, lens, kind, copies, kw, slots).segment_bounds())
        got = builder(prep.mask_mod, prep.q_len, prep.kv_len, max_segments=prep.segment_bounds())
        if i == 0:
            after_warmup = (counter.n, set(builder._compiled))
        if i % 4 == 0 or i == len(counts) - 1:  # the compiled build is the eager one
            assert_same_block_mask(got, fast_block_mask(prep.mask_mod, prep.q_len, prep.kv_len))
    assert len(bounds) == 1, bounds
    assert counter.n >= 1 and (counter.n, set(builder._compiled)) == after_warmup, "the builder compiled after warm-up"
    assert len(rounded_bounds) > 1  # the control: power-of-two grids follow the episode count


def test_the_model_builds_on_fixed_grids() -> None:
    from flexpack.families.wan.config import wan_config
    from flexpack.families.wan.model import WanVA

    assert WanVA(wan_config("tiny", num_layers=1)).attn._fixed_bounds is True
    assert FlexAttnFunc()._fixed_bounds is False  # the plain callable keeps the smaller grids


def test_fixed_grids_larger_than_the_builder_takes_fall_back_to_rounded_bounds(monkeypatch) -> None:
    import flexpack.attention.flex as flex

    lay = SequenceLayout.from_rows([[3, 5]], 200).tokens(2)
    attn = FlexAttnFunc("flex", fixed_segments=True)
    assert attn.prepare(lay).segment_bounds() == (201, 201)  # one cell per frame, + 1
    monkeypatch.setattr(flex, "MAX_SEGMENTS", 100)  # a grid the builder would not take: the rounded bound
    assert attn.prepare(lay).segment_bounds() == (64, 64)


@pytest.mark.parametrize("lengths,crop", [
    ([14 + (7 * i) % 27 for i in range(300)], False),  # very short episodes: ~10 per pack of 256 frames
    ([1] * 40 + [200] * 30 + [3, 5, 255, 256], False),  # a few tiny ones among long ones
    ([1] * 5 + [300] * 20, True),  # cropped episodes count at the budget
])
@pytest.mark.parametrize("world_size", [1, 3])
def test_most_per_batch_bounds_every_epoch_and_rank(lengths: list[int], crop: bool, world_size: int) -> None:
    bound = None
    for rank in range(world_size):
        s = TokenBudgetBatchSampler(lengths, 256 * 4, tokens_per_frame=4, rank=rank, world_size=world_size,
                                    crop=crop, seed=5)
        bound = s.most_per_batch() if bound is None else bound
        assert s.most_per_batch() == bound  # from the arguments alone: the same on every rank
        for epoch in range(6):
            assert s.max_batch_size(epoch) <= bound, (rank, epoch)
    # exact: the 40 one-frame episodes, 3, 5 and one of 200 frames fill 248 of the 256 frames
    if lengths[:40] == [1] * 40:
        assert bound == 43
    pad = LengthBucketBatchSampler(lengths, 8, world_size=world_size)
    assert pad.most_per_batch() == 8 and max(pad.max_batch_size(e) for e in range(3)) <= 8
    assert LengthBucketBatchSampler([5, 6], 8).most_per_batch() == 2


def test_run_text_slots_hold_every_micro_batch_exactly() -> None:
    """The run's text slots are the sampler's bound, not a power of two of the first epoch's largest pack:
    the model then pads every pack's text to that many slots, also where a pack's count is above a power of
    two the first epoch never crossed."""
    from flexpack.families.wan.config import wan_config
    from flexpack.families.wan.model import WanVA
    from flexpack.packing.collate import PackCollate
    from flexpack.run.root import run_text_slots

    lengths = [2, 3, 2, 4, 2, 3, 9, 9, 9]
    sampler = TokenBudgetBatchSampler(lengths, 12 * 2, tokens_per_frame=2)
    slots = run_text_slots(sampler)
    assert slots == 5  # 2 + 2 + 2 + 3 + 3 frames fit 12
    assert all(sampler.max_batch_size(e) <= slots for e in range(5))
    model = WanVA(wan_config("tiny", num_layers=1, action_channels=0), attn=FlexAttnFunc("dense"))
    seen = []
    real = model.attn.prepare

    def watch(layout, mask="document", **kw):
        if mask == "text":
            seen.append(kw["text_slots"])
        return real(layout, mask, **kw)

    model.attn.prepare = watch
    g = torch.Generator().manual_seed(0)
    for lens in ([2, 2, 2, 3, 3], [9], [2, 3, 4]):  # 5 episodes: 8 slots without the run's count
        items = [{"latent": torch.randn(4, n, 4, 4, generator=g), "text": torch.randn(6, 32, generator=g),
                  "episode_index": i} for i, n in enumerate(lens)]
        batch = PackCollate(12)(items)
        with torch.no_grad():
            model(batch, timestep=torch.full((1, 12), 500.0), text_slots=slots)
    assert seen == [5, 5, 5]
