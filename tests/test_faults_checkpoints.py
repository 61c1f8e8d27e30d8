"""Checkpoints are data, never code, and nothing is lost: crafted pickles in every file a load reads,
flipped bytes, garbage small files, a full disk (RLIMIT_FSIZE), any save failure, a kill during
pruning, SIGHUP. Each case: exit status, one line naming the file, and the run folder after."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lerobot")

from flexpack.cli import main  # noqa: E402
from flexpack.run.state import checkpoint, manifest  # noqa: E402
from flexpack.run.state.safeload import SafePlanner, UnsafeCheckpointError, read_metadata_file  # noqa: E402
from helpers import run_cli, set_args, tiny_sets, wait_for_steps  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.toml"
pytestmark = pytest.mark.usefixtures("one_thread")


def _sets(root: Path, out: Path, *extra: str) -> list[str]:
    return set_args(tiny_sets(root, out, "schedule.steps=4", "checkpoint.every=2", "schedule.warmup_steps=2", *extra))




def _last_line(err: str, command: str) -> str:
    assert "Traceback" not in err, err
    line = [x for x in err.splitlines() if x.strip()][-1]
    assert line.startswith(f"flexpack {command}: error: "), err
    return line


@pytest.fixture(scope="module")
def run4(tiny_dataset, tmp_path_factory) -> Path:
    """A run with checkpoints at steps 2 and 4 (copy it before damaging it)."""
    out = tmp_path_factory.mktemp("ckpt-faults") / "run"
    assert main(["train", str(TINY), *_sets(tiny_dataset, out)]) == 0
    return out


def _copy(run4: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    run = tmp_path / "run"
    shutil.copytree(run4, run)
    ck = run / "checkpoints"
    return run, ck / "step_00000002", ck / "step_00000004"


class _Payload:
    """Unpickling this runs ``touch MARKER`` (what an attacker's checkpoint would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _remanifest(folder: Path) -> None:
    """Rewrite a checkpoint's manifest for its current files (a crafted checkpoint comes with a fitting one)."""
    body = manifest.describe(folder)
    (folder / manifest.MANIFEST).write_text(json.dumps(body))


def test_manifest_holds_a_crc32_of_every_file_and_a_flipped_byte_is_found(run4):
    body = json.loads((run4 / "checkpoints" / "step_00000004" / "manifest.json").read_text())
    assert set(body["crc32"]) == set(body["files"]) and "state/__0_0.distcp" in body["crc32"]
    shard = run4 / "checkpoints" / "step_00000004" / "state" / "__0_0.distcp"
    assert body["crc32"]["state/__0_0.distcp"] == manifest.crc32_file(shard)


@pytest.mark.parametrize("target", ["state/.metadata", "rng.pt"])
def test_crafted_pickle_runs_nothing_and_is_one_line_naming_the_file(capsys, tiny_dataset, run4, tmp_path, target):
    run, _, new = _copy(run4, tmp_path)
    marker = tmp_path / "pwned"
    for folder in (run / "checkpoints").iterdir():  # every checkpoint crafted: no fallback hides the refusal
        (folder / target).write_bytes(pickle.dumps(_Payload(marker)) if target.endswith("metadata")
                                      else _torch_payload(marker))
        _remanifest(folder)
    code, err = run_cli(capsys, "train", str(TINY), *_sets(tiny_dataset, run, "schedule.steps=6"))
    assert code == 2 and target.split("/")[-1] in _last_line(err, "train")
    assert "nothing in it was run" in err and not marker.exists()
    if target == "rng.pt":  # only a resume restores the RNG: verify and export never read it
        return
    code, err = run_cli(capsys, "verify", str(TINY), "--set", f'data.root="{tiny_dataset}"', "--checkpoint", str(run))
    assert code == 2 and target.split("/")[-1] in _last_line(err, "verify")
    code, err = run_cli(capsys, "export", str(run), str(tmp_path / "exp"))
    assert code == 2 and target.split("/")[-1] in _last_line(err, "export")
    assert "nothing in it was run" in err and not marker.exists()


def _torch_payload(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    return buf.getvalue()


def test_crafted_non_tensor_item_in_a_shard_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    planner = SafePlanner()
    planner._source = "state"
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="optim.param_groups.0.lr"))
    with pytest.raises(UnsafeCheckpointError,
                       match=r"optim.param_groups.0.lr is not plain data.*nothing in it was run"):
        planner.load_bytes(item, io.BytesIO(_torch_payload(marker)))
    assert not marker.exists()


