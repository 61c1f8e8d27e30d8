"""Bad input to every subcommand: exit status 2 and one line ``flexpack CMD: error: ...`` naming the
config key, file, episode or value (and where a value came from); tracebacks only for bugs."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexpack.cli import main
from flexpack.run.config import load_config
from flexpack.run.state.manifest import describe
from helpers import run_cli, set_args, tiny_sets

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.toml"

pytestmark = pytest.mark.usefixtures("one_thread")




def train_args(root: Path | str, out: Path, *sets: str) -> list[str]:
    # the config file's 100-token packs, not tiny_sets' 60
    return ["train", str(TINY), *set_args(tiny_sets(root, out, "data.max_tokens=100", "schedule.steps=2", *sets))]


def one_error_line(err: str, command: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert lines and lines[-1].startswith(f"flexpack {command}: error: "), err
    return lines[-1]


# ------------------------------------------------------------------ config: keys, values, source
@pytest.mark.parametrize("setting,message", [
    ("optim.lrr=1", "--set optim.lrr=1: unknown config key(s) optim.lrr"),
    ("optim.lr=-1", "--set optim.lr=-1: optim.lr must be positive, got -1.0"),
    ("optim.lr=nan", "--set optim.lr=nan: optim.lr must be a finite number, got nan"),
    ("optim.lr=inf", "--set optim.lr=inf: optim.lr must be a finite number, got inf"),
    ("optim.grad_clip=nan", "--set optim.grad_clip=nan: optim.grad_clip must be a finite number, got nan"),
    ("optim.weight_decay=-inf", "optim.weight_decay must be a finite number, got -inf"),
    ("optim.betas=[0.9, nan]", "optim.betas[1] must be a finite number, got nan"),
    ("optim.betas=[0.9, 1.5]", "optim.betas must both be in [0, 1), got [0.9, 1.5]"),
    ("objective.shift=nan", "objective.shift must be a finite number, got nan"),
    ("schedule.min_lr_ratio=nan", "schedule.min_lr_ratio must be a finite number, got nan"),
    ("model.overrides.eps=nan", "model.overrides.eps must be a finite number, got nan"),
    ("model.overrides.dimm=3", "--set model.overrides.dimm=3: model.overrides has unknown WanVAConfig fields ['dimm']"),
    ("model.overrides.dim=-5", "--set model.overrides.dim=-5: model.overrides.dim must be positive, got -5"),
    ("model.overrides.dim='x'", "--set model.overrides.dim='x': model.overrides.dim must be int, got 'x'"),
    ("model.overrides.num_heads=5",
     "--set model.overrides.num_heads=5: model.overrides.dim=256 is not divisible by num_heads=5"),
    ("model.overrides.attn_backend='x'", "model.overrides.attn_backend must be one of ('auto', 'dense', 'flex', "),
    ("checkpoint.keep=0", "--set checkpoint.keep=0: checkpoint.every must be >= 0 and checkpoint.keep >= 1"),
    ("data.action_steps=3", "--set data.action_steps=3: data.action_steps = 3 must divide data.stride = 4"),
    ("runtime.device='banana'",
     "--set runtime.device='banana': runtime.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'banana'"),
    ("runtime.device='cuda:x'", "runtime.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'cuda:x'"),
    ("runtime.out_dir=''", "runtime.out_dir is empty"),
    ("parallel.activation_memory_budget=2", "parallel.activation_memory_budget must be between 0 and 1"),
])
def test_config_errors_name_the_key_the_value_and_the_set_it_came_from(capsys, tmp_path, setting, message):
    code, err = run_cli(capsys, *train_args(tmp_path / "no-data", tmp_path / "run", setting))
    line = one_error_line(err, "train")
    assert code == 2 and message in line, line
    assert not (tmp_path / "run").exists()  # nothing was started


def test_a_bad_value_in_the_file_is_blamed_on_the_file(capsys, tmp_path):
    cfg = tmp_path / "x.toml"
    cfg.write_text(TINY.read_text().replace("lr = 3e-3", "lr = -1.0"))
    code, err = run_cli(capsys, "train", str(cfg), "--set", "optim.weight_decay=0.1")
    line = one_error_line(err, "train")
    assert code == 2 and f"{cfg}: optim.lr must be positive, got -1.0" in line
    cfg.write_text(TINY.read_text().replace("lr = 3e-3", "lr = -1.0").replace("grad_clip = 1.0", "grad_clip = nan"))
    code, err = run_cli(capsys, "train", str(cfg), "--set", "optim.lr=0.1")  # --set repairs lr, not grad_clip
    assert code == 2 and f"{cfg}: optim.grad_clip must be a finite number, got nan" in one_error_line(err, "train")


def test_unknown_file_key_and_missing_config_file(capsys, tmp_path):
    cfg = tmp_path / "y.toml"
    cfg.write_text("[optim]\nlearning_rate = 1.0\n")
    code, err = run_cli(capsys, "verify", str(cfg))
    assert code == 2 and f"{cfg}: unknown config key(s) optim.learning_rate" in one_error_line(err, "verify")
    code, err = run_cli(capsys, "train", str(tmp_path / "nope.toml"))
    assert code == 2 and f"config file {tmp_path / 'nope.toml'} does not exist" in one_error_line(err, "train")


@pytest.mark.parametrize("value", ["-1", "0", "two"])
def test_stop_after_must_be_a_positive_step_count(capsys, tmp_path, value):
    code, err = run_cli(capsys, *train_args(tmp_path, tmp_path / "run"), "--stop-after", value)
    assert code == 2 and "flexpack train: error: argument --stop-after" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_stop_after_checked_in_the_library_too(tmp_path):
    from flexpack.commands.train import train
    from flexpack.errors import UserError

    cfg = load_config(TINY, [f'runtime.out_dir="{tmp_path}"'])
    with pytest.raises(UserError, match=r"--stop-after must be an integer >= 1, got -1"):
        train(cfg, stop_after=-1)


# ------------------------------------------------------------------ device and run folder, before any data
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_one_line(capsys, tmp_path, device):
    code, err = run_cli(capsys, *train_args(tmp_path / "no-data", tmp_path / "run", f"runtime.device='{device}'"))
    line = one_error_line(err, "train")
    assert code == 2 and f"runtime.device = '{device}' but CUDA is not available here" in line
    assert "runtime.device = 'cpu'" in line  # says what to do


def test_cuda_means_cuda_local_rank(monkeypatch):
    from flexpack.run import checks

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", seen.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert checks.resolve_device("cuda") == torch.device("cuda", 1)
    assert checks.resolve_device("auto") == torch.device("cuda", 1)
    assert checks.resolve_device("cuda:0") == torch.device("cuda", 0)
    assert seen == [torch.device("cuda", 1), torch.device("cuda", 1), torch.device("cuda", 0)]
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError, match=r"asks for GPU 2 \(LOCAL_RANK=2\) but 2 GPU\(s\) are visible"):
        checks.resolve_device("cuda")


def test_out_dir_that_is_a_file_fails_before_the_data_is_read(capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    # data.root does not exist either: the run folder is checked first
    code, err = run_cli(capsys, *train_args(tmp_path / "no-data", afile))
    assert code == 2 and f"runtime.out_dir = '{afile}' is a file; choose a folder" in one_error_line(err, "train")
    code, err = run_cli(capsys, *train_args(tmp_path / "no-data", afile / "run"))
    assert code == 2 and f"is below {afile}, which is a file" in one_error_line(err, "train")
    # a creatable folder passes and is not left behind when the data then fails
    code, err = run_cli(capsys, *train_args(tmp_path / "no-data", tmp_path / "new" / "run"))
    assert code == 2 and "not a LeRobot dataset" in one_error_line(err, "train")
    assert not (tmp_path / "new").exists()


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_out_dir(capsys, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        code, err = run_cli(capsys, *train_args(tmp_path / "no-data", ro / "run"))
    finally:
        ro.chmod(0o755)
    assert code == 2 and "is not writable" in one_error_line(err, "train")


# ------------------------------------------------------------------ data
def test_missing_dataset(capsys, tmp_path):
    code, err = run_cli(capsys, *train_args(tmp_path / "no-data", tmp_path / "run"))
    line = one_error_line(err, "train")
    assert code == 2 and str(tmp_path / "no-data") in line and "not a LeRobot dataset" in line


@pytest.mark.parametrize("setting,message", [
    ("data.cameras=['wrist']", "camera 'wrist' is not in the dataset; its cameras are ['observation.images.cam0']"),
    ("data.max_tokens=20", "episode 0 has 10 latent frames = 50 tokens (5 per frame) > data.max_tokens = 20 "
                           "(4 item(s) too long); raise data.max_tokens to at least 50 or set data.crop = true"),
    ("model.overrides.action_channels=2", "the dataset has 6 action columns but the model has "
                                          "model.overrides.action_channels = 2; "
                                          "raise model.overrides.action_channels to at least 6"),
    ("model.overrides.in_channels=16", "do not fit the model (in_channels=16"),
    ("data.max_tokens=3", "data.max_tokens = 3 is less than one latent frame (5 tokens"),
    ("parallel.activation_memory_budget=0.5",
     "parallel.activation_memory_budget = 0.5 applies to compiled blocks, which "
     "parallel.compile = 'auto' leaves off here (cpu, pack mode)"),
])
def test_data_that_does_not_fit_the_config(capsys, tiny_dataset, tmp_path, setting, message):
    code, err = run_cli(capsys, *train_args(tiny_dataset, tmp_path / "run", setting))
    line = one_error_line(err, "train")
    assert code == 2 and message in line, line


def test_stride_mismatch_in_train_and_check_dataset(capsys, tiny_dataset, tmp_path):
    code, err = run_cli(capsys, *train_args(tiny_dataset, tmp_path / "run", "data.stride=2", "data.action_steps=2"))
    line = one_error_line(err, "train")
    assert code == 2 and "implies 19 (stride 2); the file was encoded with stride 4" in line and "episode 0" in line
    code = main(["check-dataset", str(tiny_dataset), "--stride", "2"])
    out = capsys.readouterr().out.splitlines()
    assert code == 1
    assert out[0] == (f"[frames] dataset: {tiny_dataset / 'latents'}: the cache was encoded with stride 4 "
                      "(6 episode(s), e.g. 0), checked with stride 2; pass --stride 4 or re-encode the cache")


def test_missing_stats_hint_names_data_normalize(capsys, tiny_dataset, tmp_path):
    root = tmp_path / "ds"
    shutil.copytree(tiny_dataset, root)
    (root / "meta" / "stats.json").unlink()
    # LeRobot's statistics are asked for: their absence is one line
    code, err = run_cli(capsys, *train_args(root, tmp_path / "run", 'data.action_stats="lerobot"'))
    line = one_error_line(err, "train")
    assert code == 2 and f"{root}: the dataset has no stats for 'action'; set data.normalize = false" in line
    # the default, pooled statistics, are flexpack's own (LATENTS/stats.json): meta/stats.json is not needed
    code, err = run_cli(capsys, *train_args(root, tmp_path / "run2", "schedule.steps=1"))
    assert code == 0, err


@pytest.mark.parametrize("workers", [0, 1])
def test_corrupt_latent_is_one_line_naming_file_and_episode(capsys, tiny_dataset, tmp_path, workers):
    root = tmp_path / "ds"
    shutil.copytree(tiny_dataset, root)
    bad = root / "latents" / "video" / "cam0" / "episode_000003.safetensors"
    bad.write_bytes(bad.read_bytes()[:200])
    code, err = run_cli(capsys, *train_args(root, tmp_path / "run", "schedule.steps=6", f"data.num_workers={workers}"))
    line = one_error_line(err, "train")
    assert code == 2 and line.startswith(f"flexpack train: error: [unreadable] episode 3: {bad}: cannot be read"), line


def test_cache_files_have_ordinary_permissions(tiny_dataset):
    mask = os.umask(0)
    os.umask(mask)
    files = sorted((tiny_dataset / "latents").rglob("*.safetensors"))
    assert len(files) == 6 + 3  # latents of 6 episodes, texts of 3 tasks
    assert {f.stat().st_mode & 0o777 for f in files} == {0o666 & ~mask}


def test_atomic_path_gives_written_files_the_umask_mode(tmp_path):
    from flexpack.atomic import atomic_path

    old = os.umask(0o027)
    try:
        with atomic_path(tmp_path / "f.bin") as tmp:
            fd = os.open(tmp, os.O_CREAT | os.O_WRONLY, 0o600)  # as a private-by-default writer does
            os.close(fd)
    finally:
        os.umask(old)
    assert (tmp_path / "f.bin").stat().st_mode & 0o777 == 0o640


# ------------------------------------------------------------------ checkpoints and verify
@pytest.fixture(scope="module")
def trained_run(tiny_dataset, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bad-inputs") / "run"
    assert main(train_args(tiny_dataset, out, "schedule.steps=1")) == 0
    return out


def test_checkpoint_of_another_model_shape_is_one_line(capsys, tiny_dataset, trained_run, tmp_path):
    shutil.copytree(trained_run, tmp_path / "run")
    code, err = run_cli(capsys, *train_args(tiny_dataset, tmp_path / "run", "schedule.steps=3",
                                            "model.overrides.dim=32"))
    line = one_error_line(err, "train")
    assert code == 2 and len(err.strip().splitlines()) == 1
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000001"
    assert line.startswith(f"flexpack train: error: cannot resume from {ckpt}: its model has another shape")
    assert "(model.dim is 256 there and 32 now (model.overrides.dim))" in line  # before any weights load
    # a checkpoint written before the model record: its shape as model.overrides set it, then tensor by tensor
    state = json.loads((ckpt / "train_state.json").read_text())
    del state["extra"]["model_config"]
    (ckpt / "train_state.json").write_text(json.dumps(state))
    body = json.loads((ckpt / "manifest.json").read_text())
    for key, value in describe(ckpt, ["train_state.json"]).items():
        body[key].update(value)
    (ckpt / "manifest.json").write_text(json.dumps(body))
    code, err = run_cli(capsys, *train_args(tiny_dataset, tmp_path / "run", "schedule.steps=3",
                                            "model.overrides.dim=32"))
    line = one_error_line(err, "train")
    assert code == 2 and "(model.overrides.dim is None there and 32 now)" in line
    code, err = run_cli(capsys, "verify", str(TINY), "--set", f'data.root="{tiny_dataset}"', "--set",
                        "model.overrides.num_layers=1", "--checkpoint", str(tmp_path / "run"))
    line = one_error_line(err, "verify")  # refused before any weight is read: not the model that was trained
    assert code == 2 and "disagrees with what" in line and "num_layers = 1, trained 2" in line
    code, err = run_cli(capsys, *train_args(tiny_dataset, tmp_path / "run", "schedule.steps=3",
                                            "model.overrides.rope_theta=500.0"))  # shapes no tensor: resumes
    assert code == 0, err


@pytest.mark.parametrize("tol", ["-1", "0", "nan"])
def test_verify_tol_must_be_positive(capsys, tmp_path, tol):
    code, err = run_cli(capsys, "verify", str(TINY), "--set", f'data.root="{tmp_path}"', "--tol", tol)
    line = one_error_line(err, "verify")
    assert code == 2 and "--tol must be a finite number > 0" in line and f"got {float(tol)!r}" in line


def test_verify_checkpoint_that_is_not_one(capsys, tiny_dataset, tmp_path):
    code, err = run_cli(capsys, "verify", str(TINY), "--set", f'data.root="{tiny_dataset}"',
                        "--checkpoint", str(tmp_path))
    assert code == 2 and f"{tmp_path}: no checkpoints/ folder; not a flexpack run folder " \
        "(runtime.out_dir of a train run) nor a checkpoint folder" in one_error_line(err, "verify")


# ------------------------------------------------------------------ bugs keep their traceback
def test_bugs_keep_their_traceback_and_debug_shows_user_errors_too(capsys, tmp_path, monkeypatch):
    import flexpack.commands.train as loop

    def buggy(cfg, stop_after=None):
        torch.optim.AdamW([], lr=1.0)  # a ValueError raised inside torch: a bug, not the user's input

    monkeypatch.setattr(loop, "train", buggy)
    with pytest.raises(ValueError, match="empty parameter list"):
        main(train_args(tmp_path, tmp_path / "run"))
    monkeypatch.setattr(loop, "train", lambda cfg, stop_after=None: {}["missing"])
    with pytest.raises(KeyError):
        main(train_args(tmp_path, tmp_path / "run"))
    with pytest.raises(ValueError, match="optim.lr must be positive"):
        main(["--debug", *train_args(tmp_path, tmp_path / "run", "optim.lr=-1")])


def test_which_exceptions_are_user_errors():
    from flexpack.data.problems import Problem
    from flexpack.errors import UserError, is_user_error, one_line

    def raised(fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the point is to classify it
            return exc
        raise AssertionError("did not raise")

    assert is_user_error(UserError("x"))
    assert is_user_error(Problem("missing", 3, Path("f"), "gone").error())
    assert is_user_error(raised(lambda: load_config(overrides=["optim.lr=-1"])))  # raised in flexpack
    assert not is_user_error(raised(lambda: torch.optim.AdamW([], lr=1.0)))  # raised in torch
    assert not is_user_error(raised(lambda: {}["k"]))
    assert not is_user_error(ValueError("never raised"))
    worker = ValueError('Caught ValueError in DataLoader worker process 0.\n'
                        'Original Traceback (most recent call last):\n'
                        f'  File "{ROOT / "flexpack" / "data" / "dataset.py"}", line 1, in f\n'
                        'ValueError: episode 4: bad\n')
    assert is_user_error(worker) and one_line(worker) == "episode 4: bad"
    assert one_line(UserError("a\n  b")) == "a; b"


def test_subprocess_exit_status_and_stderr(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "flexpack.cli",
                        *train_args(tmp_path, tmp_path / "run", "optim.grad_clip=nan")],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == ("flexpack train: error: --set optim.grad_clip=nan: optim.grad_clip must be a "
                                "finite number, got nan")


# ------------------------------------------------------------------ library misuse
def test_flex_attn_func_takes_a_sequence_layout_or_says_what_to_pass():
    from flexpack.attention.flex import FlexAttnFunc
    from flexpack.packing.layout import SequenceLayout

    layout = SequenceLayout.from_rows([[3, 5, 2]], 12)  # 12 frames, 2 tokens each
    q, k, v = torch.randn(3, 1, 2, 24, 8).unbind(0)
    attn = FlexAttnFunc("dense")
    want = attn(q, k, v, layout.tokens(video_tokens=1, action_tokens=1))
    assert torch.equal(attn(q, k, v, layout), want)
    assert torch.equal(attn(q, k, v, layout, mask="chunk_causal", chunk_size=2),
                       attn(q, k, v, layout.tokens(video_tokens=2), mask="chunk_causal", chunk_size=2))
    with pytest.raises(TypeError, match=r"12 frames for q of 23 tokens; FlexAttnFunc needs the token layout: "
                                        r"pass layout\.tokens\(video_tokens="):
        attn(q[:, :, :23], k[:, :, :23], v[:, :, :23], layout)
    with pytest.raises(TypeError, match=r"teacher_forcing.*pass layout\.tokens\("):
        attn(q, k, v, layout, mask="teacher_forcing", chunk_size=2)
    with pytest.raises(TypeError, match=r"prepare\(\) got a SequenceLayout"):
        attn.prepare(layout)
    assert math.isfinite(float(want.sum()))


# ------------------------------------------------------------------ the other subcommands share the path
@pytest.mark.parametrize("command,argv,message", [
    ("stats", ["--frames-file", "{tmp}/nope.txt", "--mode", "pack"], "{tmp}/nope.txt"),
    ("make-dataset", ["{tmp}", "--lengths", "9,x"], "--lengths '9,x': expected comma-separated integers"),
    ("make-dataset", ["{tmp}"], "{tmp}: already exists"),
    ("encode", ["--dataset", "{tmp}/none", "--no-progress"], "{tmp}/none"),
    ("check-dataset", ["{tmp}", "--stride", "0"], "stride must be >= 1, got 0"),
])
def test_every_subcommand_reports_user_errors_the_same_way(capsys, tmp_path, command, argv, message):
    code, err = run_cli(capsys, command, *[a.format(tmp=tmp_path) for a in argv])
    assert code == 2 and message.format(tmp=tmp_path) in one_error_line(err, command)
    with pytest.raises((ValueError, OSError)):  # --debug: the traceback instead
        main(["--debug", command, *[a.format(tmp=tmp_path) for a in argv]])


def test_disk_full_during_a_checkpoint_is_one_line_and_keeps_the_last_checkpoint(capsys, tiny_dataset, tmp_path,
                                                                                 monkeypatch):
    import errno

    from flexpack.run.state import checkpoint

    real, calls = checkpoint.dcp.save, []

    def save(state, checkpoint_id):
        calls.append(checkpoint_id)
        if len(calls) == 2:  # the second save: a few bytes written, then the disk is full
            (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(checkpoint.dcp, "save", save)
    out = tmp_path / "run"
    code, err = run_cli(capsys, *train_args(tiny_dataset, out, "schedule.steps=4", "checkpoint.every=2"))
    line = one_error_line(err, "train")
    assert code == 2 and "step_00000004: cannot write the checkpoint (No space left on device)" in line
    assert f"{out / 'checkpoints' / 'step_00000002'} is still the newest checkpoint" in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002"]  # no half checkpoint
    assert checkpoint.latest(out / "checkpoints") == out / "checkpoints" / "step_00000002"
