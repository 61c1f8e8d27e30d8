"""``sample.every`` on the lingbot-va family: the run samples its held-out episodes during training with the
family's own sampler (LeRobot's two streams and step counts), and the numbers equal ``flexpack sample`` on the
final checkpoint with the same settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexpack.commands.train import train
from helpers import run_cli, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = ["model.overrides.num_inference_steps=2", "model.overrides.action_num_inference_steps=3"]


def test_in_training_sampling_equals_the_cli_on_the_final_checkpoint(tiny_dataset, tmp_path, capsys) -> None:
    cfg = tiny_config(tiny_dataset, tmp_path / "run", "model.family=lingbot-va", "model.preset=lingbot-va-tiny",
                      "schedule.steps=2", "data.val_episodes=[0, 1]", "sample.every=2", "sample.horizon=4",
                      "sample.cuts=1", "sample.plots=0", "sample.draws=2", *STEPS)
    train(cfg)
    run = Path(cfg.runtime.out_dir)
    rec = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if "sample/action_mse" in x]
    hook = json.loads((run / "samples" / "step_00000002" / "metrics.json").read_text())
    assert [r["step"] for r in rec] == [2] and hook["steps"] == 2  # the family's num_inference_steps
    assert hook["pair_list"] == [[0, 4, 4], [1, 4, 4]] and hook["samples"] == 2  # (episode, cut, horizon)
    code, err = run_cli(capsys, "sample", str(run), "--val", "--out", str(tmp_path / "cli"), "--plots", "0",
                        "--cuts", "1", "--horizon", "4", "--samples", "2")
    assert code == 0, err
    cli = json.loads((tmp_path / "cli" / "metrics.json").read_text())
    assert cli["pair_list"] == hook["pair_list"]
    for k in ("action_mse", "action_mse_kmean", "latent_mse"):
        assert rec[0][f"sample/{k}"] == pytest.approx(cli[k], rel=1e-5) and hook[k] == rec[0][f"sample/{k}"]