def test_metadata_unpickler_reads_real_metadata_and_refuses_a_payload(run4, tmp_path):
    meta = read_metadata_file(run4 / "checkpoints" / "step_00000004" / "state" / ".metadata")
    assert "model.patch_embedding.weight" in meta.state_dict_metadata or len(meta.state_dict_metadata) > 10
    bad = tmp_path / ".metadata"
    bad.write_bytes(pickle.dumps(_Payload(tmp_path / "pwned")))
    with pytest.raises(UnsafeCheckpointError, match=r"refuses to build posix.system"):
        read_metadata_file(bad)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("damage", ["flip", "truncate", "metadata", "train_state", "manifest"])
def test_damaged_newest_checkpoint_falls_back_loudly_for_every_kind_of_damage(capsys, tiny_dataset, run4, tmp_path,
                                                                              damage):
    run, old, new = _copy(run4, tmp_path)
    shard = new / "state" / "__0_0.distcp"
    if damage == "flip":  # same size, other bytes: only the checksum sees it
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:100])
    else:
        name = {"metadata": "state/.metadata", "train_state": "train_state.json", "manifest": "manifest.json"}[damage]
        (new / name).write_bytes(b"\x00garbage{")
        if damage != "manifest":
            _remanifest(new)  # sizes and checksums fit: only the parse finds it
    why = checkpoint.problem(new)
    assert why is not None and str(new) in why
    assert checkpoint.latest(run / "checkpoints") == old
    code, err = run_cli(capsys, "verify", str(TINY), "--set", f'data.root="{tiny_dataset}"',
                        "--set", "data.max_tokens=60", "--checkpoint", str(run))
    assert f"verify: warning: {why}; using the checkpoint before it" in err
    assert f"verify: checkpoint {old} (step 2)" in err
    code, err = run_cli(capsys, "export", str(run), str(tmp_path / "exp"))
    assert code == 0 and f"export: checkpoint {old} (step 2, format diffusers)" in err and why in err
    assert json.loads((tmp_path / "exp" / "export.json").read_text())["step"] == 2
    code, err = run_cli(capsys, "train", str(TINY), *_sets(tiny_dataset, run, "schedule.steps=5"))
    assert code == 0 and f"warning: {why}; using the checkpoint before it" in err
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]


def test_any_save_failure_is_one_line_removes_the_temporary_and_keeps_the_previous_checkpoint(
        capsys, tiny_dataset, tmp_path, monkeypatch):
    real, calls = checkpoint.torch.save, []

    def save(obj, f, *a, **k):  # torch's own error when a write comes up short
        calls.extend([f] if str(f).endswith("rng.pt") else [])  # (DCP's own calls write into buffers)
        if len(calls) == 2 and str(f).endswith("rng.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 320 vs 0")
        return real(obj, f, *a, **k)

    monkeypatch.setattr(checkpoint.torch, "save", save)
    run = tmp_path / "run"
    code, err = run_cli(capsys, "train", str(TINY), *_sets(tiny_dataset, run))
    line = _last_line(err, "train")
    assert code == 2 and "step_00000004: cannot write the checkpoint (RuntimeError: [enforce fail" in line
    assert f"{run / 'checkpoints' / 'step_00000002'} is still the newest checkpoint" in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]


def _limited(limit: int):
    def setup() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return setup


