"""Mixtures: the weighted packed sampler (shares of an epoch's tokens within 2 % of the weights, deterministic per
seed and epoch, equal batches per rank, exact resume) and several sources in one run (episode ids, channel maps,
statistics per source or per embodiment)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from flexpack.packing.weighted import WeightedTokenBudgetBatchSampler

rng = np.random.default_rng(0)
LENGTHS = [int(x) for x in rng.integers(5, 41, 300)] + [int(x) for x in rng.integers(5, 41, 60)]
GROUPS = [0] * 300 + [1] * 60


def sampler(weights, **kw) -> WeightedTokenBudgetBatchSampler:
    return WeightedTokenBudgetBatchSampler(LENGTHS, 136 * 240, tokens_per_frame=136, groups=GROUPS, weights=weights,
                                           **kw)


def shares(s: WeightedTokenBudgetBatchSampler, epoch: int) -> np.ndarray:
    s.set_epoch(epoch)
    per = np.zeros(2)
    for batch in s:
        for i in batch:
            per[GROUPS[i]] += LENGTHS[i]
    return per / per.sum()


@pytest.mark.parametrize("weights", [[1.0, 1.0], [3.0, 1.0], [1.0, 9.0], [5.0, 1.0]])
def test_each_source_gets_its_weight_of_an_epochs_tokens(weights) -> None:
    s = sampler(weights)
    want = np.asarray(weights) / sum(weights)
    for epoch in range(3):
        assert np.abs(shares(s, epoch) - want).max() <= 0.02, (epoch, shares(s, epoch), want)


def test_deterministic_per_seed_and_epoch_and_equal_per_rank() -> None:
    a, b = sampler([1.0, 1.0], seed=4), sampler([1.0, 1.0], seed=4)
    assert [list(x) for x in a] == [list(x) for x in b]
    a.set_epoch(1)
    b.set_epoch(2)
    assert sorted(Counter(i for x in a for i in x).items()) != sorted(Counter(i for x in b for i in x).items())
    ranks = [sampler([1.0, 1.0], seed=4, rank=r, world_size=4) for r in range(4)]
    assert len({len(list(r)) for r in ranks}) == 1
    drawn = Counter(i for r in ranks for x in r for i in x)
    assert max(drawn[i] for i in range(300, 360)) >= 2  # the small source repeats to reach its half


def test_resume_is_exact_on_the_same_ranks() -> None:
    s = sampler([2.0, 1.0], seed=1, world_size=2, rank=1)
    s.set_epoch(3)
    it = iter(s)
    head = [next(it) for _ in range(4)]
    state = s.state_dict()
    rest = list(it)
    again = sampler([2.0, 1.0], seed=1, world_size=2, rank=1)
    again.load_state_dict(state)
    assert list(again) == rest and head
    with pytest.raises(ValueError, match="does not match"):
        sampler([1.0, 1.0], seed=1, world_size=2, rank=1).load_state_dict(state)


def _ranks(world: int, **kw) -> list[WeightedTokenBudgetBatchSampler]:
    return [sampler([3.0, 1.0], seed=2, world_size=world, rank=r, **kw) for r in range(world)]


def _count(indices) -> np.ndarray:
    return np.bincount(np.asarray(list(indices), dtype=np.int64), minlength=len(LENGTHS))


@pytest.mark.parametrize("old_world,new_world", [(2, 1), (1, 2), (3, 2)])
def test_a_resume_on_other_ranks_trains_every_draw_of_the_epoch_once(old_world, new_world) -> None:
    """Stopped after k batches on old_world ranks and resumed on new_world: the new ranks (in lockstep) train the
    epoch's draw less what the old ranks trained, counted per index (the small source's repeats included), plus at
    most the new plan's tail padding; a later resume on the new ranks continues exactly; the next epoch is the one
    a run on new_world ranks draws and packs, so each source's share of it is its weight."""
    epoch = 2
    draw = _count(_ranks(1)[0].epoch_draw(epoch))
    assert draw.max() >= 2  # the small source (a quarter of the tokens, a sixth of the items) repeats items
    for k in (1, 3, 7):
        old = _ranks(old_world)
        for s in old:
            s.set_epoch(epoch)
        iters = [iter(s) for s in old]
        before = _count(i for it in iters for _ in range(k) for i in next(it))
        state = old[0].state_dict()
        assert all(s.state_dict() == state for s in old[1:])  # every rank's state is the same
        new = _ranks(new_world)
        for s in new:
            s.load_state_dict(state)
        assert len({len(s) for s in new}) == 1 and new[0].epoch == epoch  # the new ranks stay in lockstep
        after_batches = [list(s) for s in new]
        after = _count(i for b in after_batches for x in b for i in x)
        left = np.maximum(draw - before, 0)
        assert (after >= left).all()  # every draw the old ranks had not trained
        padding = after - left  # the new plan's tail padding: fewer than new_world packs
        assert (padding * np.asarray(LENGTHS)).sum() <= (new_world - 1) * new[0].budget_frames
        if new_world == 1:
            assert not padding.any()
        # the state after the resume records every index as often as the old ranks trained it
        mid = new[0].state_dict(position=1)
        assert _count(mid["consumed"]).tolist() == before.tolist() and mid["position"] == 1
        again = _ranks(new_world)
        for s in again:
            s.load_state_dict(mid)
        assert [list(s) for s in again] == [b[1:] for b in after_batches]
    nxt = new[0]
    nxt.set_epoch(epoch + 1)
    fresh = _ranks(new_world)[0]
    fresh.set_epoch(epoch + 1)
    assert list(nxt) == list(fresh)


