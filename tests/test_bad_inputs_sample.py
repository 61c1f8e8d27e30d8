"""``sample`` and ``export`` bounded and in one line: every count of ``sample`` and ``sample.*`` in its
range before any work, report files only regular files inside the run and of bounded size, a full disk during
``export`` or ``sample`` one line with nothing half-written, a checkpoint pruned or damaged under ``sample`` named
with the one it falls back to, ``sample RUN`` on the run's current config, ``num_train_timesteps`` an integer."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lerobot")

from flexpack.run.model import build_model  # noqa: E402
from flexpack.run.state import checkpoint, resume, runfolder  # noqa: E402
from flexpack.run.state.trained import run_config  # noqa: E402
from flexpack.tools.export_extras import final_losses, sample_metrics  # noqa: E402
from helpers import ROOT, TINY, run_cli, set_args, tiny_config, tiny_sets  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
FAST = ("--steps", "2", "--cuts", "1", "--plots", "0")


def _line(err: str, command: str) -> str:
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines[-1].startswith(f"flexpack {command}: error: "), err
    return lines[-1]


def _save(run: Path, step: int, cfg, normalizer: dict) -> Path:
    checkpoint.save(run / "checkpoints", step, build_model(cfg), None, config=cfg.to_dict(),
                    extra={"action_normalizer": normalizer})
    return run / "checkpoints" / f"step_{step:08d}"


@pytest.fixture(scope="module")
def run2(tiny_dataset, tmp_path_factory) -> Path:
    """A run folder of random weights at steps 2 and 4 (written by flexpack's own functions, no training)."""
    from flexpack.data import LatentEpisodeDataset

    run = tmp_path_factory.mktemp("sample-bad") / "run"
    cfg = tiny_config(tiny_dataset, run)
    normalizer = resume.normalizer_state(LatentEpisodeDataset(tiny_dataset, action_dim=6)).to_json()
    run.mkdir()
    runfolder.mark(run)
    runfolder.record_start(run, cfg.to_dict(), start_step=0, world_size=1)
    for step in (2, 4):
        _save(run, step, cfg, normalizer)
    return run


def _copy(run2: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(run2, run)
    return run


# ------------------------------------------------------------------ counts
@pytest.mark.parametrize("flag,value,message", [
    ("--steps", "1000000000", "--steps must be an integer from 1 to 10,000 (solver steps from noise to data), "
                              "got 1000000000"),
    ("--steps", "0", "--steps must be an integer from 1 to 10,000"),
    ("--cuts", "5000", "--cuts must be an integer from 1 to 1,000 (cut points per episode), got 5000"),
    ("--horizon", "100000", "--horizon must be an integer from 1 to 10,000 (latent frames), got 100000"),
    ("--plots", "100000", "--plots must be an integer from 0 to 1,000"),
    ("--seed", "4294967296", "--seed must be an integer from 0 to 4,294,967,295 (the noise keeps 32 bits of it)"),
    ("--seed", "-1", "--seed must be an integer from 0 to 4,294,967,295"),
    ("--cut-points", "1,2,99999", "--cut-points must be an integer from 1 to 10,000 (latent frames of context), "
                                  "got 99999"),
])
def test_every_count_of_sample_is_checked_before_any_work(capsys, tmp_path, flag, value, message):
    missing = tmp_path / "nothing-here"  # no config, no checkpoint: the count is refused before either is read
    code, err = run_cli(capsys, "sample", str(missing), "--checkpoint", str(missing), flag, value)
    assert code == 2 and message in _line(err, "sample")


def test_an_out_that_is_a_file_is_refused_before_any_work(capsys, tmp_path):
    (tmp_path / "afile").write_text("mine")
    missing = tmp_path / "nothing-here"
    code, err = run_cli(capsys, "sample", str(missing), "--checkpoint", str(missing), "--out", str(tmp_path / "afile"))
    assert code == 2 and f"--out {tmp_path / 'afile'} is a file" in _line(err, "sample")
    assert (tmp_path / "afile").read_text() == "mine"


@pytest.mark.parametrize("setting,message", [
    ("sample.steps=1000000000", "sample.steps must be an integer from 1 to 10,000, got 1000000000"),
    ("sample.steps=1e9", "sample.steps must be int, got 1000000000.0"),
    ("sample.cuts=100000", "sample.cuts must be an integer from 1 to 1,000"),
    ("sample.horizon=100000", "sample.horizon must be an integer from 0 to 10,000"),
    ("sample.episodes=0", "sample.episodes must be an integer from 1 to 100,000"),
    ("sample.plots=5000", "sample.plots must be an integer from 0 to 1,000"),
])
def test_runtime_sample_keys_are_refused_when_the_config_is_loaded(capsys, tmp_path, setting, message):
    out = tmp_path / "run"
    code, err = run_cli(capsys, "train", str(TINY), *set_args(tiny_sets(tmp_path / "no-data", out, setting)))
    line = _line(err, "train")
    assert code == 2 and f"--set {setting}: {message}" in line and not out.exists()  # before any step


# ------------------------------------------------------------------ files read for reports
def test_report_files_must_be_bounded_regular_files_inside_the_run(capsys, run2, tiny_dataset, tmp_path):
    run = _copy(run2, tmp_path)
    good = run / "samples" / "forecast_step_00000002" / "metrics.json"
    good.parent.mkdir(parents=True)
    good.write_text(json.dumps({"action_mse": 0.25, "steps": 10}))
    newer = {name: run / "samples" / name / "metrics.json" for name in ("zero", "fifo", "big")}
    for p in newer.values():
        p.parent.mkdir(parents=True)
    newer["zero"].symlink_to("/dev/zero")
    os.mkfifo(newer["fifo"])  # a read would wait forever
    with open(newer["big"], "wb") as f:
        f.truncate(64 << 20)  # 64 MiB (sparse)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "metrics.json").write_text(json.dumps({"action_mse": 99.0}))
    (run / "samples" / "linked").symlink_to(tmp_path / "elsewhere")  # a linked folder is not walked
    (run / "metrics.jsonl").symlink_to("/dev/zero")
    for age, p in enumerate([good, newer["fifo"], newer["big"], newer["zero"]]):  # each newer than the one before
        os.utime(p, (1e9 + age, 1e9 + age), follow_symlinks=False)
    found, values = sample_metrics(run)
    err = capsys.readouterr().err
    assert found == good and values == {"action_mse": 0.25, "steps": 10.0}
    assert f"{newer['zero']} is a symbolic link (to /dev/zero), not a file the run wrote; left out" in err
    assert f"{newer['fifo']} is not a regular file; left out" in err
    assert f"{newer['big']} holds 67108864 bytes, more than a report reads (16777216); left out" in err
    assert final_losses(run) == {} and "metrics.jsonl is a symbolic link (to /dev/zero)" in capsys.readouterr().err
    code, err = run_cli(capsys, "export", str(run), str(tmp_path / "exp"))
    assert code == 0 and "samples/forecast_step_00000002/metrics.json" in (tmp_path / "exp" / "README.md").read_text()


# ------------------------------------------------------------------ a full disk
def _limited(limit: int):
    def setup() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return setup


def _cli_limited(limit: int, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-m", "flexpack.cli", *argv], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300, preexec_fn=_limited(limit))


@pytest.mark.slow  # 13-17 s on 2 cores
def test_a_full_disk_during_export_is_one_line_and_leaves_nothing(run2, tmp_path):
    out = tmp_path / "exp"
    proc = _cli_limited(20_000, "export", str(run2), str(out))  # the weights files are larger
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _line(proc.stderr, "export")
    assert f"{out}: cannot write the export (File too large" in line and "nothing was written there" in line
    assert not out.exists() and not list(tmp_path.glob(".tmp-*"))


@pytest.mark.slow  # 13-17 s on 2 cores
def test_a_full_disk_during_sample_is_one_line_and_keeps_the_earlier_files(run2, tmp_path):
    out = tmp_path / "samples"
    out.mkdir()
    (out / "metrics.json").write_text('{"earlier": true}')
    proc = _cli_limited(2_000, "sample", str(run2), "--checkpoint", str(run2), "--out", str(out), "--steps", "2",
                        "--cuts", "1", "--plots", "1")  # a plot is larger than 2 kB
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _line(proc.stderr, "sample")
    assert f"{out}: cannot write the samples (File too large); nothing of this sampling was kept there" in line
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json"] and json.loads(
        (out / "metrics.json").read_text()) == {"earlier": True}
    assert not list(tmp_path.glob(".tmp-*"))


# ------------------------------------------------------------------ which checkpoint, which config
def test_sample_names_the_checkpoint_it_falls_back_to_and_why(capsys, run2, tmp_path):
    run = _copy(run2, tmp_path)
    new = run / "checkpoints" / "step_00000004"
    (new / "train_state.json").write_text("{")
    (new / "manifest.json").write_text(json.dumps(checkpoint.manifest.describe(new)))
    why = checkpoint.problem(new)
    code, err = run_cli(capsys, "sample", str(run), "--checkpoint", str(run), "--out", str(tmp_path / "s"), *FAST)
    assert code == 0, err
    assert f"sample: warning: {why}; using the checkpoint before it" in err
    assert f"sample: checkpoint {run / 'checkpoints' / 'step_00000002'} (step 2)" in err


def test_sample_takes_the_newest_again_when_a_training_run_prunes_it(capsys, run2, tmp_path, monkeypatch):
    run = _copy(run2, tmp_path)
    real, seen = checkpoint.load, []

    def load(path, *a, **k):  # a train prunes the checkpoint sample chose, after sample chose it
        seen.append(Path(path).name)
        if len(seen) == 1:
            shutil.copytree(run / "checkpoints" / "step_00000004", run / "checkpoints" / "step_00000006")
            checkpoint.prune(run / "checkpoints", 1)
        return real(path, *a, **k)

    monkeypatch.setattr(checkpoint, "load", load)
    code, err = run_cli(capsys, "sample", str(run), "--checkpoint", str(run), "--out", str(tmp_path / "s"), *FAST)
    assert code == 0, err
    assert seen == ["step_00000004", "step_00000006"] and "was pruned while reading it; taking the newest again" in err
    assert f"sample: checkpoint {run / 'checkpoints' / 'step_00000006'}" in err


def test_sample_run_reads_the_runs_current_config_not_its_first(capsys, run2, tiny_dataset, tmp_path):
    """A run restarted with another model: RUN/config.json is the first start's, its newest checkpoint the
    current one (what `train` prints as the sample command must work)."""
    run = _copy(run2, tmp_path)
    first = json.loads((run / "config.json").read_text())
    first["model"]["overrides"]["dim"] = 32  # the first start's model; the restart changed it
    (run / "config.json").write_text(json.dumps(first))
    code, err = run_cli(capsys, "sample", str(run), "--checkpoint", str(run), "--out", str(tmp_path / "s"), *FAST)
    assert code == 0, err
    assert f"config {run / 'checkpoints' / 'step_00000004' / 'config.json'} (the run's current one" in err
    assert run_config(run) == run / "checkpoints" / "step_00000004" / "config.json"
    assert run_config(run / "checkpoints" / "step_00000002") == run / "checkpoints" / "step_00000002" / "config.json"
    shutil.rmtree(run / "checkpoints")
    assert run_config(run) == run / "config.json"
    with pytest.raises(FileNotFoundError, match="no config.json"):
        run_config(tmp_path / "none")
