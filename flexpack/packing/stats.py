"""``flexpack stats``: waste, shapes and rank balance of a sampler on a list of episode lengths.

Examples::

    flexpack stats --frames-file data/episode_frames_ref.txt --mode pack \\
        --max-tokens 65536 --tokens-per-frame 36 --world-size 8 --json
    flexpack stats --frames-file data/episode_frames_ref.txt --mode pad --batch-size 4 \\
        --pool-factor 50 --pad-multiple 8 --world-size 8 --plot out/stats_pad.png

A frames file lists video frame counts, one per line; ``#`` starts a comment, blank lines are
skipped. Video frames n become latent frames ``latent_frames(n) = (n - 1) // 4 + 1``. Errors in
the input exit with code 2 and a message naming the file and line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from flexpack.atomic import atomic_path
from flexpack.data.lengths import latent_frames  # one definition; that module never imports lerobot at import time
from flexpack.packing.sampler import LengthBucketBatchSampler, SamplerStats, TokenBudgetBatchSampler


def read_frames_file(path: str | os.PathLike[str], stride: int = 4) -> list[int]:
    """Latent frames per episode from a file of video frame counts (see module docstring).

    Raises ``ValueError`` naming the file (and line) when it is unreadable, holds a line that is
    not a positive integer, or holds no episode at all."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read frames file: {e}") from None
    out = []
    for no, line in enumerate(text.splitlines(), 1):
        body = line.split("#", 1)[0].strip()
        if not body:
            continue
        try:
            n = int(body)
        except ValueError:
            raise ValueError(f"{path}:{no}: expected a video frame count (integer), got {body!r}") from None
        if n < 1:
            raise ValueError(f"{path}:{no}: video frame count must be >= 1, got {n}")
        out.append(latent_frames(n, stride))
    if not out:
        raise ValueError(f"{path}: no episode lengths found")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--frames-file", metavar="FILE", help="video frame counts, one per line")
    src.add_argument("--dataset", metavar="ROOT", help="LeRobot dataset root (lengths from its metadata)")
    p.add_argument("--mode", choices=("pad", "pack"), required=True, help="bucket+pad or token-budget packing")
    p.add_argument("--batch-size", type=int, default=4, help="pad mode: episodes per batch (default 4)")
    p.add_argument("--pool-factor", type=int, default=50, help="pad mode: batches per sorted pool (default 50)")
    p.add_argument("--pad-multiple", type=int, default=8, help="pad mode: round padded F up to this (default 8)")
    p.add_argument("--max-tokens", type=int, default=65536, help="pack mode: tokens per micro-batch (default 65536)")
    p.add_argument("--tokens-per-frame", type=int, default=36,
                   help="tokens per latent frame, video + action (default 36)")
    p.add_argument("--crop", action="store_true", help="pack mode: crop episodes longer than the budget")
    p.add_argument("--world-size", type=int, default=1, help="number of ranks (default 1)")
    p.add_argument("--seed", type=int, default=0, help="sampler seed (default 0)")
    p.add_argument("--epoch", type=int, default=0, help="epoch whose batches are measured (default 0)")
    p.add_argument("--stride", type=int, default=4, help="VAE temporal stride for latent frames (default 4)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--plot", metavar="PNG", help="write a length histogram and per-batch fill plot")


def _load_lengths(args: argparse.Namespace) -> list[int]:
    if args.frames_file is not None:
        return read_frames_file(args.frames_file, args.stride)
    try:
        from flexpack.data.lengths import dataset_latent_frames
    except ImportError as e:
        raise ValueError(f"--dataset needs flexpack.data.lengths.dataset_latent_frames, which is not available ({e})")
    try:
        lengths = list(dataset_latent_frames(args.dataset, stride=args.stride))
    except (OSError, KeyError, ImportError) as e:
        raise ValueError(f"{args.dataset}: cannot read episode lengths: {e}") from None
    if not lengths:
        raise ValueError(f"{args.dataset}: the dataset's metadata lists no episodes")
    return lengths