def test_shares_hold_across_a_resume_on_other_ranks() -> None:
    """The tokens trained in an epoch stopped on 2 ranks and finished on 1 give each source its weight (±2 %)."""
    old = _ranks(2)
    iters = [iter(s) for s in old]
    trained = [i for it in iters for _ in range(5) for i in next(it)]
    new = _ranks(1)[0]
    new.load_state_dict(old[0].state_dict())
    trained += [i for b in new for i in b]
    per = np.bincount(np.asarray(GROUPS)[trained], weights=np.asarray(LENGTHS)[trained], minlength=2)
    assert np.abs(per / per.sum() - np.array([0.75, 0.25])).max() <= 0.02, per / per.sum()


def test_a_resume_on_other_ranks_at_the_end_of_an_epoch_starts_the_next_one_whole() -> None:
    old = _ranks(2)
    for s in old:
        list(s)
    new = _ranks(3)[1]
    new.load_state_dict(old[0].state_dict(position=len(old[0])))
    fresh = _ranks(3)[1]
    fresh.set_epoch(1)
    assert new.epoch == 1 and list(new) == list(fresh)


def test_resumes_chain_across_world_sizes() -> None:
    """2 ranks, then 1, then 3, all in one epoch: every draw trained once in all (plus tail padding)."""
    draw = _count(_ranks(1)[0].epoch_draw(0))
    two = _ranks(2)
    iters = [iter(s) for s in two]
    trained = [i for it in iters for _ in range(3) for i in next(it)]
    one = _ranks(1)[0]
    one.load_state_dict(two[0].state_dict())
    it = iter(one)
    trained += [i for _ in range(4) for i in next(it)]
    three = _ranks(3)
    for s in three:
        s.load_state_dict(one.state_dict())
    trained += [i for s in three for b in s for i in b]
    extra = _count(trained) - draw
    assert (extra >= 0).all()
    assert (extra * np.asarray(LENGTHS)).sum() <= (1 + 2) * two[0].budget_frames  # each plan's padding, at most


def test_most_per_batch_bounds_every_pack() -> None:
    s = sampler([1.0, 20.0])
    bound = s.most_per_batch()
    for epoch in range(4):
        s.set_epoch(epoch)
        assert max(len(b) for b in s) <= bound


