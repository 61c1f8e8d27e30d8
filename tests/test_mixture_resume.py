"""A weighted mixture run (`[[data.datasets]]` with weights) stopped on 2 ranks (torchrun, gloo on CPU) and
resumed on 1: the resumed rank trains exactly the rest of the epoch's draw, counted per item (the small entry's
repeats included), and the next epoch is the one a 1-rank run draws; stopped on 1 and resumed on 2: the two ranks
train the rest of the draw plus at most one pack of tail padding."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from helpers import BUNDLE_CAMS, LINGBOT_TINY, tiny_config

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _config(base: Path, out: Path, steps: int):
    from flexpack.data.bundle_synthetic import SyntheticDataset, write_bundle

    if not (base / "a").exists():  # one segment an episode: an item is its episode
        write_bundle(base / "a", [SyntheticDataset(name="d", episodes=[[(0, 17 + 4 * k)] for k in range(6)],
                                                   cameras=BUNDLE_CAMS, action_columns=6)], text=(16, 64))
        write_bundle(base / "b", [SyntheticDataset(name="e", episodes=[[(0, 21)], [(0, 29)]], cameras=BUNDLE_CAMS,
                                                   action_columns=6)], text=(16, 64), seed=5)
    mix = f"data.datasets=[{{root = '{base / 'a'}', weight = 1.0}}, {{root = '{base / 'b'}', weight = 2.0}}]"
    return tiny_config("", out, *LINGBOT_TINY, "data.root=", mix, "data.max_tokens=200", f"schedule.steps={steps}",
                       "schedule.rewarmup_steps=0")


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_a_weighted_mixture_stopped_on_2_ranks_resumes_on_1(tmp_path) -> None:
    from flexpack.commands.train import train
    from flexpack.run.compose import build_run
    from flexpack.run.config import save_config

    if not TORCHRUN.exists() and shutil.which("torchrun") is None:
        pytest.skip("torchrun not found next to the interpreter or on PATH")
    cfg = _config(tmp_path, tmp_path / "run", steps=1)
    one = build_run(cfg).sampler
    draw = Counter(one.epoch_draw(0).tolist())
    assert max(draw[i] for i in (6, 7)) >= 2  # entry b (2 of 8 episodes, two thirds of the tokens) repeats
    two = build_run(cfg, rank=0, world_size=2).sampler
    assert len(two) >= 2  # the 2-rank run stops inside epoch 0
    save_config(cfg, tmp_path / "two.json")
    # 1 -> 2: one rank's first step (run D), then two ranks to the end of epoch 0
    d1 = train(_config(tmp_path, tmp_path / "D", steps=1)).episodes
    left2 = build_run(cfg, rank=0, world_size=2).sampler
    left2.load_state_dict(json.loads(next((tmp_path / "D" / "checkpoints").glob("step_*/train_state.json"))
                                     .read_text())["sampler"])
    save_config(_config(tmp_path, tmp_path / "D", steps=1 + len(left2)), tmp_path / "D.json")
    (tmp_path / "jobs.json").write_text(json.dumps([{"name": "A", "config": str(tmp_path / "two.json")},
                                                    {"name": "D2", "config": str(tmp_path / "D.json")}]))
    cmd = [str(TORCHRUN if TORCHRUN.exists() else shutil.which("torchrun")), "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "resume_worker.py"), str(tmp_path / "jobs.json"), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    got = {r: json.loads((tmp_path / f"A.rank{r}.json").read_text()) for r in (0, 1)}
    assert all(got[r]["step"] == 1 and got[r]["world_size"] == 2 for r in (0, 1))
    before = Counter(e for r in (0, 1) for b in got[r]["episodes"] for e in b if e >= 0)

    # the 1-rank plan of the rest of epoch 0, from the checkpoint's sampler state
    state = json.loads(next((tmp_path / "run" / "checkpoints").glob("step_*/train_state.json")).read_text())
    left = build_run(cfg).sampler
    left.load_state_dict(state["sampler"])
    rest = len(left)
    assert rest >= 1 and left.epoch == 0
    after = train(_config(tmp_path, tmp_path / "run", steps=1 + rest + 1))  # the rest of epoch 0, then one more
    assert after.start_step == 1 and after.step == 2 + rest
    trained = Counter(e for b in after.episodes[:rest] for e in b if e >= 0)
    want = Counter({i: max(n - before[i], 0) for i, n in draw.items()})
    assert trained == +want  # every draw the two ranks had not trained, once; one rank has no tail padding
    fresh = build_run(cfg).sampler
    fresh.set_epoch(1)
    assert after.episodes[rest:] == [list(next(iter(fresh)))]  # epoch 1 as a 1-rank run packs it

    done = Counter(e for b in d1 for e in b if e >= 0)
    got2 = {r: json.loads((tmp_path / f"D2.rank{r}.json").read_text()) for r in (0, 1)}
    assert all(got2[r]["start_step"] == 1 and got2[r]["step"] == 1 + len(left2) for r in (0, 1))
    trained = Counter(e for r in (0, 1) for b in got2[r]["episodes"] for e in b if e >= 0)
    want = Counter({i: max(n - done[i], 0) for i, n in draw.items()})
    padding = trained - want
    assert not (want - trained)  # every draw the one rank had not trained
    assert sum(one.lengths[i] * n for i, n in padding.items()) <= one.budget_frames  # at most one pack repeated
