"""Nothing a user wrote is lost: foreign run folders, config values that train nothing, unreadable
config files, names from data that would leave their folder, exports from the checkpoint's own
config; every case one line ``flexpack CMD: error: ...`` and exit 2."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lerobot")

from flexpack.cli import main  # noqa: E402
from flexpack.run.state import runfolder  # noqa: E402
from helpers import run_cli, set_args, tiny_sets  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.toml"
pytestmark = pytest.mark.usefixtures("one_thread")




def _train(root: Path | str, out: Path, *sets: str) -> list[str]:
    # the config file's 100-token packs, not tiny_sets' 60
    return ["train", str(TINY), *set_args(tiny_sets(root, out, "data.max_tokens=100", "schedule.steps=2", *sets))]


def _line(err: str, command: str) -> str:
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines[-1].startswith(f"flexpack {command}: error: "), err
    return lines[-1]


# ------------------------------------------------------------------ run folders
def test_foreign_folder_is_refused_naming_its_files_and_left_untouched(capsys, tiny_dataset, tmp_path):
    user = tmp_path / "userdir"
    user.mkdir()
    text = '{"epoch": 1, "acc": 0.91}\nmy notes\n'
    (user / "metrics.jsonl").write_text(text)
    (user / "config.json").write_text("not json")
    code, err = run_cli(capsys, *_train(tiny_dataset, user))
    line = _line(err, "train")
    assert code == 2 and "holds files flexpack did not write (config.json, metrics.jsonl)" in line
    assert "runtime.adopt_dir = true (train --force)" in line
    # --force adds a run only beside files it would not change: these it would
    code, err = run_cli(capsys, *_train(tiny_dataset, user), "--force")
    assert code == 2 and "holds config.json, metrics.jsonl, which flexpack did not write" in _line(err, "train")
    assert (user / "metrics.jsonl").read_text() == text and (user / "config.json").read_text() == "not json"
    assert sorted(p.name for p in user.iterdir()) == ["config.json", "metrics.jsonl"]


def test_force_adds_the_run_beside_other_files_and_changes_none(capsys, tiny_dataset, tmp_path):
    user = tmp_path / "userdir"
    user.mkdir()
    (user / "notes.txt").write_text("keep me")
    code, _ = run_cli(capsys, *_train(tiny_dataset, user), "--force")
    assert code == 0 and (user / "notes.txt").read_text() == "keep me"
    assert (user / runfolder.MARKER).is_file() and (user / "checkpoints" / "step_00000002").is_dir()
    code, err = run_cli(capsys, *_train(tiny_dataset, user, "schedule.steps=3"))  # marked: resumes without --force
    assert code == 0 and (user / "notes.txt").read_text() == "keep me"


def test_a_run_of_an_earlier_version_without_marker_still_resumes_and_gets_marked(capsys, tiny_dataset, tmp_path):
    run = tmp_path / "run"
    assert run_cli(capsys, *_train(tiny_dataset, run))[0] == 0
    (run / runfolder.MARKER).unlink()
    code, _ = run_cli(capsys, *_train(tiny_dataset, run, "schedule.steps=3"))
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert code == 0 and steps == [1, 2, 3] and (run / runfolder.MARKER).is_file()


def test_empty_and_missing_folders_are_adopted_and_a_file_named_checkpoints_is_refused_first(capsys, tiny_dataset,
                                                                                             tmp_path):
    (tmp_path / "empty").mkdir()
    assert run_cli(capsys, *_train(tiny_dataset, tmp_path / "empty"))[0] == 0
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "checkpoints").write_text("")
    code, err = run_cli(capsys, *_train(tiny_dataset, bad), "--force")
    assert code == 2 and "holds a file named 'checkpoints' where the run keeps a folder" in _line(err, "train")
    assert not (bad / "metrics.jsonl").exists()  # refused before any step was trained


def test_an_empty_or_torn_lock_file_is_replaced_and_locks_are_written_whole(tmp_path, capfd):
    (tmp_path / runfolder.LOCK).write_text("")
    with runfolder.RunLock(tmp_path):
        holder = json.loads((tmp_path / runfolder.LOCK).read_text())
        assert holder["pid"] == os.getpid()
        assert not list(tmp_path.glob(".train.lock.tmp-*"))
    assert "replacing an unreadable lock file" in capfd.readouterr().err and not (tmp_path / runfolder.LOCK).exists()


def test_advice_never_says_to_delete_a_folder(capsys, tiny_dataset, tmp_path):
    run = tmp_path / "run"
    assert run_cli(capsys, *_train(tiny_dataset, run))[0] == 0
    for p in (run / "checkpoints").glob("step_*/manifest.json"):
        p.write_text("{")
    code, err = run_cli(capsys, *_train(tiny_dataset, run, "schedule.steps=3"))
    line = _line(err, "train")
    assert code == 2 and "checkpoints: no usable checkpoint, all 1 are damaged" in line and "delete" not in line
    code, err = run_cli(capsys, *_train(tiny_dataset, run, "checkpoint.resume=false"))
    assert code == 2 and "delete" not in err and "remove the folder" not in err


# ------------------------------------------------------------------ config values
@pytest.mark.parametrize("setting,message", [
    ("objective.num_train_timesteps=0", "objective.num_train_timesteps must be an integer >= 1"),
    ("objective.num_train_timesteps=-1000", "objective.num_train_timesteps must be an integer >= 1"),
    ("objective.num_train_timesteps=1e-9", "objective.num_train_timesteps must be an integer >= 1 (the model's "
                                           "timestep scale, 1000 for Wan), got 1e-09"),
    ("objective.num_train_timesteps=999.5", "must be an integer >= 1 (the model's timestep scale, 1000 for Wan), "
                                            "got 999.5"),
    ("objective.action_weight=0", "are both 0: the loss would be 0"),
    ("model.preset=huge", "--set model.preset=huge: model.preset = 'huge': unknown WanVA preset"),
])
def test_values_that_would_train_nothing_are_one_line(capsys, tiny_dataset, tmp_path, setting, message):
    sets = [setting, "objective.latent_weight=0"] if "action_weight" in setting else [setting]
    code, err = run_cli(capsys, *_train(tiny_dataset, tmp_path / "run", *sets))
    assert code == 2 and message in _line(err, "train") and not (tmp_path / "run").exists()


def test_max_tokens_beyond_device_memory_is_refused_before_the_data(capsys, tmp_path):
    code, err = run_cli(capsys, *_train(tmp_path / "no-data", tmp_path / "run", "data.max_tokens=1000000000000"))
    line = _line(err, "train")
    assert code == 2 and "data.max_tokens = 1000000000000 cannot fit" in line and "GiB of cpu" in line


def test_unreadable_config_files_are_one_line(capsys, tmp_path):
    (tmp_path / "list.json").write_text("[1, 2]")
    code, err = run_cli(capsys, "train", str(tmp_path / "list.json"), "--set", "schedule.steps=2")
    assert code == 2 and "list.json: the top level must be a table" in _line(err, "train")
    (tmp_path / "latin.toml").write_bytes(b"[data]\nroot = \"caf\xe9\"\n")
    code, err = run_cli(capsys, "train", str(tmp_path / "latin.toml"))
    assert code == 2 and "latin.toml: not UTF-8 text (byte 18)" in _line(err, "train")


def test_garbage_pretrained_weights_are_one_line_blamed_on_the_set(capsys, tiny_dataset, tmp_path):
    (tmp_path / "w.safetensors").write_bytes(os.urandom(3000))
    code, err = run_cli(capsys, *_train(tiny_dataset, tmp_path / "run",
                                        f'model.pretrained="{tmp_path / "w.safetensors"}"'))
    line = _line(err, "train")
    assert code == 2 and "--set model.pretrained=" in line and "not a readable safetensors file" in line


def test_profile_warmup_is_read_only_when_profiling(tmp_path):
    env = {**os.environ, "LINGBOT_PROFILE_WARMUP": "abc", "PYTHONPATH": str(ROOT)}
    ok = subprocess.run([sys.executable, "-c", "import flexpack.training.loop"], env=env, capture_output=True,
                        text=True)
    assert ok.returncode == 0, ok.stderr
    from flexpack.commands.train import profile_env
    from flexpack.run.config import load_config

    os.environ["LINGBOT_PROFILE_WARMUP"] = "abc"
    saved = os.environ.pop("LINGBOT_PROFILE", None)
    try:
        assert profile_env(load_config(None, ["profile.steps=0"])).profile.env_warmup is None
        with pytest.raises(ValueError, match="LINGBOT_PROFILE_WARMUP must be a non-negative integer, got 'abc'"):
            profile_env(load_config(None, ["profile.steps=2"]))
    finally:
        del os.environ["LINGBOT_PROFILE_WARMUP"]
        if saved is not None:
            os.environ["LINGBOT_PROFILE"] = saved


# ------------------------------------------------------------------ names from data
@pytest.mark.parametrize("key,tag", [("observation.images..", "_."), ("observation.images...", "_.."),
                                     ("observation.images.a/../../x", "a_.._.._x"),
                                     ("observation.images.wrist", "wrist")])
def test_camera_keys_make_names_inside_the_cache(tmp_path, key, tag):
    from flexpack.data.cache import camera_tag, latent_path

    assert camera_tag([key]) == tag
    path = latent_path(tmp_path, [key], 3)
    assert path.parent.parent == tmp_path / "video" and path.resolve().is_relative_to((tmp_path / "video").resolve())


def test_repo_id_stays_inside_the_lerobot_cache(tmp_path, monkeypatch):
    from flexpack.data.hub import resolve_root
    from flexpack.safenames import inside

    monkeypatch.setenv("HF_LEROBOT_HOME", str(tmp_path / "home"))
    with pytest.raises(FileNotFoundError, match="not in the LeRobot cache"):
        resolve_root("org/name")
    with pytest.raises(ValueError, match="leaves"):
        inside(tmp_path / "home", tmp_path / "home" / "org" / ".." / ".." / "x")


# ------------------------------------------------------------------ export
@pytest.fixture(scope="module")
def run2(tiny_dataset, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export-own-config") / "run"
    assert main(_train(tiny_dataset, out)) == 0
    return out


def test_export_reads_the_checkpoints_own_config_and_statistics(capsys, tiny_dataset, run2, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run2, run)
    first = json.loads((run / "config.json").read_text())
    first["model"]["overrides"]["dim"] = 32  # "start over with another model": the run's first config differs
    first["data"]["root"] = str(tmp_path / "moved-away")  # and the dataset is gone
    (run / "config.json").write_text(json.dumps(first))
    ckcfg = run / "checkpoints" / "step_00000002" / "config.json"
    own = json.loads(ckcfg.read_text())
    code, err = run_cli(capsys, "export", str(run), str(tmp_path / "out"))
    assert code == 0, err
    saved = json.loads((tmp_path / "out" / "flexpack_config.json").read_text())
    assert saved["model"] == own["model"]
    norm = json.loads((tmp_path / "out" / "normalization.json").read_text())
    ts = json.loads((run / "checkpoints" / "step_00000002" / "train_state.json").read_text())
    assert norm["low"] == ts["extra"]["action_normalizer"]["low"]
    code, err = run_cli(capsys, "export", str(run), str(tmp_path / "out2"), "--set", "data.action_steps=2",
                        "--set", "data.stride=4")
    assert code == 0 and json.loads((tmp_path / "out2" / "normalization.json").read_text())["action_steps"] == 2
    mask = os.umask(0)
    os.umask(mask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "out").rglob("*.safetensors")}
    assert modes and set(modes.values()) == {0o666 & ~mask}


def test_export_into_a_read_only_place_is_one_line_and_removes_dead_temporaries(capsys, run2, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".tmp-out-{dead.pid}"
    stale.mkdir()
    code, _ = run_cli(capsys, "export", str(run2), str(tmp_path / "out"))
    assert code == 0 and not stale.exists()
    if os.geteuid() == 0:
        return  # root writes into read-only folders
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        code, err = run_cli(capsys, "export", str(run2), str(ro / "out"))
        assert code == 2 and "cannot write the export there (Permission denied)" in _line(err, "export")
        code, err = run_cli(capsys, "plot", str(run2), "--out", str(ro / "m.png"))
        assert code == 2 and "cannot write the plot (Permission denied)" in err
    finally:
        ro.chmod(0o755)


# ------------------------------------------------------------------ datasets
def test_int8_cache_and_missing_stats_are_problems_for_check_dataset_and_train(capsys, tiny_dataset, tmp_path):
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    root = tmp_path / "ds"
    shutil.copytree(tiny_dataset, root)
    latent = sorted((root / "latents" / "video").rglob("episode_*.safetensors"))[0]
    with safe_open(str(latent), "pt") as f:
        meta = f.metadata()
    save_file({k: v.to(torch.int8) for k, v in load_file(latent).items()}, str(latent), metadata=meta)
    (root / "meta" / "stats.json").unlink()
    code = main(["check-dataset", str(root)])
    out = capsys.readouterr().out
    # the default (pooled) statistics need no meta/stats.json; LeRobot's do
    assert code == 1 and "tensor 'latent' has dtype int8" in out and "no 'action' statistics" not in out
    code = main(["check-dataset", str(root), "--action-stats", "lerobot"])
    out = capsys.readouterr().out
    assert code == 1 and "no 'action' statistics" in out
    code, err = run_cli(capsys, *_train(root, tmp_path / "run", "data.normalize=false"))
    assert code == 2 and "has dtype int8" in _line(err, "train")


def test_resume_on_another_dataset_names_data_root(capsys, tiny_dataset, run2, tmp_path):
    from flexpack.data.encode import encode_dataset
    from flexpack.data.synthetic import make_synthetic_dataset

    other = make_synthetic_dataset(tmp_path / "other", lengths=[21, 17, 13], seed=2)
    encode_dataset(other, progress=False)
    shutil.copytree(run2, tmp_path / "run")
    code, err = run_cli(capsys, *_train(other, tmp_path / "run", "schedule.steps=3"))
    line = _line(err, "train")
    assert code == 2 and f"data.root is '{tiny_dataset}' there and '{other}' now" in line


def test_a_folder_holding_only_an_earlier_runs_lock_is_flexpacks(capsys, tiny_dataset, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / runfolder.LOCK).write_text(json.dumps({"pid": 999999999, "host": "elsewhere"}))
    runfolder.claim(run)
    assert (run / runfolder.MARKER).is_file()
    other = tmp_path / "other"
    other.mkdir()
    (other / runfolder.LOCK).write_text("my own lock file")
    with pytest.raises(ValueError, match=r"holds files flexpack did not write \(train.lock\)"):
        runfolder.claim(other)


def test_encode_removes_half_written_files_of_a_killed_encode(tiny_dataset, tmp_path):
    from flexpack.data.cache import latent_path
    from flexpack.data.encode import encode_dataset

    root = tmp_path / "ds"
    shutil.copytree(tiny_dataset, root)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folder = latent_path(root / "latents", ["observation.images.cam0"], 0).parent
    stale = folder / f".episode_000001.safetensors.tmp-{dead.pid}"
    stale.write_bytes(b"half")
    report = encode_dataset(root, progress=False)
    assert not stale.exists() and report.encoded == []


def test_a_full_or_read_only_disk_anywhere_is_a_user_error(capsys, tiny_dataset, tmp_path, monkeypatch):
    import errno

    from flexpack.errors import is_user_error
    from flexpack.training import loop

    assert is_user_error(OSError(errno.ENOSPC, "No space left on device"))
    assert is_user_error(OSError(errno.EROFS, "Read-only file system"))
    assert not is_user_error(OSError(errno.EIO, "Input/output error"))

    def full(*a, **k):  # metrics.jsonl on a full disk: the append fails inside the loop
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "metrics.jsonl"))

    monkeypatch.setattr(loop, "_log", full)
    code, err = run_cli(capsys, *_train(tiny_dataset, tmp_path / "run"))
    assert code == 2 and "metrics.jsonl: No space left on device" in _line(err, "train")
    assert not (tmp_path / "run" / runfolder.LOCK).exists()