@pytest.mark.slow  # 13-17 s on 2 cores
def test_full_disk_during_a_shard_write_is_one_line_and_leaves_no_temporary(tiny_dataset, run4, tmp_path):
    shard = run4 / "checkpoints" / "step_00000002" / "state" / "__0_0.distcp"
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "flexpack.cli", "train", str(TINY), *_sets(tiny_dataset, run)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300,
                          preexec_fn=_limited(shard.stat().st_size // 2))
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _last_line(proc.stderr, "train")
    assert "step_00000002: cannot write the checkpoint (" in line and "no checkpoint was written yet" in line
    assert list((run / "checkpoints").iterdir()) == []  # no .tmp-step_* left


def test_kill_during_pruning_leaves_only_trash_which_the_next_start_removes(capsys, tiny_dataset, run4, tmp_path):
    run, old, new = _copy(run4, tmp_path)
    script = ("import os, shutil, signal, sys\n"
              "from flexpack.run.state import checkpoint\n"
              "real = shutil.rmtree\n"
              "def rmtree(p, *a, **k):\n"
              "    if os.path.basename(p).startswith('.trash-') and os.path.exists(p):\n"
              "        os.remove(os.path.join(p, 'manifest.json'))  # a deletion cut short by the kill\n"
              "        os.kill(os.getpid(), signal.SIGKILL)\n"
              "    return real(p, *a, **k)\n"
              "checkpoint.shutil.rmtree = rmtree\n"
              "checkpoint.prune(sys.argv[1], 1)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script, str(run / "checkpoints")], env=env, capture_output=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL
    trash = run / "checkpoints" / ".trash-step_00000002"
    assert trash.is_dir() and not old.exists()  # never a half checkpoint under a checkpoint's name
    assert checkpoint.list_checkpoints(run / "checkpoints") == [new]
    # a pruning of an earlier version (manifest deleted first, shards kept) is recognised too
    shutil.copytree(new, old)
    (old / "manifest.json").unlink()
    code, err = run_cli(capsys, "train", str(TINY), *_sets(tiny_dataset, run, "schedule.steps=5"))
    assert code == 0
    assert f"removed {trash} (an interrupted pruning)" in err and f"removed {old} (an interrupted pruning)" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000004", "step_00000005"]


def test_manifestless_folder_newer_than_the_last_checkpoint_or_with_other_files_is_kept(run4, tmp_path):
    run, old, new = _copy(run4, tmp_path)
    mine = run / "checkpoints" / "step_00000001"
    shutil.copytree(old, mine)
    (mine / "manifest.json").unlink()
    (mine / "notes.txt").write_text("mine")
    newer = run / "checkpoints" / "step_00000009"
    shutil.copytree(old, newer)
    (newer / "manifest.json").unlink()
    assert checkpoint.remove_temporary(run / "checkpoints") == []
    assert (mine / "notes.txt").read_text() == "mine" and newer.is_dir()


@pytest.mark.slow  # 13-17 s on 2 cores
def test_sighup_saves_like_sigterm(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "flexpack.cli", "train", str(TINY),
           *_sets(tiny_dataset, out, "schedule.steps=500", "checkpoint.every=0")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        wait_for_steps(proc, out, 2)
        proc.send_signal(signal.SIGHUP)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGHUP, err[-2000:]
    saved = checkpoint.latest(out / "checkpoints")
    assert saved is not None and "interrupted by SIGHUP" in err and not (out / "train.lock").exists()


def test_tensorboard_restart_before_any_checkpoint_drops_the_killed_runs_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from flexpack.run.config import load_config
    from flexpack.training.observe import tracking

    cfg = load_config(None, ["log.tensorboard=true"])
    with tracking.MetricSinks(tmp_path, cfg.log) as sinks:  # killed before its first checkpoint
        for step in (1, 2, 3):
            sinks.log({"step": step, "loss": 1.0})
    # event files sort by name: seconds, host, pid, then a per-process counter that sorts "10" before "9";
    # a restarted process starts in a later second, so the test does too
    time.sleep(1.1)
    with tracking.MetricSinks(tmp_path, cfg.log, start_step=0) as sinks:  # starts over from step 0
        for step in (1, 2):
            sinks.log({"step": step, "loss": 2.0})
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.0), (2, 2.0)]


def test_async_save_writes_checksums_too(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    assert main(["train", str(TINY), *_sets(tiny_dataset, out, "checkpoint.async_save=true")]) == 0
    for ck in checkpoint.list_checkpoints(out / "checkpoints"):
        body = json.loads((ck / "manifest.json").read_text())
        assert body["crc32"]["state/__0_0.distcp"] == manifest.crc32_file(ck / "state" / "__0_0.distcp")
        assert checkpoint.problem(ck) is None


def test_export_racing_a_pruning_takes_the_newest_again(capsys, run4, tmp_path, monkeypatch):
    run, old, new = _copy(run4, tmp_path)
    real, seen = checkpoint.load, []

    def load(path, *a, **k):  # a train prunes the checkpoint export chose, after export chose it
        seen.append(Path(path).name)
        if len(seen) == 1:
            shutil.copytree(new, new.with_name("step_00000006"))
            checkpoint.prune(run / "checkpoints", 1)
        return real(path, *a, **k)

    monkeypatch.setattr(checkpoint, "load", load)
    code, err = run_cli(capsys, "export", str(run), str(tmp_path / "out"))
    assert code == 0 and seen == ["step_00000004", "step_00000006"] and "was pruned while reading it" in err


def test_killed_make_dataset_leaves_no_temporary_for_good(tmp_path):
    from flexpack.data.synthetic import make_synthetic_dataset

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".ds.tmp-{dead.pid}"
    (stale / "meta").mkdir(parents=True)
    make_synthetic_dataset(tmp_path / "ds", lengths=[9, 9], seed=0)
    assert not stale.exists() and (tmp_path / "ds" / "meta" / "info.json").is_file()


def test_crafted_pickle_in_a_tensor_shard_runs_nothing(capsys, tiny_dataset, run4, tmp_path):
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    run, old, new = _copy(run4, tmp_path)
    marker = tmp_path / "pwned"
    payload = _torch_payload(marker)
    for folder in (old, new):  # every item of the shard now points at the payload
        meta = read_metadata_file(folder / "state" / ".metadata")
        meta.storage_data = {k: _StorageInfo(v.relative_path, 0, len(payload), v.transform_descriptors)
                             for k, v in meta.storage_data.items()}
        shard = folder / "state" / "__0_0.distcp"  # padded: no tensor may claim more than the shards hold
        shard.write_bytes(payload + bytes(shard.stat().st_size))
        (folder / "state" / ".metadata").write_bytes(pickle.dumps(meta))
        _remanifest(folder)
        assert checkpoint.problem(folder) is None  # intact as far as sizes, sums and parses go
    code, err = run_cli(capsys, "export", str(run), str(tmp_path / "exp"))
    line = _last_line(err, "export")
    assert code == 2 and f"{new / 'state'}: a shard holds something other than tensors" in line
    code, err = run_cli(capsys, "train", str(TINY), *_sets(tiny_dataset, run, "schedule.steps=6"))
    assert code == 2 and "nothing in it was run" in _last_line(err, "train") and not marker.exists()


def test_a_manifest_naming_files_outside_its_folder_is_damage(run4, tmp_path):
    run, old, new = _copy(run4, tmp_path)
    body = json.loads((new / "manifest.json").read_text())
    body["files"]["../step_00000002/rng.pt"] = (old / "rng.pt").stat().st_size
    (new / "manifest.json").write_text(json.dumps(body))
    assert "outside the checkpoint folder" in checkpoint.problem(new)
    assert checkpoint.latest(run / "checkpoints") == old
