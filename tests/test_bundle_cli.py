"""A bundle through the commands: check-dataset lists problems per dataset and dumps one item as training sees it;
train (with a held-out split), resume and verify read the bundle in place."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from flexpack.data.bundle import BundleDataset
from flexpack.data.bundle_synthetic import SyntheticDataset, write_bundle

CAMS = {"observation.images.cam_high": (4, 4), "observation.images.cam_left_wrist": (2, 2),
        "observation.images.cam_right_wrist": (2, 2)}
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def flexpack(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flexpack.cli", *args], capture_output=True, text=True, env=ENV,
                          cwd=cwd, timeout=600)


@pytest.fixture()
def bundle(tmp_path: Path) -> Path:
    return write_bundle(tmp_path / "bundle", [
        SyntheticDataset(name="robotwin/a", episodes=[[(0, 30), (20, 45)], [(0, 25)], [(3, 40)]], cameras=CAMS,
                         action_columns=6),
        SyntheticDataset(name="robotwin/b", episodes=[[(0, 21)], [(0, 33)]], cameras=CAMS, action_columns=6),
    ], text=(16, 64))


def check(capsys: pytest.CaptureFixture, *argv: str) -> subprocess.CompletedProcess:
    """``flexpack check-dataset ARGV`` in this process: its exit status, stdout and stderr."""
    from flexpack.cli import main

    try:
        code = main(["check-dataset", *argv])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out.out, out.err)


def test_check_dataset_lists_problems_per_dataset_and_dumps_an_item(bundle: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    ok = check(capsys, str(bundle))
    assert ok.returncode == 0, ok.stderr
    rows = {line.split()[0]: line.split()[1:] for line in ok.stdout.splitlines() if line.startswith("robotwin/")}
    assert rows == {"robotwin/a": ["3", "4", "7-10", "6x4", "tshape", "0"],
                    "robotwin/b": ["2", "2", "6-9", "6x4", "tshape", "0"]}
    out = tmp_path / "item.safetensors"
    dumped = check(capsys, str(bundle), "--dump-item", "robotwin/a:0:1", str(out))
    assert dumped.returncode == 0, dumped.stderr
    item = BundleDataset(bundle, cfg_prob=0.0)[1]
    with safe_open(str(out), "pt") as f:
        for key in ("latent", "action", "action_mask", "text"):
            torch.testing.assert_close(f.get_tensor(key), item[key], rtol=0, atol=0)
        assert f.get_tensor("frame_ids").tolist() == item["frame_ids"]
        assert json.loads(f.metadata()["frame_range"]) == [20, 45] and f.metadata()["layout"] == "tshape"
    (bundle / "robotwin/b/latents/chunk-000/observation.images.cam_high/episode_000001_0_33.pth").unlink()
    bad = check(capsys, str(bundle))
    assert bad.returncode == 1
    assert "[problem] robotwin/b: episode 1 segment 0 [0, 33): " in bad.stdout and "no such file" in bad.stdout
    assert "1 problem(s) in 1 dataset(s) of 2" in bad.stdout
    wrong = check(capsys, str(bundle), "--dump-item", "robotwin/a:9", str(out))
    assert wrong.returncode == 2 and "expected DATASET:EPISODE:SEGMENT" in wrong.stderr


@pytest.mark.slow
def test_train_resume_and_verify_read_the_bundle_in_place(bundle: Path, tmp_path: Path) -> None:
    before = sorted((p, p.stat().st_mtime_ns) for p in bundle.rglob("*"))
    run = tmp_path / "run"
    base = ["configs/tiny_cpu.toml", "--set", "model.family=lingbot-va", "--set", "model.preset=lingbot-va-tiny",
            "--set", f"data.root={bundle}", "--set", f"runtime.out_dir={run}", "--set", "data.max_tokens=800",
            "--set", "data.val_fraction=0.2", "--set", "checkpoint.every=1", "--set", "schedule.steps=1"]
    repo = Path(__file__).resolve().parents[1]
    first = flexpack("train", *base, cwd=repo)
    assert first.returncode == 0, first.stderr
    again = flexpack("train", str(run), "--set", "schedule.steps=2", cwd=repo)
    assert again.returncode == 0, again.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    saved = json.loads((run / "config.json").read_text())
    assert saved["data"]["format"] == "auto" and saved["data"]["cfg_prob"] == 0.1
    check = flexpack("verify", str(run), "--checkpoint", str(run), cwd=repo)
    assert check.returncode == 0 and "OK: max rel err" in check.stdout, check.stdout + check.stderr
    assert sorted((p, p.stat().st_mtime_ns) for p in bundle.rglob("*")) == before


def test_stats_on_a_bundle_gives_its_geometry_and_a_row_per_dataset(bundle: Path, capsys) -> None:
    from flexpack.cli import main

    assert main(["stats", "--dataset", str(bundle), "--mode", "pack", "--max-tokens", "800", "--json"]) == 0
    out = capsys.readouterr()
    s = json.loads(out.out)
    assert "10 tokens per frame" in out.err and "composed latent 6x4 (tshape)" in out.err  # 3x2 patches + 4 steps
    ds = BundleDataset(bundle, normalize=False, cfg_prob=0.0)
    frames = {"robotwin/a": sum(ds.lengths()[:4]), "robotwin/b": sum(ds.lengths()[4:])}
    assert {k: v["segments"] for k, v in s["datasets"].items()} == {"robotwin/a": 4, "robotwin/b": 2}
    for name, n in frames.items():
        assert s["datasets"][name]["token_share"] == pytest.approx(n / sum(frames.values()))


def test_the_validation_loss_reads_held_out_items_without_text_dropout(bundle: Path, tmp_path: Path) -> None:
    """Training draws the bundle's text dropout (``data.cfg_prob``); the validation hook's held-out run is the
    ``"val"`` role's (composed from the training run: its geometry), whose items keep their text."""
    from flexpack.run.compose import compose
    from flexpack.training.validation import Validator
    from helpers import bundle_run

    cfg = bundle_run(bundle, tmp_path / "run", "data.cfg_prob=1.0", "data.val_episodes=[1, 3]",
                     "validation.every=1", train=False)
    run = compose(cfg, "train")
    val = Validator(run).run
    assert run.dataset.cfg_prob == 1.0 and all(run.dataset.drops_text(i) for i in range(len(run.dataset)))
    assert val.role == "val" and val.dataset.cfg_prob == 0.0 and len(val.dataset) == 2  # one segment each
    assert val.geometry is run.geometry and val.grid == run.grid and val.device == run.device
