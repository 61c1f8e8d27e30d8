"""A resume that changes settings says which, and what they do to the learning rate and to the work of one
optimizer step; ``flexpack train RUN`` resumes a run folder with its own config."""

from __future__ import annotations

import json
import math

import pytest

from flexpack.run.config import load_config
from flexpack.training.resume_note import effects

pytestmark = pytest.mark.usefixtures("one_thread")


def test_effects_state_the_lr_and_tokens_per_step_before_and_after():
    cfg = load_config(None, ["optim.lr=1e-3", "schedule.warmup_steps=0", "schedule.steps=40", "data.max_tokens=100",
                             "optim.accum_steps=2"])
    changed = {"schedule.steps": [20, 40], "optim.accum_steps": [1, 2]}
    lines = effects(cfg.data, cfg.optim, cfg.schedule, changed, step=10, world=1, old_world=2)
    was, now = 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 10 / 20))), \
        1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 10 / 40)))
    assert lines == [
        f"learning rate: the cosine decay now ends at step 40 (was at step 20); lr at step 10 goes from {was:.3g} "
        f"to {now:.3g}",
        "tokens (token budget) per optimizer step (data.max_tokens x optim.accum_steps x ranks): "
        "100 x 1 x 2 = 200 -> 100 x 2 x 1 = 200",
    ]
    assert (was, now) == (pytest.approx(5.5e-4), pytest.approx(8.682e-4, rel=1e-3))
    # a constant decay now, and more ranks in pad mode: episodes per step
    pad = load_config(None, ["data.mode=\"pad\"", "data.batch_size=4", "schedule.decay=\"constant\"", "optim.lr=2e-3",
                             "schedule.warmup_steps=0"])
    lines = effects(pad.data, pad.optim, pad.schedule,
                    {"schedule.decay": ["cosine", "constant"], "optim.lr": [1e-3, 2e-3]}, step=5, world=4,
                    old_world=2)
    assert lines[0].startswith("learning rate: the decay is now constant (was cosine to step 1000); "
                               "lr at step 5 goes from 0.001 to 0.002")
    assert lines[1] == "episodes per optimizer step (data.batch_size x optim.accum_steps x ranks): 4 x 1 x 2 = 8 -> " \
                       "4 x 1 x 4 = 16"
    assert effects(cfg.data, cfg.optim, cfg.schedule, {"log.every": [1, 5]}, step=10, world=1,
                   old_world=1) == []  # nothing to say


def test_train_run_folder_resumes_and_says_what_the_changes_do(tiny_dataset, tmp_path, capfd):
    from flexpack.cli import main
    from helpers import TINY, set_args, tiny_sets

    run = tmp_path / "run"
    first = tiny_sets(tiny_dataset, run, "schedule.steps=2", "schedule.warmup_steps=1", "log.tensorboard=false")
    assert main(["train", str(TINY), *set_args(first)]) == 0
    capfd.readouterr()
    # the run folder in place of a config file: its config, its out_dir; three settings changed
    assert main(["train", str(run), "--set", "schedule.steps=4", "--set", "optim.accum_steps=2",
                 "--set", "optim.lr=1e-3"]) == 0
    err = capfd.readouterr().err
    assert ("resuming at step 2 with changed config: optim.accum_steps 1 -> 2, optim.lr 0.003 -> 0.001, "
            f"schedule.steps 2 -> 4 (recorded in {run}/config_history.jsonl)") in err
    # step 2 of 2 was the end of the decay (0.1 x 3e-3); of 4 (warmup 1) it is a third of the way down
    assert ("  learning rate: the cosine decay now ends at step 4 (was at step 2); lr at step 2 goes from 0.0003 to "
            "0.000775; re-warmed over schedule.rewarmup_steps = 2 steps from 7.75e-05") in err
    assert ("  tokens (token budget) per optimizer step (data.max_tokens x optim.accum_steps x ranks): "
            "60 x 1 x 1 = 60 -> 60 x 2 x 1 = 120") in err
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # resumed in the same folder, not started over