def test_a_mixture_run_reads_each_source_with_its_own_map_and_statistics(tmp_path: Path) -> None:
    from flexpack.data.bundle_synthetic import SyntheticDataset, write_bundle
    from flexpack.run.build import open_dataset
    from flexpack.run.config import load_config

    cams = {"observation.images.cam_high": (4, 4)}
    a = write_bundle(tmp_path / "a", [SyntheticDataset(name="d", episodes=[[(0, 30)], [(0, 21)]], cameras=cams,
                                                       action_columns=6)], text=(16, 64))
    b = write_bundle(tmp_path / "b", [SyntheticDataset(name="e", episodes=[[(0, 25), (10, 33)]], cameras=cams,
                                                       action_columns=3)], text=(16, 64), seed=5)
    cfg_file = tmp_path / "mix.toml"
    cfg_file.write_text(f"""
[data]
max_tokens = 800
[[data.datasets]]
root = "{a}"
weight = 1.0
[[data.datasets]]
root = "{b}"
name = "arm3"
weight = 2.0
action_channels = [0, 1, 29]
[model]
family = "lingbot-va"
preset = "lingbot-va-tiny"
""")
    cfg = load_config(cfg_file, [])
    ds = open_dataset(cfg)
    assert len(ds) == 4 and ds.lengths() == [8, 6, 7, 6]
    assert [ds[i]["episode_index"] for i in range(4)] == [0, 1, 2, 2]  # source b's episode 0 is mixture episode 2
    assert [ds[i]["dataset"] for i in range(4)] == ["a/d", "a/d", "arm3/e", "arm3/e"]
    mask = ds[2]["action_mask"].any(dim=(1, 2))
    assert mask.nonzero().flatten().tolist() == [0, 1, 29]
    assert ds[0]["action_mask"].any(dim=(1, 2)).nonzero().flatten().tolist() == list(range(6))
    groups, weights = ds.mixture_weights
    assert groups.tolist() == [0, 0, 1, 1] and weights == [1.0, 2.0]
    assert not np.array_equal(ds.sources[0].q01[:2], ds.sources[1].q01[:2])  # each pooled within itself
    same = load_config(cfg_file, ["data.datasets=[{root = '%s', embodiment = 'x'}, {root = '%s', embodiment = 'x', "
                                  "action_channels = [0, 1, 29]}]" % (a, b)])
    shared = open_dataset(same)
    np.testing.assert_array_equal(shared.sources[0].q01, shared.sources[1].q01)
    assert shared.mixture_weights is None and shared.normalizer is not None
    with pytest.raises(ValueError, match="give every entry a weight, or none"):
        load_config(cfg_file, [f"data.datasets=[{{root = '{a}', weight = 1.0}}, {{root = '{b}'}}]"])


def test_metrics_split_the_loss_parts_and_tokens_per_dataset(tmp_path: Path) -> None:
    import json

    from flexpack.commands.train import train
    from flexpack.data.bundle_synthetic import SyntheticDataset, write_bundle
    from flexpack.run.config import load_config

    cams = {"observation.images.cam_high": (4, 4)}
    a = write_bundle(tmp_path / "a", [SyntheticDataset(name="d", episodes=[[(0, 30)], [(0, 21)]], cameras=cams,
                                                       action_columns=6),
                                      SyntheticDataset(name="f", episodes=[[(0, 17)]], cameras=cams,
                                                       action_columns=6)], text=(16, 64))
    b = write_bundle(tmp_path / "b", [SyntheticDataset(name="e", episodes=[[(0, 25), (10, 33)]], cameras=cams,
                                                       action_columns=3)], text=(16, 64), seed=5)
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.toml", [
        "data.root=",
        f"data.datasets=[{{root = '{a}'}}, {{root = '{b}', name = 'arm3', action_channels = [0, 1, 29]}}]",
        "model.family=lingbot-va", "model.preset=lingbot-va-tiny", "data.max_tokens=400", "schedule.steps=2",
        "optim.accum_steps=2", f"runtime.out_dir={tmp_path / 'run'}", "checkpoint.every=0"])
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    names = ["a/d", "a/f", "arm3/e"]
    for row in (r for r in rows if "loss" in r):
        frames = {n: row[f"dataset/{n}/tokens"] for n in names}
        seen = [n for n in names if frames[n]]
        for part in ("latent_loss", "action_loss"):
            mean = sum(row[f"dataset/{n}/{part}"] * frames[n] for n in seen) / sum(frames[n] for n in seen)
            assert mean == pytest.approx(row[part], rel=1e-5)
    assert sum(r["dataset/arm3/e/tokens"] for r in rows if "loss" in r) > 0
