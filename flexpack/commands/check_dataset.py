"""``flexpack check-dataset``: every problem of a dataset and its latent cache
(:func:`flexpack.data.check.check_dataset`), then the normalization bounds; exit 1 on any problem."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from flexpack.errors import UserError, one_line

if TYPE_CHECKING:
    from flexpack.data.episodes import EpisodeSource


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", type=Path, help="LeRobot dataset folder, or a repo id (org/name) in lerobot's cache")
    parser.add_argument("--latents-dir", type=Path, default=None, help="cache folder (default ROOT/latents)")
    parser.add_argument("--cameras", nargs="+", default=None, help="camera set of the cache (default: all)")
    parser.add_argument("--stride", type=int, default=4, help="the VAE's temporal stride")
    parser.add_argument("--action-key", default="action")
    parser.add_argument("--action-stats", choices=("pooled", "lerobot"), default="pooled",
                        help="statistics training normalizes with (data.action_stats); warnings are for these")
    parser.add_argument("--clip-warn", type=float, default=0.05,
                        help="warn when more than this share of a dimension's frames is clipped to ±1 (default 0.05)")
    from flexpack.commands import check_bundle

    check_bundle.add_arguments(parser)


def _print_bounds(source: EpisodeSource, args: argparse.Namespace) -> None:
    """Per action/state dimension: the clipped share and degenerate widths (warnings, no exit 1)."""
    from flexpack.data import cache, stats_report

    latents = args.latents_dir or cache.default_latents_dir(source.root)
    try:
        rows = stats_report.report(source, latents, args.action_stats)
    except ValueError as exc:  # unreadable data files are listed as problems already
        print(f"warning: no normalization report: {one_line(exc)}")
        return
    table, warnings = stats_report.lines(rows, args.action_stats, args.clip_warn)
    from flexpack.data import action_stats

    try:
        stored = action_stats.current(action_stats.read(latents), source)
    except ValueError:
        stored = False
    if not stored:
        table.insert(0, f"note: {action_stats.stats_path(latents)} is missing or stale; the pooled statistics below "
                        "were computed now (flexpack encode stores them)")
    print("\n".join(table + warnings))


def run(args: argparse.Namespace) -> int:
    from flexpack.data import cache
    from flexpack.data.check import check_dataset
    from flexpack.data.formats import BUNDLE, detect

    if detect(args.root, args.format) == BUNDLE:
        from flexpack.commands import check_bundle

        return check_bundle.run(args)
    if args.dump_item:
        raise UserError("--dump-item takes a lingbot-bundle root (DATASET:EPISODE:SEGMENT); "
                        f"{args.root} is a LeRobot v3 dataset")

    try:
        problems, source = check_dataset(
            args.root, latents_dir=args.latents_dir, cameras=args.cameras, stride=args.stride,
            action_key=args.action_key, action_stats=args.action_stats, progress=sys.stderr.isatty(),
        )
    except FileNotFoundError as exc:
        print(f"[missing] dataset: {exc}")
        return 1
    except ValueError as exc:  # not a dataset this can check (no episodes, bad metadata, bad arguments)
        raise UserError(one_line(exc)) from exc
    for p in problems:
        print(p)
    if not any(p.kind == "nonfinite" for p in problems):  # statistics over NaN mean nothing
        _print_bounds(source, args)
    if problems:
        episodes = {p.episode for p in problems if p.episode is not None}
        print(f"{len(problems)} problem(s) in {len(episodes)} episode(s) of {len(source.episodes)}")
        return 1
    print(f"ok: {len(source.episodes)} episodes, {len(source.tasks())} tasks, "
          f"cameras {source.video_keys if not args.cameras else args.cameras}, "
          f"latents {args.latents_dir or cache.default_latents_dir(source.root)}")
    return 0
