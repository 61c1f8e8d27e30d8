"""Resuming a run: elastic samplers, the LR re-warmup recipe, sharded checkpoints, run-folder repair."""

from __future__ import annotations

from collections import Counter

import pytest

from flexpack.packing.sampler import LengthBucketBatchSampler, TokenBudgetBatchSampler

LENGTHS = [10, 8, 6, 5, 4, 3, 7, 9, 2, 2, 11]


def _samplers(kind: str, world: int) -> list:
    if kind == "pack":
        return [TokenBudgetBatchSampler(LENGTHS, 24, tokens_per_frame=2, rank=r, world_size=world, seed=3)
                for r in range(world)]
    return [LengthBucketBatchSampler(LENGTHS, 2, rank=r, world_size=world, seed=3, pool_factor=2) for r in range(world)]


@pytest.mark.parametrize("kind", ["pack", "pad"])
@pytest.mark.parametrize("old_world,new_world", [(2, 1), (1, 2), (3, 2)])
def test_elastic_sampler_resume_trains_every_index_of_the_epoch_once(kind, old_world, new_world):
    for k in range(1, len(_samplers(kind, old_world)[0])):  # every mid-epoch position
        old = _samplers(kind, old_world)
        iters = [iter(s) for s in old]
        before = [i for it in iters for _ in range(k) for i in next(it)]
        state = old[0].state_dict()
        new = _samplers(kind, new_world)
        for s in new:
            s.load_state_dict(state)
        after = [[i for b in s for i in b] for s in new]
        assert len({len(list(s)) for s in new}) == 1  # the new ranks stay in lockstep
        flat = [i for a in after for i in a]
        assert new[0].epoch == 0 and set(before).isdisjoint(flat)  # nothing trained twice across the resume
        assert set(before) | set(flat) == set(range(len(LENGTHS)))  # nothing left out
        # repeats only from a plan's own tail padding (old plan or the remainder plan)
        assert sum(c - 1 for c in Counter(flat).values()) <= sum(len(b) for b in list(new[0])[-1:]) * new_world
        # a second resume at the same world size continues exactly where the first left off
        pos = new[0].state_dict()
        assert pos["consumed"] == sorted(set(before)) and pos["position"] == 0
        again = _samplers(kind, new_world)[0]
        again.load_state_dict(new[0].state_dict(position=1))
        assert list(again) == list(new[0])[1:]


def test_elastic_resume_at_the_end_of_an_epoch_starts_the_next_one_whole():
    old = _samplers("pack", 2)
    for s in old:
        list(s)
    state = old[0].state_dict(position=len(old[0]))
    new = _samplers("pack", 1)[0]
    new.load_state_dict(state)
    fresh = _samplers("pack", 1)[0]
    fresh.set_epoch(1)
    assert new.epoch == 1 and list(new) == list(fresh)