def build_sampler(args: argparse.Namespace, lengths: list[int]) -> LengthBucketBatchSampler | TokenBudgetBatchSampler:
    """Rank 0's sampler for the CLI arguments; its ``stats()`` covers all ranks."""
    common = dict(rank=0, world_size=args.world_size, seed=args.seed, tokens_per_frame=args.tokens_per_frame)
    if args.mode == "pad":
        s: Any = LengthBucketBatchSampler(lengths, args.batch_size, pool_factor=args.pool_factor,
                                          pad_multiple=args.pad_multiple, **common)
    else:
        s = TokenBudgetBatchSampler(lengths, args.max_tokens, crop=args.crop, **common)
    s.set_epoch(args.epoch)
    return s


def _parameters(args: argparse.Namespace) -> dict[str, Any]:
    keys = ["world_size", "seed", "epoch", "tokens_per_frame"]
    keys += ["batch_size", "pool_factor", "pad_multiple"] if args.mode == "pad" else ["max_tokens", "crop"]
    return {k: getattr(args, k) for k in keys}


def summary(args: argparse.Namespace, lengths: list[int], st: SamplerStats, seconds: float) -> dict[str, Any]:
    d = st.to_dict()
    hist: dict[int, int] = {}
    for f in d.pop("padded_frames"):
        hist[f] = hist.get(f, 0) + 1
    fill = d.pop("fill")
    return {"mode": args.mode, "source": args.frames_file or args.dataset, "episodes": len(lengths),
            "parameters": _parameters(args), **d, "shapes": [list(s) for s in st.shapes],
            "min_fill": min(fill), "padded_frames_histogram": {str(k): v for k, v in sorted(hist.items())},
            "plan_seconds": round(seconds, 4)}


def _table(s: dict[str, Any]) -> str:
    rows = [
        ("mode", s["mode"]), ("episodes", s["episodes"]),
        ("parameters", " ".join(f"{k}={v}" for k, v in s["parameters"].items())),
        ("waste", f"{100 * s['waste']:.2f} %  (repeats counted as waste: {100 * s['waste_incl_repeats']:.2f} %)"),
        ("distinct shapes", s["distinct_shapes"]),
        ("micro-batches", f"{s['micro_batches']} ({s['batches_per_rank']} per rank)"),
        ("samples", f"{s['samples']} ({s['repeated_samples']} repeated, {s['dropped_samples']} dropped)"),
        ("rank imbalance", f"{s['rank_imbalance']:.4f}"),
        ("tokens", f"{s['tokens_used']:,} used / {s['tokens_computed']:,} computed"),
    ]
    return "\n".join(f"{k:<16} {v}" for k, v in rows)


def write_plot(path: str, lengths: list[int], st: SamplerStats, title: str) -> None:
    """Length histogram and per-micro-batch fill, written atomically as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.hist(lengths, bins=40, color="tab:blue")
    a.set(xlabel="latent frames F", ylabel="episodes", title=f"{len(lengths)} episodes")
    b.bar(range(len(st.fill)), st.fill, width=1.0, color="tab:green")
    b.set(xlabel="micro-batch (step-major)", ylabel="tokens used / computed", ylim=(0, 1.05),
          title=f"fill, waste {100 * st.waste:.2f} %, {st.distinct_shapes} shape(s)")
    fig.suptitle(title)
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=100)
    finally:
        plt.close(fig)


def run(args: argparse.Namespace) -> int:
    try:
        lengths = _load_lengths(args)
        t0 = time.perf_counter()
        sampler = build_sampler(args, lengths)
        st = sampler.stats(progress=True)
        seconds = time.perf_counter() - t0
    except ValueError as e:
        print(f"flexpack stats: error: {e}", file=sys.stderr)
        return 2
    s = summary(args, lengths, st, seconds)
    if args.plot:
        try:
            write_plot(args.plot, lengths, st, f"flexpack stats --mode {args.mode}")
        except OSError as e:
            print(f"flexpack stats: error: cannot write plot {args.plot}: {e}", file=sys.stderr)
            return 2
    print(json.dumps(s) if args.json else _table(s))
    return 0
