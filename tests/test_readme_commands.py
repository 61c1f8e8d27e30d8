"""The README's "Train, verify, sample" block runs as written: in a fresh clone (nothing under out/), and again
over what it left there, as after ``make demo`` (an existing dataset folder and a finished run)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lerobot")

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Train, verify, sample"


def readme_block() -> str:
    text = (ROOT / "README.md").read_text()
    return text[text.index(HEADING):].split("```bash\n", 1)[1].split("```", 1)[0]


def test_the_block_is_the_train_verify_sample_commands():
    block = readme_block()
    for command in ("make-dataset", "encode", "train", "verify", "sample", "config show"):
        assert re.search(rf"(^|&& )flexpack {command}\b", block, flags=re.M), command


def _run(clone: Path) -> subprocess.CompletedProcess:
    # as a user's shell runs it: `flexpack` on PATH (here: this checkout), no OMP_NUM_THREADS
    script = f'set -euo pipefail\nflexpack() {{ "{sys.executable}" -m flexpack.cli "$@"; }}\n{readme_block()}'
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}", HF_HUB_OFFLINE="1")
    return subprocess.run(["bash", "-c", script], cwd=clone, env=env, capture_output=True, text=True, timeout=1200)


@pytest.mark.slow
def test_readme_block_runs_fresh_and_again_over_its_outputs(tmp_path):
    clone = tmp_path / "clone"
    shutil.copytree(ROOT / "configs", clone / "configs")  # what the block reads from the repository
    fresh = _run(clone)
    assert fresh.returncode == 0, fresh.stdout[-4000:] + fresh.stderr[-6000:]
    run = clone / "out" / "demo-run"
    assert (run / "checkpoints" / "step_00000040" / "train_state.json").is_file()
    assert "OK: max rel err" in fresh.stdout  # verify on the trained weights
    assert list((run / "samples").glob("forecast_step_00000040/metrics.json"))  # sample --val on held-out episodes
    assert re.search(r"^step 40/40 ", fresh.stdout, flags=re.M)  # plain log lines: stdout is not a terminal
    assert "\r" not in fresh.stdout + fresh.stderr
    # OMP_NUM_THREADS unset: train, verify and sample each put the tiny model on one thread and say so
    params = re.search(r"no weight decay \(\d+ tensors, ([\d,]+) parameters\)", fresh.stdout + fresh.stderr)[1]
    note = f'cpu: 1 torch thread (runtime.cpu_threads = "auto", a model of {int(params.replace(",", "")) / 1e6:.3g}M'
    assert fresh.stderr.count(note) == 3

    again = _run(clone)  # as after `make demo`: the dataset folder exists, the run is finished
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-6000:]
    assert "kept out/demo-data: it holds a LeRobot dataset already" in again.stdout
    assert "already at step 40 of schedule.steps=40; nothing to train" in again.stderr
    assert "OK: max rel err" in again.stdout
