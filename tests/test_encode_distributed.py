"""``torchrun --nproc_per_node 2 -m flexpack.cli encode``: the ranks split the episodes, the cache equals
one process's file for file, and a rerun resumes (only missing episodes are encoded)."""

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

from flexpack.data import cache  # noqa: E402
from flexpack.data.encode import encode_dataset  # noqa: E402
from flexpack.data.episodes import EpisodeSource  # noqa: E402
from flexpack.data.synthetic import make_synthetic_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _torchrun() -> str:
    if TORCHRUN.exists():
        return str(TORCHRUN)
    found = shutil.which("torchrun")
    if found is None:
        pytest.skip("torchrun not found next to the interpreter or on PATH")
    return found


def _encode(root: Path, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [_torchrun(), "--standalone", "--nproc_per_node", "2", "-m", "flexpack.cli", "encode", "--dataset", str(root),
           "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


@pytest.mark.slow  # two torchrun ranks: 15-20 s of the fast suite's ~4 min on 2 cores
def test_two_ranks_split_the_episodes_and_match_one_process(tmp_path):
    one = make_synthetic_dataset(tmp_path / "one", lengths=[13, 9, 21, 17, 9], seed=3)
    two = tmp_path / "two"
    shutil.copytree(one, two)
    encode_dataset(one, progress=False)

    proc = _encode(two, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = sorted(line for line in proc.stdout.splitlines() if "encoded" in line)
    assert (lines[0].startswith("rank 0/2: encoded 3 episode(s)")
            and lines[1].startswith("rank 1/2: encoded 2 episode(s)"))
    tasks = len(EpisodeSource(two).tasks())
    assert f"wrote {tasks} task text(s)" in lines[0]  # rank 0 encodes every task text
    assert "rank 1/2: encoded 2 episode(s), skipped 0 already cached, wrote 0 task text(s)" in lines[1]

    cams = ["observation.images.cam0"]
    for ep in range(5):
        a, b = cache.latent_path(one / "latents", cams, ep), cache.latent_path(two / "latents", cams, ep)
        assert cache.read_latent_header(a) == cache.read_latent_header(b)
        assert torch.equal(cache.read_tensor(a, "latent"), cache.read_tensor(b, "latent"))
    texts = sorted(p.name for p in (one / "latents" / "text").iterdir())
    assert texts == sorted(p.name for p in (two / "latents" / "text").iterdir()) and texts
    assert (json.loads((two / "latents" / "stats.json").read_text())
            == json.loads((one / "latents" / "stats.json").read_text()))

    # resumable: a lost file is encoded again by the rank that owns it, the rest are skipped
    cache.latent_path(two / "latents", cams, 3).unlink()
    proc = _encode(two, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 1/2: encoded 1 episode(s), skipped 1 already cached" in proc.stdout
    assert "rank 0/2: encoded 0 episode(s), skipped 3 already cached" in proc.stdout
    assert torch.equal(cache.read_tensor(cache.latent_path(two / "latents", cams, 3), "latent"),
                       cache.read_tensor(cache.latent_path(one / "latents", cams, 3), "latent"))
