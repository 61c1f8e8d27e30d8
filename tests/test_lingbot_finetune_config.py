"""configs/lingbot_va_finetune.toml holds LeRobot's training defaults for its lingbot_va policy, read from the
installed lerobot at test time (so a change there shows up here): optimizer, learning-rate schedule, steps."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

pytest.importorskip("lerobot.policies.lingbot_va", reason="the installed lerobot has no lingbot_va policy")

from lerobot.configs.train import TrainPipelineConfig  # noqa: E402
from lerobot.optim.schedulers import ConstantWithWarmupSchedulerConfig  # noqa: E402
from lerobot.policies.lingbot_va.configuration_lingbot_va import LingBotVAConfig  # noqa: E402

from flexpack.run.config import load_config  # noqa: E402
from flexpack.run.resolve import model_config_of  # noqa: E402
from flexpack.training.lr_schedule import lr_at  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "lingbot_va_finetune.toml"


def test_the_config_is_lerobots_fine_tuning_defaults() -> None:
    cfg = load_config(CONFIG, [])
    lerobot = LingBotVAConfig()
    opt, sched = lerobot.get_optimizer_preset(), lerobot.get_scheduler_preset()
    assert (cfg.model.family, cfg.model.preset) == ("lingbot-va", "lingbot-va-5b")
    assert cfg.optim.lr == opt.lr == 1e-5
    assert tuple(cfg.optim.betas) == tuple(opt.betas)
    assert cfg.optim.eps == opt.eps
    assert cfg.optim.weight_decay == opt.weight_decay == 1e-4
    assert cfg.optim.grad_clip == opt.grad_clip_norm
    assert isinstance(sched, ConstantWithWarmupSchedulerConfig)
    assert cfg.schedule.warmup_steps == sched.num_warmup_steps == 1000
    assert cfg.schedule.decay == "constant" and cfg.schedule.rewarmup_steps == 0
    assert cfg.schedule.steps == {f.name: f for f in dataclasses.fields(TrainPipelineConfig)}["steps"].default
    assert cfg.data.action_steps == lerobot.action_per_frame and cfg.runtime.dtype == lerobot.dtype
    # the model the preset builds is LeRobot's default shape (the released checkpoints)
    m = model_config_of(cfg)
    for name in ("num_attention_heads", "attention_head_dim", "ffn_dim", "num_layers", "text_dim", "action_dim"):
        assert getattr(m, name) == getattr(lerobot, name), name


def test_the_learning_rate_of_every_step_is_lerobots() -> None:
    """flexpack's lr at each step equals what LeRobot's scheduler preset gives its optimizer (warm-up from 0,
    then constant), read from the LambdaLR it builds."""
    cfg = load_config(CONFIG, [])
    lerobot = LingBotVAConfig()
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lerobot.get_optimizer_preset().lr)
    scheduler = lerobot.get_scheduler_preset().build(opt, num_training_steps=cfg.schedule.steps)
    theirs = []
    for _ in range(1203):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    ours = [lr_at(step, cfg.optim.lr, cfg.schedule) for step in range(len(theirs))]
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-20)
    assert ours[0] == 0.0 and ours[500] == pytest.approx(5e-6) and ours[1000:] == [1e-5] * 203
