"""docs/USAGE.md's bundle block runs as written on a RoboTwin-like synthetic bundle (three cameras composed as a
T, 16 action columns placed as RoboTwin's, frame_ids every 4 video frames, pose slices made relative) with a tiny
LeRobot lingbot_va policy as the base. Substitutions, all stated here: BUNDLE, BASE and RUN name those folders;
`flexpack train` gets tiny-run settings appended (a CPU token budget, 2 steps, a third of the episodes held out,
the CPU device); `configs/` is the repository's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lerobot.policies.lingbot_va", reason="the installed lerobot has no lingbot_va policy")

from flexpack.data.bundle_synthetic import SyntheticDataset, write_bundle  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Fine-tune LingBot-VA from an upstream post-training bundle"
CAMS = {"observation.images.cam_high": (4, 4), "observation.images.cam_left_wrist": (2, 2),
        "observation.images.cam_right_wrist": (2, 2)}
ROBOTWIN = [0, 1, 2, 3, 4, 5, 6, 28, 7, 8, 9, 10, 11, 12, 13, 29]
TRAIN_EXTRA = ("--set data.max_tokens=1400 --set schedule.steps=2 --set data.val_fraction=0.34 "
               "--set runtime.device=cpu --set data.num_workers=0 --set checkpoint.every=1")


def usage_block() -> str:
    text = (ROOT / "docs" / "USAGE.md").read_text()
    return text[text.index(HEADING):].split("```bash\n", 1)[1].split("```", 1)[0]


def test_the_block_checks_trains_verifies_and_samples() -> None:
    block = usage_block()
    for command in ("check-dataset", "train configs/lingbot_bundle_robotwin.toml", "verify", "sample"):
        assert re.search(rf"^flexpack {command}\b", block, flags=re.M), command
    assert "--dump-item" in block and "$BUNDLE" in block and "$BASE" in block


def save_base(path: Path) -> None:
    import torch
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.lingbot_va.configuration_lingbot_va import LingBotVAConfig
    from lerobot.policies.lingbot_va.modeling_lingbot_va import LingBotVAPolicy

    torch.manual_seed(0)
    cfg = LingBotVAConfig(input_features={c: PolicyFeature(type=FeatureType.VISUAL, shape=(3, 16 * h, 16 * w))
                                          for c, (h, w) in CAMS.items()},
                          num_attention_heads=2, attention_head_dim=32, text_dim=64, freq_dim=32, ffn_dim=128,
                          num_layers=2, used_action_channel_ids=ROBOTWIN, obs_cam_keys=list(CAMS),
                          action_per_frame=16, max_sequence_length=16, dtype="float32", device="cpu",
                          camera_layout="robotwin_tshape")
    LingBotVAPolicy(cfg).save_pretrained(path)


@pytest.mark.slow
def test_usage_bundle_block_runs_as_written(tmp_path: Path) -> None:
    bundle = write_bundle(tmp_path / "bundle", [
        SyntheticDataset(name="beat_block_hammer", episodes=[[(0, 150)], [(0, 140)], [(2, 160)], [(0, 150)]],
                         cameras=CAMS, stride=4, action_columns=16),
        SyntheticDataset(name="click_bell", episodes=[[(0, 130), (100, 240)]], cameras=CAMS, stride=4,
                         action_columns=16),
    ], text=(16, 64))
    save_base(tmp_path / "base")
    py = sys.executable
    script = (f'set -euo pipefail\nflexpack() {{ if [ "$1" = train ]; then "{py}" -m flexpack.cli "$@" {TRAIN_EXTRA}; '
              f'else "{py}" -m flexpack.cli "$@"; fi; }}\n{usage_block()}')
    env = {**os.environ, "BUNDLE": str(bundle), "BASE": str(tmp_path / "base"), "RUN": str(tmp_path / "run"),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    work = tmp_path / "work"
    (work / "configs").mkdir(parents=True)
    (work / "configs" / "lingbot_bundle_robotwin.toml").write_text(
        (ROOT / "configs" / "lingbot_bundle_robotwin.toml").read_text())
    done = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    assert "ok: 2 datasets, 6 segments" in done.stdout
    assert (work / "item.safetensors").is_file()
    assert "OK: max rel err" in done.stdout
    assert (tmp_path / "run" / "checkpoints" / "step_00000002").is_dir()
    assert list((tmp_path / "run" / "samples").glob("*/metrics.json"))
