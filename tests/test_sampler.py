"""Samplers: exact indices, invariants over random inputs, resume, bad input, reference numbers."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpack.packing.batch_sampler import LengthBucketBatchSampler, TokenBudgetBatchSampler, batch_cost
from flexpack.packing.bins import best_fit_decreasing, lower_bound_bins, pack_bins
from flexpack.packing.lengths import read_frames_file

REF = Path(__file__).resolve().parents[1] / "data" / "episode_frames_ref.txt"
PROPS = settings(max_examples=60, deadline=None)
SIX = [5, 1, 4, 2, 6, 3]  # latent frames of a 6-episode dataset


def all_ranks(make, world_size: int, epoch: int = 0) -> list[list[list[int]]]:
    out = []
    for r in range(world_size):
        s = make(r)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


# --- pad mode: exact indices on 6 episodes ---------------------------------------------------
# default_rng(0).permutation(6) == [3, 2, 5, 4, 0, 1]; default_rng(0).permutation(5) == [2, 4, 3, 0, 1]


def test_bucket_exact_one_rank():
    # one pool sorted by length: 1(1) 3(2) 5(3) 2(4) 0(5) 4(6); batch order permutation is [0,1,2]
    s = LengthBucketBatchSampler(SIX, 2)
    assert list(s) == [[1, 3], [5, 2], [0, 4]]
    assert [s.padded_frames(b) for b in s] == [8, 8, 8]
    assert LengthBucketBatchSampler(SIX, 2, pad_multiple=1).padded_frames([5, 2]) == 4


def test_bucket_exact_small_pools():
    # pool_factor=1: pools of 2 consecutive shuffled indices [3,2] [5,4] [0,1], each sorted
    assert list(LengthBucketBatchSampler(SIX, 2, pool_factor=1)) == [[3, 2], [5, 4], [1, 0]]


def test_bucket_exact_two_ranks():
    # rank 0 takes [3,5,0] -> sorted [3,5,0]; rank 1 takes [2,4,1] -> sorted [1,2,4];
    # batches [[3,5],[0]] and [[1,2],[4]], both reordered by the same permutation [1,0]
    assert all_ranks(lambda r: LengthBucketBatchSampler(SIX, 2, rank=r, world_size=2), 2) == [
        [[0], [3, 5]],
        [[4], [1, 2]],
    ]
    # epoch 1 is another shuffle
    s = LengthBucketBatchSampler(SIX, 2, world_size=2)
    s.set_epoch(1)
    assert list(s) == [[4], [5, 2]]


def test_bucket_exact_tail_padding_and_drop_last():
    # 5 episodes on 2 ranks: shuffle [2,4,3,0,1] is padded with its first index, 2, to 6 entries
    five = SIX[:5]
    assert all_ranks(lambda r: LengthBucketBatchSampler(five, 2, rank=r, world_size=2), 2) == [
        [[1, 3], [2]],
        [[2, 0], [4]],
    ]
    # drop_last cuts the shuffle to [2,4,3,0] instead and drops incomplete batches
    assert all_ranks(lambda r: LengthBucketBatchSampler(five, 2, rank=r, world_size=2, drop_last=True), 2) == [
        [[3, 2]],
        [[0, 4]],
    ]


# --- pad mode: properties --------------------------------------------------------------------

lengths_st = st.lists(st.integers(1, 400), min_size=1, max_size=60)


@PROPS
@given(lengths=lengths_st, w=st.integers(1, 8), b=st.integers(1, 6), pool=st.integers(1, 4),
       pad=st.integers(1, 16), seed=st.integers(0, 1000), epoch=st.integers(0, 5), drop=st.booleans())
def test_bucket_properties(lengths, w, b, pool, pad, seed, epoch, drop):
    n = len(lengths)
    if drop and n // w < b:
        with pytest.raises(ValueError, match="drop_last"):
            LengthBucketBatchSampler(lengths, b, world_size=w, drop_last=True)
        return

    def make(r):
        return LengthBucketBatchSampler(lengths, b, rank=r, world_size=w, seed=seed, pool_factor=pool,
                                        pad_multiple=pad, drop_last=drop)

    plan = all_ranks(make, w, epoch)
    assert len({len(p) for p in plan}) == 1  # equal batch counts
    counts = Counter(i for p in plan for batch in p for i in batch)
    if drop:
        assert max(counts.values()) == 1
        assert sum(counts.values()) == w * len(plan[0]) * b
        assert n - len(counts) < w * b + w  # only the shard tail and incomplete batches are dropped
    else:
        assert set(counts) == set(range(n))  # every index at least once
        assert sum(counts.values()) == -(-n // w) * w  # plus exactly the documented tail padding
    for p in plan:
        for batch in p:
            assert 1 <= len(batch) <= b
            assert make(0).padded_frames(batch) % pad == 0
            assert make(0).padded_frames(batch) >= max(lengths[i] for i in batch)
    assert all_ranks(make, w, epoch) == plan  # pure function of (args, epoch)
    if len(plan[0]) >= 4:  # enough batches for the order to differ between epochs
        assert any(all_ranks(make, w, e) != plan for e in range(epoch + 1, epoch + 4))
    st_ = make(0)
    st_.set_epoch(epoch)
    stats = st_.stats()
    assert stats.micro_batches == w * len(plan[0]) and stats.batches_per_rank == len(plan[0])
    assert stats.samples == sum(counts.values()) and 0.0 <= stats.waste < 1.0
    assert stats.rank_imbalance >= 1.0


@PROPS
@given(lengths=lengths_st, w=st.integers(1, 8), seed=st.integers(0, 100), epoch=st.integers(0, 3),
       data=st.data())
def test_resume_mid_epoch(lengths, w, seed, epoch, data):
    tpf = data.draw(st.integers(1, 40))
    max_tokens = max(lengths) * tpf + data.draw(st.integers(0, 2000))
    rank = data.draw(st.integers(0, w - 1))
    for make in (
        lambda: LengthBucketBatchSampler(lengths, 3, rank=rank, world_size=w, seed=seed, pool_factor=2),
        lambda: TokenBudgetBatchSampler(lengths, max_tokens, tokens_per_frame=tpf, rank=rank, world_size=w, seed=seed),
    ):
        s = make()
        s.set_epoch(epoch)
        full = list(s)
        k = data.draw(st.integers(0, len(full)))
        s.set_epoch(epoch)
        it = iter(s)
        drawn = [next(it) for _ in range(k)]
        state = s.state_dict()
        assert drawn == full[:k] and state["epoch"] == epoch and state["position"] == k
        fresh = make()
        fresh.load_state_dict(state)
        fresh.set_epoch(epoch)  # a resumed loop calling set_epoch(same epoch) keeps the position
        assert list(fresh) == full[k:]
        assert list(fresh) == full  # the next iteration replays the whole epoch


# --- pack mode: properties -------------------------------------------------------------------


@PROPS
@given(lengths=lengths_st, w=st.integers(1, 8), seed=st.integers(0, 1000), epoch=st.integers(0, 5),
       tpf=st.integers(1, 40), extra=st.integers(0, 3000))
def test_token_budget_properties(lengths, w, seed, epoch, tpf, extra):
    n, max_tokens = len(lengths), max(lengths) * tpf + extra

    def make(r):
        return TokenBudgetBatchSampler(lengths, max_tokens, tokens_per_frame=tpf, rank=r, world_size=w, seed=seed)

    plan = all_ranks(make, w, epoch)
    assert len({len(p) for p in plan}) == 1 and len(plan[0]) >= 1
    batches = [batch for p in plan for batch in p]
    for batch in batches:
        assert batch and len(set(batch)) == len(batch)
        assert sum(lengths[i] for i in batch) * tpf <= max_tokens  # budget
    counts = Counter(i for batch in batches for i in batch)
    assert set(counts) == set(range(n))
    # documented tail padding: the packing's own bins come first, then < w bins of repeats only
    rng = np.random.default_rng(seed + epoch)
    base = pack_bins(lengths, max_tokens // tpf, rng=rng)
    assert len(batches) == len(base) + (-len(base) % w)
    extra = Counter(tuple(sorted(b)) for b in batches) - Counter(tuple(sorted(b)) for b in base)
    assert sum(extra.values()) == len(batches) - len(base)  # every packed bin is yielded as is
    assert sum(counts.values()) - n == sum(len(b) for b in extra.elements())  # repeats only there
    assert all_ranks(make, w, epoch) == plan
    if len(plan[0]) >= 4:
        assert any(all_ranks(make, w, e) != plan for e in range(epoch + 1, epoch + 4))
    stats = make(0)
    stats.set_epoch(epoch)
    s = stats.stats()
    assert s.distinct_shapes == 1 and s.micro_batches == len(batches)
    assert s.repeated_samples == sum(counts.values()) - n and s.unique_samples == n


@PROPS
@given(sizes=st.lists(st.integers(1, 500), min_size=1, max_size=80), cap_extra=st.integers(0, 1500),
       multiple=st.integers(1, 8), seed=st.integers(0, 1000))
def test_pack_bins_properties(sizes, cap_extra, multiple, seed):
    cap = max(sizes) + cap_extra
    base = pack_bins(sizes, cap, rng=np.random.default_rng(seed))
    padded = pack_bins(sizes, cap, multiple=multiple, rng=np.random.default_rng(seed))
    assert padded[: len(base)] == base  # tail padding only appends bins
    assert len(padded) % multiple == 0 and len(padded) - len(base) < multiple
    assert sorted(i for b in base for i in b) == list(range(len(sizes)))  # each item exactly once
    for b in padded:
        assert b and len(set(b)) == len(b) and sum(sizes[i] for i in b) <= cap
    assert lower_bound_bins(sizes, cap) <= len(base) <= len(best_fit_decreasing(sizes, cap))


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lengths=[]), "empty"),
        (dict(lengths=[3, 0, 2]), r"lengths\[1\] = 0"),
        (dict(lengths=[3, -4]), r"lengths\[1\] = -4"),
        (dict(lengths=[3, 2.5]), r"lengths\[1\] = 2.5"),
        (dict(rank=2, world_size=2), "rank must be < world_size=2, got 2"),
        (dict(rank=-1), "rank must be >= 0, got -1"),
        (dict(world_size=0), "world_size must be >= 1, got 0"),
        (dict(seed=-3), "seed must be >= 0, got -3"),
    ],
)
@pytest.mark.parametrize("kind", ["bucket", "token"])
def test_bad_common_input(kind, kwargs, match):
    kw = {"lengths": [3, 2, 5], **kwargs}
    lengths = kw.pop("lengths")
    with pytest.raises(ValueError, match=match):
        if kind == "bucket":
            LengthBucketBatchSampler(lengths, 2, **kw)
        else:
            TokenBudgetBatchSampler(lengths, 100, tokens_per_frame=2, **kw)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(batch_size=0), "batch_size must be >= 1, got 0"),
        (dict(pad_multiple=0), "pad_multiple must be >= 1, got 0"),
        (dict(pool_factor=-1), "pool_factor must be >= 1, got -1"),
        (dict(tokens_per_frame=0), "tokens_per_frame must be >= 1, got 0"),
        (dict(world_size=2, drop_last=True, batch_size=4), "drop_last=True leaves no batch"),
    ],
)
def test_bad_bucket_input(kwargs, match):
    kw = {"batch_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        LengthBucketBatchSampler([3, 2, 5, 1], kw.pop("batch_size"), **kw)


@pytest.mark.parametrize(
    "max_tokens, tpf, match",
    [
        (0, 2, "max_tokens must be >= 1, got 0"),
        (-5, 2, "max_tokens must be >= 1, got -5"),
        (100, 0, "tokens_per_frame must be >= 1, got 0"),
        (3, 4, "max_tokens=3 is less than one frame"),
        (9, 2, "episode 2 has 5 latent frames = 10 tokens > max_tokens=9"),
    ],
)
def test_bad_token_input(max_tokens, tpf, match):
    with pytest.raises(ValueError, match=match):
        TokenBudgetBatchSampler([3, 2, 5, 1], max_tokens, tokens_per_frame=tpf)


def test_crop_exposes_cropped_lengths():
    s = TokenBudgetBatchSampler([3, 2, 5, 1, 9], 8, tokens_per_frame=2, crop=True)
    assert s.budget_frames == 4 and s.effective_lengths == (3, 2, 4, 1, 4)
    for batch in s:
        assert sum(s.effective_lengths[i] for i in batch) <= 4
        assert len(batch) == 1 or not {2, 4} & set(batch)  # a cropped episode fills its micro-batch


def test_state_validation():
    s = TokenBudgetBatchSampler(SIX, 20, tokens_per_frame=2, world_size=2, seed=1)
    state = s.state_dict()
    TokenBudgetBatchSampler(SIX, 20, tokens_per_frame=2, world_size=2, rank=1, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed: state 1 vs sampler 2"):
        TokenBudgetBatchSampler(SIX, 20, tokens_per_frame=2, world_size=2, seed=2).load_state_dict(state)
    TokenBudgetBatchSampler(SIX, 20, tokens_per_frame=2, world_size=1, seed=1).load_state_dict(state)  # elastic
    with pytest.raises(ValueError, match="lengths_sha256"):
        TokenBudgetBatchSampler(SIX[::-1], 20, tokens_per_frame=2, world_size=2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="state is from TokenBudgetBatchSampler"):
        LengthBucketBatchSampler(SIX, 2, world_size=2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="state position 99 > "):
        s.load_state_dict({**state, "position": 99})
    with pytest.raises(ValueError, match="not a sampler state"):
        s.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="epoch must be >= 0, got -1"):
        s.set_epoch(-1)


def test_set_epoch_restarts_position_only_for_a_new_epoch():
    s = LengthBucketBatchSampler(SIX, 1)
    it = iter(s)
    next(it), next(it)
    s.set_epoch(0)
    assert s.state_dict()["position"] == 2
    s.set_epoch(1)
    assert s.state_dict() == {**s.state_dict(), "epoch": 1, "position": 0}
    assert s.state_dict(position=4)["position"] == 4  # what a prefetching loader reports


def test_batch_cost_weighting():
    assert batch_cost([], 100) == 100
    assert batch_cost([6 * 3072], 10) == pytest.approx(10 + 6 * 3072)  # L^2 / (6 d)
    assert batch_cost([10, 10], 0, hidden_size=1) == pytest.approx(200 / 6)


# --- acceptance on the reference lengths -------------------------------------------------------


@pytest.fixture(scope="module")
def ref_lengths() -> list[int]:
    lengths = read_frames_file(REF)
    assert len(lengths) == 1280 and min(lengths) == 103 and max(lengths) == 362
    return lengths


def test_reference_pad_mode(ref_lengths):
    s = LengthBucketBatchSampler(ref_lengths, 4, world_size=8, pool_factor=50, pad_multiple=8,
                                 tokens_per_frame=36).stats()
    assert s.waste <= 0.03
    assert s.micro_batches == 320 and s.batches_per_rank == 40 and s.samples == 1280
    assert s.distinct_shapes == 34  # padded F 104..368 in steps of 8


def test_reference_pack_mode(ref_lengths):
    t0 = time.perf_counter()
    sampler = TokenBudgetBatchSampler(ref_lengths, 65536, tokens_per_frame=36, world_size=8)
    s = sampler.stats()
    elapsed = time.perf_counter() - t0
    assert elapsed < 2.0
    assert s.waste <= 0.010 and s.distinct_shapes == 1 and s.rank_imbalance <= 1.02
    assert s.micro_batches % 8 == 0 and s.batches_per_rank * 8 == s.micro_batches
    assert s.unique_samples == 1280
    # the packing itself beats best-fit-decreasing (150 bins, 1.8 % waste) by reaching the bound
    bins = pack_bins(ref_lengths, 65536 // 36, rng=np.random.default_rng(0))
    assert len(bins) == lower_bound_bins(ref_lengths, 65536 // 36) == 148
    assert len(best_fit_decreasing(ref_lengths, 65536 // 36)) == 150
    # later epochs keep the numbers
    sampler.set_epoch(3)
    s3 = sampler.stats()
    assert s3.waste <= 0.010 and s3.rank_imbalance <= 1.02


def test_works_as_dataloader_batch_sampler():
    from torch.utils.data import DataLoader

    for sampler in (LengthBucketBatchSampler(SIX, 2), TokenBudgetBatchSampler(SIX, 14, tokens_per_frame=2)):
        expected = list(sampler)
        loader = DataLoader(list(range(100, 106)), batch_sampler=sampler, collate_fn=list)
        assert len(loader) == len(expected)
        assert list(loader) == [[100 + i for i in b] for b in expected]
