"""``flexpack verify CONFIG``: packed == per-episode (:func:`flexpack.tools.verify.verify_config`); exit 1 on a
mismatch."""

from __future__ import annotations

import argparse
import math

from flexpack.commands.common import add_config, add_set, load


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config(parser)
    add_set(parser)
    parser.add_argument("--checkpoint", default=None,
                        help="weights: a checkpoint folder or a run folder (its newest checkpoint); "
                             "default: fresh init")
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
    cfg = load(args.config, args.overrides)
    started = False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():  # torchrun: FSDP2 as training
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        started = True
    try:
        run = None
        if args.synthetic:
            from flexpack.run.memory_data import synthetic_run

            run = synthetic_run(cfg, hw=args.synthetic_hw, text_len=args.synthetic_text)
        report = verify_config(cfg, micro_batches=args.micro_batches, checkpoint_dir=args.checkpoint, tol=args.tol,
                               drop_packing=args.drop_packing, run=run)
    finally:
        if started:
            dist.destroy_process_group()
    if world()[0] == 0 and int(os.environ.get("RANK", "0")) == 0:
        print(report.table())
    return 0 if report.ok else 1
