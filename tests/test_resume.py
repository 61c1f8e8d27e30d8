"""Resuming a run: elastic samplers, the LR re-warmup recipe, sharded checkpoints, run-folder repair."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from flexpack.packing.batch_sampler import LengthBucketBatchSampler, TokenBudgetBatchSampler
from helpers import tiny_config

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


# --- LR re-warmup: the reference recipe ------------------------------------------------------

def test_ramp_rewarmup_follows_the_reference_recipe():
    from flexpack.run.config import ScheduleConfig
    from flexpack.training.loop import lr_at

    s = ScheduleConfig(steps=10_000, warmup_steps=200, decay="constant", rewarmup_steps=50, rewarmup_mode="ramp")
    after_1500 = [lr_at(1500 + i, 3e-5, s, resumed_at=1500) for i in range(51)]
    assert after_1500[0] == pytest.approx(6e-7, rel=1e-12)  # 1/50 at the first step after the resume
    assert after_1500[1] == pytest.approx(1.2e-6, rel=1e-12)
    assert after_1500[49] == pytest.approx(3e-5, rel=1e-12) and after_1500[50] == 3e-5  # 1 at the 50th step
    # resumed inside the warmup: the factor multiplies the warmup's LR (step 100 of 200 is ~half of 3e-5;
    # flexpack's warmup gives step s the factor (s+1)/200, so 3e-5 * 101/200 / 50 = 3.03e-7)
    assert lr_at(100, 3e-5, s, resumed_at=100) == pytest.approx(3e-7, rel=0.011)
    assert lr_at(100, 3e-5, s, resumed_at=100) == pytest.approx(3e-5 * 101 / 200 / 50, rel=1e-12)
    assert lr_at(1500, 3e-5, s) == 3e-5  # without a resume nothing changes
    # the reference recipe's warmup (factor t/200 at 0-based step t): exactly the pinned numbers
    ref = ScheduleConfig(steps=10_000, warmup_steps=200, decay="constant", rewarmup_steps=50, rewarmup_mode="ramp",
                         warmup_from_zero=True)
    assert lr_at(100, 3e-5, ref, resumed_at=100) == pytest.approx(3e-7, rel=1e-12)
    assert lr_at(1500, 3e-5, ref, resumed_at=1500) == pytest.approx(6e-7, rel=1e-12)
    assert lr_at(1549, 3e-5, ref, resumed_at=1500) == pytest.approx(3e-5, rel=1e-12)
    assert lr_at(0, 3e-5, ref) == 0.0 and lr_at(0, 3e-5, s) == pytest.approx(3e-5 / 200, rel=1e-12)
    with pytest.raises(ValueError, match="schedule.rewarmup_mode must be one of"):
        ScheduleConfig(rewarmup_mode="cosine")


# --- sharded checkpoints across world sizes (torchrun, gloo on CPU) ------------------------------

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _cfg(root: Path, out: Path, *extra: str):
    return tiny_config(root, out, "schedule.warmup_steps=2", "schedule.rewarmup_steps=0", *extra)


def _remaining(root: Path, run: Path, world: int) -> int:
    """Batches per rank left in the epoch of ``run``'s newest checkpoint, at ``world`` ranks."""
    from flexpack.data import LatentEpisodeDataset
    from flexpack.run.state import checkpoint

    state = json.loads((checkpoint.latest(run / "checkpoints") / "train_state.json").read_text())["sampler"]
    s = TokenBudgetBatchSampler(LatentEpisodeDataset(root).lengths(), 60, tokens_per_frame=5, world_size=world)
    s.load_state_dict(state)
    assert s.epoch == 0
    return len(s) - s.state_dict()["position"]


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_sharded_checkpoints_resume_on_2_ranks_exactly_and_elastically_2_to_1_and_1_to_2(train_dataset, tmp_path):
    from flexpack.commands.train import train
    from flexpack.run.config import save_config
    from flexpack.run.state import checkpoint

    if not TORCHRUN.exists() and shutil.which("torchrun") is None:
        pytest.skip("torchrun not found next to the interpreter or on PATH")
    # 1 rank, stopped after its first step (D): the 2-rank job below resumes it
    d1 = train(_cfg(train_dataset, tmp_path / "D", "schedule.steps=8"), stop_after=1).episodes
    cfgs = {}
    for name, extra in {"A": (), "B": ("checkpoint.async_save=true",)}.items():
        cfgs[name] = tmp_path / f"{name}.json"
        save_config(_cfg(train_dataset, tmp_path / name, "schedule.steps=4", *extra), cfgs[name])
    r_d = _remaining(train_dataset, tmp_path / "D", 2)
    save_config(_cfg(train_dataset, tmp_path / "D", f"schedule.steps={1 + r_d}"), tmp_path / "D.json")
    jobs = [{"name": "A", "config": str(cfgs["A"])},  # uninterrupted, 4 steps
            {"name": "B1", "config": str(cfgs["B"]), "stop_after": 1},  # async checkpoints; stopped at step 1
            {"copy": [str(tmp_path / "B"), str(tmp_path / "C")]},  # C: resumed by 1 rank below
            {"name": "B2", "config": str(cfgs["B"])},  # resumed by 2 ranks
            {"name": "D2", "config": str(tmp_path / "D.json")}]  # 1 -> 2 ranks
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    cmd = [str(TORCHRUN if TORCHRUN.exists() else shutil.which("torchrun")), "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "resume_worker.py"), str(tmp_path / "jobs.json"), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    got = {f.name.split(".")[0] + f.name.split(".")[1][-1]: json.loads(f.read_text())
           for f in tmp_path.glob("*.rank*.json")}

    # 2 -> 2: the same episodes and losses as the uninterrupted run (model, optimizer, sampler, noise)
    for r in "01":
        assert got[f"B1{r}"]["episodes"] + got[f"B2{r}"]["episodes"] == got[f"A{r}"]["episodes"]
        assert got[f"B1{r}"]["losses"] + got[f"B2{r}"]["losses"] == pytest.approx(got[f"A{r}"]["losses"], rel=1e-5)
    assert got["B20"]["start_step"] == 1 and got["B20"]["step"] == 4

    # 2 -> 1: the rest of epoch 0 on one rank trains every episode the two ranks had not
    before = {e for r in "01" for b in got[f"B1{r}"]["episodes"] for e in b}
    r_c = _remaining(train_dataset, tmp_path / "C", 1)
    after = train(_cfg(train_dataset, tmp_path / "C", "schedule.steps=4", "checkpoint.async_save=true"),
                  stop_after=1 + r_c)
    flat = [e for b in after.episodes for e in b]
    assert r_c >= 1 and r_d >= 1
    assert after.start_step == 1 and before.isdisjoint(flat) and before | set(flat) == set(range(6))
    assert json.loads(
        (checkpoint.latest(tmp_path / "C" / "checkpoints") / "train_state.json").read_text())["world_size"] == 1

    # 1 -> 2: the first rank's step, then the two new ranks, cover epoch 0 once
    history = [json.loads(line) for line in (tmp_path / "D" / "config_history.jsonl").read_text().splitlines()]
    assert [h["world_size"] for h in history] == [1, 2]
    before = {e for b in d1 for e in b}
    flat = [e for r in "01" for b in got[f"D2{r}"]["episodes"] for e in b]
    assert got["D20"]["start_step"] == 1 and got["D20"]["world_size"] == 2
    assert before.isdisjoint(flat) and before | set(flat) == set(range(6))
    assert all(np.isfinite(got[f"D2{r}"]["losses"]).all() for r in "01")


def test_async_save_writes_the_weights_of_its_step_while_training_goes_on(tmp_path):
    from flexpack.families.wan.config import wan_config
    from flexpack.families.wan.model import WanVA
    from flexpack.run.state import checkpoint

    torch.manual_seed(0)
    model = WanVA(wan_config("tiny", attn_backend="dense"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    saver = checkpoint.Checkpointer(tmp_path, keep=1, async_save=True)
    final = saver.save(1, model, opt, sampler_state={"position": 1})
    with torch.no_grad():  # the next step changes the weights before the writer has finished
        for p in model.parameters():
            p.add_(1.0)
    assert checkpoint.latest(tmp_path) is None  # not a checkpoint until completed
    assert saver.wait() == final and checkpoint.latest(tmp_path) == final
    fresh = WanVA(wan_config("tiny", attn_backend="dense"))
    assert checkpoint.load(final, fresh)["sampler"] == {"position": 1}
    assert all(torch.equal(at_save[k], v) for k, v in fresh.state_dict().items())
    saver.save(2, model, opt)  # keep=1: the older one goes once the newer is complete
    saver.wait()
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000002"]
