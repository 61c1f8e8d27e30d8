"""The learning rate of each optimizer step (:class:`~flexpack.run.config.ScheduleConfig`): warmup, cosine or
constant decay, and the re-warmup after a resume."""

from __future__ import annotations

import math

from flexpack.run.config import ScheduleConfig


def lr_at(step: int, base_lr: float, sched: ScheduleConfig, resumed_at: int | None = None) -> float:
    """LR of optimizer step ``step`` (0-based): warmup, cosine/constant, re-warmup after a resume."""
    if step < sched.warmup_steps:
        lr = base_lr * (step + (0 if sched.warmup_from_zero else 1)) / sched.warmup_steps
    elif sched.decay == "constant":
        lr = base_lr
    else:
        progress = min(1.0, (step - sched.warmup_steps) / max(1, sched.steps - sched.warmup_steps))
        lr = base_lr * (sched.min_lr_ratio + (1 - sched.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    s, n = (step - resumed_at if resumed_at is not None else -1), sched.rewarmup_steps  # s-th step after the resume
    if 0 <= s < n and sched.rewarmup_mode == "ramp":
        lr *= min(1.0, (s + 1) / n)
    elif 0 <= s < n:
        lr *= sched.rewarmup_from + (1 - sched.rewarmup_from) * s / n
    return lr
