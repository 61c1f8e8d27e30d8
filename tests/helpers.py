"""Helpers shared by the test modules (imported as ``helpers``: pytest puts tests/ on the path): the
tiny training config of short runs, and running the command line and watching a run's steps."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from flexpack.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.toml"


def tiny_sets(root: Path | str, out: Path | str, *extra: str) -> list[str]:
    """``--set`` values for a short, quiet run of configs/tiny_cpu.toml on the dataset ``root`` into the run
    folder ``out``: no progress bar, one micro-step per step, 60-token packs (12 latent frames), a checkpoint
    only at the end; then ``extra``, where a later value of a key wins over an earlier one."""
    return [f'data.root="{root}"', f'runtime.out_dir="{out}"', "log.progress=false", "optim.accum_steps=1",
            "data.max_tokens=60", "checkpoint.every=0", *extra]


def tiny_config(root: Path | str, out: Path | str, *extra: str) -> Any:
    """The :class:`~flexpack.run.config.TrainConfig` of :func:`tiny_sets`."""
    from flexpack.run.config import load_config

    return load_config(TINY, tiny_sets(root, out, *extra))


def set_args(sets: list[str]) -> list[str]:
    """``--set`` values as command-line arguments: ``["--set", s1, "--set", s2, ...]``."""
    return [arg for s in sets for arg in ("--set", s)]


def run_cli(capsys, *argv: str, keep_stdout: bool = False) -> tuple[int, str]:
    """(exit status, stderr) of ``flexpack ARGV``; argparse errors count as exit status 2 too. ``keep_stdout``:
    leave stdout in ``capsys`` for the caller to read (stderr is read either way)."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    if keep_stdout:
        import sys

        out = capsys.readouterr()
        sys.stdout.write(out.out)  # captured again, for the caller's capsys.readouterr()
        return code, out.err
    return code, capsys.readouterr().err


def logged_steps(out: Path) -> list[int]:
    """Steps of the complete lines of ``out/metrics.jsonl`` (none before the file exists)."""
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


def wait_for_steps(proc: subprocess.Popen, out: Path, n: int, timeout: float = 120.0) -> None:
    """Wait until the ``train`` process ``proc`` has logged ``n`` steps in ``out``; fail if it ends first."""
    t0 = time.monotonic()
    while len(logged_steps(out)) < n:
        if proc.poll() is not None:
            raise AssertionError(f"train ended early (rc {proc.returncode}): {proc.stderr.read()[-3000:]}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            raise AssertionError(f"no {n} metrics lines after {timeout} s")
        time.sleep(0.02)


def torchrun_worker(worker: str, *args: str | Path, cwd: Path, ranks: int = 2) -> subprocess.CompletedProcess:
    """Run ``tests/WORKER ARGS`` under torchrun with ``ranks`` CPU ranks (one thread each) and assert it
    succeeded, showing the end of its output; skips the calling test where torchrun is missing."""
    import pytest

    exe = Path(sys.executable).with_name("torchrun")
    torchrun = str(exe) if exe.exists() else shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not found next to the interpreter or on PATH")
    cmd = [torchrun, "--standalone", "--nproc_per_node", str(ranks), str(ROOT / "tests" / worker), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def save_policy(path: Path, seed: int = 0, **kw: Any) -> Any:
    """A tiny LeRobot lingbot_va policy (:func:`lingbot_tiny.save_policy`)."""
    from lingbot_tiny import save_policy as save

    return save(path, seed, **kw)


# a RoboTwin-like bundle for lingbot-va-tiny: the main camera's latents 4x4, two wrists of 2x2 (composed as a T)
BUNDLE_CAMS = {"observation.images.cam_high": (4, 4), "observation.images.cam_left_wrist": (2, 2),
               "observation.images.cam_right_wrist": (2, 2)}
LINGBOT_TINY = ["model.family=lingbot-va", "model.preset=lingbot-va-tiny"]


def bundle_run(root: Path, out: Path, *extra: str, cameras: dict[str, tuple[int, int]] = BUNDLE_CAMS,
               stride: int = 1, train: bool = True) -> Any:
    """A two-dataset bundle at ``root`` (``robotwin/a``: 3 episodes, ``robotwin/b``: 2; 6 action columns; latents
    of ``cameras``, every ``stride``-th video frame encoded) and the config of a 2-step lingbot-va-tiny run on it
    into ``out`` (``extra``: more ``--set`` values), trained unless ``train`` is false."""
    from flexpack.data.bundle_synthetic import SyntheticDataset, write_bundle

    write_bundle(root, [
        SyntheticDataset(name="robotwin/a", episodes=[[(0, 30), (20, 45)], [(0, 25)], [(3, 40)]], cameras=cameras,
                         action_columns=6, stride=stride),
        SyntheticDataset(name="robotwin/b", episodes=[[(0, 21)], [(0, 33)]], cameras=cameras, action_columns=6,
                         stride=stride),
    ], text=(16, 64))
    cfg = tiny_config(root, out, *LINGBOT_TINY, "data.max_tokens=800", "schedule.steps=2", "schedule.rewarmup_steps=0",
                      *extra)
    if train:
        from flexpack.commands.train import train as run_train

        run_train(cfg)
    return cfg


def sample_run_and_export(capsys, run: Path, export: Path, out: Path) -> dict[str, dict]:
    """``flexpack sample`` of a run and of its export (two solver steps a stream, one sample, no plots): each one's
    metrics.json, keyed "run" and "export"."""
    fast = ["--set", "model.overrides.num_inference_steps=2", "--set", "model.overrides.action_num_inference_steps=2"]
    got = {}
    for name, src in (("run", run), ("export", export)):
        code, err = run_cli(capsys, "sample", str(src), "--horizon", "4", "--plots", "0", "--samples", "1", "--out",
                            str(out / name), *fast)
        assert code == 0, err
        got[name] = json.loads((out / name / "metrics.json").read_text())
    return got
