"""``flexpack plot RUN``: a PNG of a run's metrics (:func:`flexpack.training.observe.plot.plot_metrics`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", type=Path, help="run folder (runtime.out_dir) or a metrics.jsonl file")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default RUN/metrics.png)")


def run(args: argparse.Namespace) -> int:
    from flexpack.training.observe.plot import plot_metrics

    try:
        out = plot_metrics(args.run, args.out)
    except ValueError as exc:
        print(f"flexpack plot: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
