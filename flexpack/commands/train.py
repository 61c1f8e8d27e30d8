"""``flexpack train CONFIG``: the train loop (:func:`flexpack.training.loop.train`) with its hooks wired in.

Training and sampling are siblings that never import each other: this command gives the loop both of
its per-step hooks, the validation loss (``validation.every``) and sampling of held-out episodes
(``sample.every``). Under ``torchrun`` with several ranks it starts and ends the process group.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

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


def train(cfg: TrainConfig, **kwargs: Any) -> TrainResult:
    """:func:`flexpack.training.loop.train` with validation and sampling hooks (what ``flexpack train`` runs)."""
    from flexpack.training import loop

    return loop.train(cfg, hooks=hooks(), **kwargs)


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
        print(tracking.outputs(cfg.runtime.out_dir, result.checkpoint, cfg))
    return 0
