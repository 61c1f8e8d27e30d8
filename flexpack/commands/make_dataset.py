"""``flexpack make-dataset``: a small synthetic LeRobot dataset
(:func:`flexpack.data.synthetic.make_synthetic_dataset`)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from flexpack.data.synthetic import SCENES, make_synthetic_dataset
from flexpack.errors import UserError, one_line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", type=Path, help="folder to create (must not exist, but see --exist-ok)")
    parser.add_argument("--exist-ok", action="store_true",
                        help="a LeRobot dataset already at ROOT is kept as it is and nothing is written "
                             "(any other folder there is still refused)")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--min-frames", type=int, default=9)
    parser.add_argument("--max-frames", type=int, default=41)
    parser.add_argument("--lengths", type=str, default=None, help="comma-separated video frames per episode")
    parser.add_argument("--cameras", type=int, default=1, choices=(1, 2))
    parser.add_argument("--size", type=int, default=32, help="video height = width in pixels (multiple of 16, >= 32)")
    parser.add_argument("--fps", type=int, default=10)
    parser.add_argument("--action-dim", type=int, default=6)
    parser.add_argument("--index-actions", action="store_true", help="actions encode their own frame index")
    parser.add_argument("--subtasks", type=int, default=0, choices=(0, 2, 3),
                        help="annotate every episode with this many consecutive subtasks (per-frame task)")
    parser.add_argument("--scene", default="wander", choices=SCENES,
                        help="wander: a blob over a gradient, actions independent of it; orbit: a learnable task, "
                             "the actions are the position of a blob circling the frame centre; orbit-speed: the same "
                             "at a speed and direction drawn per episode (a forecast must read the history)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    if args.exist_ok and (args.root / "meta" / "info.json").is_file():  # e.g. `make demo`'s dataset
        print(f"kept {args.root}: it holds a LeRobot dataset already (--exist-ok); nothing written")
        return 0
    try:
        lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else None
    except ValueError:
        raise UserError(f"--lengths {args.lengths!r}: expected comma-separated integers") from None
    # quiet encoders: SVT-AV1 prints ~25 info lines per video, `datasets` a progress bar per episode
    os.environ.setdefault("SVT_LOG", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    # lerobot hands libav's log back to FFmpeg's default printer after each video, which then prints
    # an info line per file ("[mp4 @ 0x…] Starting second pass"); warnings and errors still show
    with contextlib.suppress(ImportError, AttributeError):
        import av.logging

        av.logging.set_libav_level(av.logging.WARNING)
    try:
        root = make_synthetic_dataset(
            args.root, episodes=args.episodes, min_frames=args.min_frames, max_frames=args.max_frames,
            lengths=lengths, cameras=args.cameras, size=args.size, fps=args.fps, action_dim=args.action_dim,
            index_actions=args.index_actions, subtasks=args.subtasks, scene=args.scene, seed=args.seed,
            progress=sys.stderr.isatty(),  # a bar on a terminal; in a log file its updates pile up
        )
    except (ValueError, OSError) as exc:
        raise UserError(one_line(exc)) from exc
    n = len(lengths) if lengths else args.episodes
    sub = f", {args.subtasks} subtasks each" if args.subtasks else ""
    sub += f", {args.scene} scene" if args.scene != "wander" else ""
    print(f"wrote {n} episodes ({args.cameras} camera(s), {args.size}x{args.size}{sub}) to {root}")
    return 0
