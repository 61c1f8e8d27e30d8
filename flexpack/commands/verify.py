"""``flexpack verify CONFIG``: packed == per-episode (:func:`flexpack.tools.verify.verify_config`); exit 1 on a
mismatch."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from flexpack.commands.common import add_config, add_set, load


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config(parser, optional=True)
    add_set(parser)
    parser.add_argument("--checkpoint", default=None,
                        help="weights: a checkpoint folder or a run folder (its newest checkpoint), verified with "
                             "the config it was trained with (CONFIG may then be left out, and must otherwise agree "
                             "with what the run trained); default: fresh init")
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches of the sampler to check")
    parser.add_argument("--tol", type=float, default=None,
                        help="one max relative error for outputs, losses and gradients (default: the tolerances of "
                             "runtime.dtype, flexpack.tools.verify_report.TOLERANCES; the report prints those used)")
    parser.add_argument("--drop-packing", action="store_true",
                        help="feed the model a layout with all doc ids 0 (the bug this check catches); must fail")
    parser.add_argument("--synthetic", action="store_true",
                        help="in-memory random episodes shaped for the model instead of data.root (no dataset needed)")
    parser.add_argument("--synthetic-hw", type=int, nargs=2, default=None, metavar=("H", "W"),
                        help="latent height and width of --synthetic episodes (default: one patch)")
    parser.add_argument("--synthetic-text", type=int, default=16, metavar="L",
                        help="text tokens per --synthetic episode")


def trained_config(args: argparse.Namespace) -> tuple[Any, Path | None]:
    """(config, checkpoint folder) of a verify call. With ``--checkpoint``: the config it was trained with
    (:func:`~flexpack.run.state.trained.run_config`, as ``export`` reads it), said on stderr; a CONFIG or
    ``--set`` that disagrees with it on what was trained is one line
    (:func:`~flexpack.run.state.trained.check_trained`), not a check of another model."""
    from flexpack.errors import UserError
    from flexpack.run.resolve import model_config_of
    from flexpack.run.state.locate import pick_checkpoint
    from flexpack.run.state.trained import check_trained, run_config

    if args.checkpoint is None:
        if args.config is None:
            raise UserError("verify needs a CONFIG, or --checkpoint RUN to verify a trained run with its own config")
        return load(args.config, args.overrides), None
    found = pick_checkpoint(Path(args.checkpoint), "verify")
    source = run_config(Path(args.checkpoint), found)
    cfg = load(args.config if args.config is not None else source, args.overrides)
    given = (str(args.config) if args.config is not None else "the run's config") + (
        " with --set " + " ".join(args.overrides) if args.overrides else "")
    check_trained(cfg, load(source), given_from=given, trained_from=source, command="verify")
    m = cfg.model
    print(f"verify: config of {source} ({'agreeing with ' + str(args.config) if args.config is not None else 'the run'}"
          f"): model.family {m.family!r}, model.mask {m.mask!r}, chunk {m.chunk_size}, "
          f"{model_config_of(cfg).num_layers} layers, {cfg.data.action_steps} action steps, "
          f"teacher forcing {cfg.objective.teacher_forcing}", file=sys.stderr)
    return cfg, found


def run(args: argparse.Namespace) -> int:
    import os

    import torch
    import torch.distributed as dist

    from flexpack.parallel.parallelize import world
    from flexpack.tools.verify import verify_config

    if args.micro_batches < 1:
        raise ValueError(f"--micro-batches must be >= 1, got {args.micro_batches}")
    if args.tol is not None and not (math.isfinite(args.tol) and args.tol > 0):  # tol <= 0 fails a correct model
        raise ValueError(f"--tol must be a finite number > 0 (a max relative error), got {args.tol!r}")
    if not args.synthetic and (args.synthetic_hw is not None or args.synthetic_text != 16):
        raise ValueError("--synthetic-hw and --synthetic-text shape --synthetic episodes; add --synthetic")
    cfg, checkpoint = trained_config(args)
    started = False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():  # torchrun: FSDP2 as training
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        started = True
    try:
        if args.synthetic:
            from flexpack.run.memory_data import synthetic_run

            run = synthetic_run(cfg, hw=args.synthetic_hw, text_len=args.synthetic_text)
        else:
            from flexpack.run.compose import compose

            run = compose(cfg, "verify")
        report = verify_config(run, micro_batches=args.micro_batches, checkpoint_dir=checkpoint, tol=args.tol,
                               drop_packing=args.drop_packing)
    finally:
        if started:
            dist.destroy_process_group()
    if world()[0] == 0 and int(os.environ.get("RANK", "0")) == 0:
        print(report.table())
    return 0 if report.ok else 1
