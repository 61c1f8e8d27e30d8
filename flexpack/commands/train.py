"""``flexpack train CONFIG``: the train loop (:func:`flexpack.training.loop.train`) with its hooks wired in.

The order a run starts in (:func:`train`): the start-up before any data is opened (:func:`flexpack.run.start.start_up`:
config, loggers, device, run folder, optimizer, the checkpoint to resume from; a folder already done ends there),
then, with the folder locked, the ``"train"`` :class:`~flexpack.run.root.Run` composed from what it checked and the
loop over that Run. Training and sampling are siblings that never import each other: this command gives the loop both of
its per-step hooks, the validation loss (``validation.every``) and sampling of held-out episodes
(``sample.every``). Under ``torchrun`` with several ranks it starts and ends the process group.

The environment is read here and nowhere below: ``LINGBOT_PROFILE`` / ``LINGBOT_PROFILE_WARMUP`` (users' one-off
override of ``profile.steps`` / ``profile.warmup``) go into ``profile.env_steps`` / ``profile.env_warmup``
(:func:`profile_env`), so the run folder's saved config says where its profiled steps came from.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from flexpack.commands.common import add_config, add_set, load
from flexpack.run.checks import positive_int

if TYPE_CHECKING:  # imported when the command runs: building the parser stays cheap (--help)
    from flexpack.run.config import TrainConfig
    from flexpack.run.hooks import HookFactory
    from flexpack.training.loop import TrainResult


def hooks() -> tuple[HookFactory, ...]:
    """What runs after each step of ``flexpack train``: the validation loss and sampling of held-out episodes."""
    from flexpack.sampling.hook import make_sample_hook
    from flexpack.training.validation import make_validator

    return (make_validator, make_sample_hook)


PROFILE_ENV, PROFILE_WARMUP_ENV = "LINGBOT_PROFILE", "LINGBOT_PROFILE_WARMUP"


def _env_int(name: str) -> int | None:
    """Environment variable ``name`` as a non-negative integer, None where unset or empty."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {text!r}")
    return value


def profile_env(cfg: TrainConfig, rank: int = 0) -> TrainConfig:
    """``cfg`` with ``profile.env_steps`` / ``profile.env_warmup`` as ``LINGBOT_PROFILE`` / ``LINGBOT_PROFILE_WARMUP``
    say now (None where unset: a restart without them profiles what the config says); the warm-up variable is read
    only when profiling. Rank 0 says where a variable overrides its key."""
    from dataclasses import replace

    p = cfg.profile
    steps = _env_int(PROFILE_ENV)
    profiling = p.steps if steps is None else steps
    warmup = _env_int(PROFILE_WARMUP_ENV) if profiling else None
    if rank == 0:
        for name, key, value, configured in ((PROFILE_ENV, "profile.steps", steps, p.steps),
                                             (PROFILE_WARMUP_ENV, "profile.warmup", warmup, p.warmup)):
            if value is not None and value != configured:
                print(f"{name}={value} overrides {key} = {configured}", file=sys.stderr, flush=True)
    if (steps, warmup) == (p.env_steps, p.env_warmup):
        return cfg
    return replace(cfg, profile=replace(p, env_steps=steps, env_warmup=warmup))


def train(cfg: TrainConfig, *, stop_after: int | None = None) -> TrainResult:
    """What ``flexpack train`` runs: the profiling variables read into the config (:func:`profile_env`), the start-up
    before any data is opened (:func:`flexpack.run.start.start_up`: config, device, run folder, optimizer, the
    checkpoint to resume from; the folder locked), then, inside it, the ``"train"`` run composed from what the start-up
    checked and trained by :func:`flexpack.training.loop.train` with :func:`hooks` (validation and sampling)."""
    from flexpack.parallel.parallelize import world
    from flexpack.run.compose import compose
    from flexpack.run.start import start_up
    from flexpack.training import loop

    cfg = profile_env(cfg, int(os.environ.get("RANK", "0")))
    with start_up(cfg, checks=loop.START_CHECKS, stop_after=stop_after) as started:
        if started.done is not None:  # the folder is at schedule.steps already: no data opened
            return loop.TrainResult.nothing_left(started)
        rank, size = world()
        run = compose(started.config, "train", rank=rank, world_size=size, device=started.device,
                      checked=started.checked)
        return loop.train(run, stop_after=stop_after, hooks=hooks(), started=started)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config(parser, folders="a run folder (resumes that run with its config)")
    add_set(parser)
    parser.add_argument("--stop-after", type=positive_int, default=None,
                        help="stop (with a checkpoint) after this step")
    parser.add_argument("--force", action="store_true",
                        help="train into an out_dir that holds other files (runtime.adopt_dir = true); none is changed")


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from flexpack.run.state import faults
    from flexpack.training.observe import tracking

    cfg = load(args.config, [*args.overrides, *(["runtime.adopt_dir=true"] if args.force else [])])
    started, rank = False, int(os.environ.get("RANK", "0"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        started = True
    try:
        result = train(cfg, stop_after=args.stop_after)
    except faults.Interrupted as exc:
        if rank == 0:
            print(f"flexpack train: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        if started:
            dist.destroy_process_group()
    if rank == 0 and result.step > result.start_step:  # (a finished run has said so already)
        last = result.metrics[-1] if result.metrics else {}
        print(f"trained steps {result.start_step} -> {result.step}; loss {last.get('loss', float('nan')):.4f}; "
              f"checkpoint {result.checkpoint}")
        print(tracking.outputs(cfg.runtime.out_dir, result.checkpoint, cfg.log))
    return 0
