"""FSDP2 under torchrun: 2 CPU ranks over gloo train in lockstep, learn, and write a checkpoint that a
single-process model loads with equal weights. (FSDP2's ``fully_shard`` runs on CPU/gloo in torch 2.11.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lerobot")

from flexpack.data.encode import encode_dataset  # noqa: E402
from flexpack.data.synthetic import make_synthetic_dataset  # noqa: E402
from flexpack.run.config import load_config, save_config  # noqa: E402
from flexpack.run.model import build_model  # noqa: E402
from flexpack.run.state import checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.mark.slow  # two torchrun ranks training: ~11 s
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_fsdp2_two_cpu_ranks_train_in_lockstep_and_checkpoint_loads_unsharded(tmp_path):
    if not TORCHRUN.exists() and shutil.which("torchrun") is None:
        pytest.skip("torchrun not found next to the interpreter or on PATH")
    root = make_synthetic_dataset(tmp_path / "ds", lengths=[37, 29, 25, 21, 17, 13, 9, 9], seed=5)
    encode_dataset(root, progress=False)
    cfg = load_config(ROOT / "configs" / "tiny_cpu.toml", [
        f'data.root="{root}"', f'runtime.out_dir="{tmp_path / "run"}"', "log.progress=false",
        "schedule.steps=16", "schedule.warmup_steps=2", "optim.accum_steps=2", "data.max_tokens=60",
        "checkpoint.every=8",
    ])
    save_config(cfg, tmp_path / "cfg.json")
    # --standalone: a local rendezvous on a free port (a fixed or 0 master port can clash or hang)
    cmd = [str(TORCHRUN if TORCHRUN.exists() else shutil.which("torchrun")), "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "dist_worker.py"), str(tmp_path / "cfg.json"), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))

    # sharded: parameters are DTensors and each rank holds about half of them
    assert r0["world_size"] == 2 and r0["param_types"] == ["DTensor"]
    assert r0["local_numel"] < 0.6 * r0["full_numel"] and r0["local_numel"] + r1["local_numel"] >= r0["full_numel"]
    # lockstep: equal step and micro-batch counts, the same LRs, different episodes, one global loss
    assert r0["steps"] == r1["steps"] == 16 and len(r0["episodes"]) == len(r1["episodes"]) == 32
    assert r0["lrs"] == r1["lrs"] and r0["episodes"] != r1["episodes"]
    assert r0["losses"] == pytest.approx(r1["losses"], rel=1e-6)
    losses = r0["losses"]
    print(f"loss {losses[:4]} ... {losses[-4:]}")
    assert sum(losses[-4:]) < 0.85 * sum(losses[:4])

    # the checkpoint written under FSDP loads into a plain single-process model, weights equal
    ckpt = checkpoint.latest(tmp_path / "run" / "checkpoints")
    assert ckpt is not None and ckpt.name == "step_00000016" and r0["checkpoint"] == str(ckpt)
    state = json.loads((ckpt / "train_state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == 16
    model = build_model(cfg)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    checkpoint.load(ckpt, model, opt)
    final = torch.load(tmp_path / "final_weights.pt", weights_only=True)
    assert set(final) == set(model.state_dict())
    for name, value in model.state_dict().items():
        assert torch.equal(value, final[name]), name
    assert any(not torch.equal(init[k], final[k]) for k in final)  # it did train
    assert len(opt.state_dict()["state"]) == len(list(model.parameters()))  # Adam moments came along
