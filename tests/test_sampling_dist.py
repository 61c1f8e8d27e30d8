"""Packed sampling under torchrun: 2 CPU ranks with an FSDP2-sharded model give what one process gives."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexpack.run.model import build_model
from flexpack.sampling.solver import PackedSampler, SampleOptions
from test_sampling import SPECS_DIST, _cfg, _items, _pairs, sample_run

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_two_ranks_sample_their_share_and_agree_with_one_process(tmp_path, one_thread):
    if not TORCHRUN.exists() and shutil.which("torchrun") is None:
        pytest.skip("torchrun not found next to the interpreter or on PATH")
    cmd = [str(TORCHRUN if TORCHRUN.exists() else shutil.which("torchrun")), "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "sampling_dist_worker.py"), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    got = torch.load(tmp_path / "pairs.pt")

    cfg = _cfg("teacher_forcing", "data.max_tokens=60")
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    pairs = _pairs(_items(), SPECS_DIST)
    one = PackedSampler(model, sample_run(cfg), SampleOptions(steps=2))
    one.run(pairs)
    # each rank ran about half the packs (a repeated bin fills an odd count), all ranks got every result
    assert got["forwards"] < one.forwards
    for p, lat, act in zip(pairs, got["latent"], got["action"]):
        torch.testing.assert_close(lat, p.pred_latent, atol=1e-5, rtol=0)
        torch.testing.assert_close(act, p.pred_action, atol=1e-5, rtol=0)
