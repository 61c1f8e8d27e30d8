"""``flexpack stats``: waste, shapes and rank balance of a sampler on a list of episode lengths.

Examples::

    flexpack stats --frames-file data/episode_frames_ref.txt --mode pack \\
        --max-tokens 65536 --tokens-per-frame 36 --world-size 8 --json
    flexpack stats --frames-file data/episode_frames_ref.txt --mode pad --batch-size 4 \\
        --pool-factor 50 --pad-multiple 8 --world-size 8 --plot out/stats_pad.png

A frames file lists video frame counts, one per line; ``#`` starts a comment, blank lines are
skipped. Video frames n become latent frames ``latent_frames(n) = (n - 1) // 4 + 1``. Errors in
the input exit with code 2 and a message naming the file and line.

With ``--dataset`` the token geometry comes from the dataset as ``flexpack train`` derives it:
tokens per latent frame = (h / patch) · (w / patch) of the cached latents (several cameras joined
along width) + ``--action-steps``; ``--tokens-per-frame`` overrides it. Without a latent cache,
``--tokens-per-frame`` is needed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from flexpack.errors import UserError, one_line
from flexpack.packing.batch_sampler import LengthBucketBatchSampler, TokenBudgetBatchSampler
from flexpack.packing.lengths import read_frames_file
from flexpack.packing.stats import summary, table, write_plot


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--frames-file", metavar="FILE", help="video frame counts, one per line")
    src.add_argument("--dataset", metavar="ROOT",
                     help="LeRobot dataset folder or repo id in lerobot's cache (lengths from its metadata), or an "
                          "upstream LingBot-VA bundle root (lengths from its latent files; a row per dataset)")
    p.add_argument("--mode", choices=("pad", "pack"), required=True, help="bucket+pad or token-budget packing")
    p.add_argument("--batch-size", type=int, default=4, help="pad mode: episodes per batch (default 4)")
    p.add_argument("--pool-factor", type=int, default=50, help="pad mode: batches per sorted pool (default 50)")
    p.add_argument("--pad-multiple", type=int, default=8, help="pad mode: round padded F up to this (default 8)")
    p.add_argument("--max-tokens", type=int, default=65536, help="pack mode: tokens per micro-batch (default 65536)")
    p.add_argument("--tokens-per-frame", type=int, default=None,
                   help="tokens per latent frame, video + action (default: from --dataset's latent cache, else 36)")
    p.add_argument("--patch", type=int, default=2, help="--dataset: the model's spatial patch size (Wan: 2)")
    p.add_argument("--action-steps", type=int, default=4, help="--dataset: action tokens per latent frame (0: none)")
    p.add_argument("--latents-dir", default=None, help="--dataset: the latent cache (default ROOT/latents)")
    p.add_argument("--cameras", nargs="+", default=None,
                   help="--dataset: the cached camera set (needed only where the cache holds several)")
    p.add_argument("--crop", action="store_true", help="pack mode: crop episodes longer than the budget")
    p.add_argument("--world-size", type=int, default=1, help="number of ranks (default 1)")
    p.add_argument("--seed", type=int, default=0, help="sampler seed (default 0)")
    p.add_argument("--epoch", type=int, default=0, help="epoch whose batches are measured (default 0)")
    p.add_argument("--stride", type=int, default=4, help="VAE temporal stride for latent frames (default 4)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--plot", metavar="PNG", help="write a length histogram and per-batch fill plot")


def _bundle(args: argparse.Namespace) -> Any:
    """The upstream bundle ``--dataset`` names (items from the latent files' headers), or None."""
    if args.dataset is None:
        return None
    from flexpack.data.formats import BUNDLE, detect

    if detect(args.dataset) != BUNDLE:
        return None
    if getattr(args, "_bundle", None) is None:
        from flexpack.data.bundle import BundleDataset

        args._bundle = BundleDataset(args.dataset, cameras=args.cameras, normalize=False, cfg_prob=0.0,
                                     missing="skip", progress=sys.stderr.isatty())
    return args._bundle


def per_dataset_shares(bundle: Any, sampler: Any) -> dict[str, dict[str, float]]:
    """Per dataset of a bundle: its segments and its share of the epoch's packed tokens."""
    names = [bundle.names[it.dataset] for it in bundle.items]
    tokens: dict[str, float] = {n: 0.0 for n in bundle.names}
    segments: dict[str, int] = {n: 0 for n in bundle.names}
    for n in names:
        segments[n] += 1
    lengths = bundle.lengths()
    for rank in sampler._plan():
        for batch in rank:
            for i in batch:
                tokens[names[i]] += lengths[i]
    total = sum(tokens.values()) or 1.0
    return {n: {"segments": segments[n], "token_share": tokens[n] / total} for n in bundle.names}


def _load_lengths(args: argparse.Namespace) -> list[int]:
    if args.frames_file is not None:
        return read_frames_file(args.frames_file, args.stride)
    if _bundle(args) is not None:
        return _bundle(args).lengths()
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


def dataset_tokens_per_frame(root: str, *, patch: int, action_steps: int, latents_dir: str | None = None,
                             cameras: list[str] | None = None) -> tuple[int, str]:
    """Tokens per latent frame of a dataset's latent cache, as ``train`` derives them, and how."""
    from flexpack.data import cache
    from flexpack.data.hub import resolve_root

    base = resolve_root(root)
    video = (cache.default_latents_dir(base) if latents_dir is None else Path(latents_dir)) / "video"
    sets = sorted(p.name for p in video.iterdir() if p.is_dir()) if video.is_dir() else []
    if cameras:
        sets = [cache.camera_tag(cameras)] if cache.camera_tag(cameras) in sets else []
    elif len(sets) > 1:
        raise ValueError(f"{video}: the cache holds camera sets {sets}; pass --cameras to choose one")
    files = sorted((video / sets[0]).glob("episode_*.safetensors")) if sets else []
    if not files:
        raise ValueError(f"{video}: no latent cache to derive the tokens per frame from; run flexpack encode "
                         "--dataset first or pass --tokens-per-frame")
    head = cache.read_latent_header(files[0])
    if head.height % patch or head.width % patch:
        raise ValueError(f"{files[0]}: latent {head.height}x{head.width} is not divisible by --patch {patch}")
    tpf = (head.height // patch) * (head.width // patch) + action_steps
    how = (f"{tpf} tokens per frame from {files[0].parent}: latent {head.height}x{head.width} / patch {patch} "
           f"+ {action_steps} action steps")
    return tpf, how


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


def _geometry(args: argparse.Namespace) -> None:
    """Fill ``args.tokens_per_frame`` where not given: from the dataset's cache, else 36."""
    if args.tokens_per_frame is not None:
        return
    if args.dataset is None:
        args.tokens_per_frame = 36  # the reference geometry: 32 video + 4 action tokens per latent frame
        return
    bundle = _bundle(args)
    if bundle is not None:  # the composed grid of the bundle's cameras (the largest), the steps its frame_ids give
        h, w = _run_grid(bundle)
        steps = bundle.items[0].ids.steps if args.action_steps else 0
        args.tokens_per_frame = (h // args.patch) * (w // args.patch) + steps
        print(f"{args.tokens_per_frame} tokens per frame from {bundle.root}: composed latent {h}x{w} "
              f"({bundle.items[0].layout}) / patch {args.patch} + {steps} action steps", file=sys.stderr)
        return
    args.tokens_per_frame, how = dataset_tokens_per_frame(args.dataset, patch=args.patch,
                                                          action_steps=args.action_steps,
                                                          latents_dir=args.latents_dir, cameras=args.cameras)
    print(how, file=sys.stderr)  # stdout stays the table or the JSON object


def _run_grid(bundle: Any) -> tuple[int, int]:
    """The grid a run over ``bundle`` packs on: the largest composed (H, W) of its items."""
    grids = bundle.item_grids()
    return max(h for h, _ in grids), max(w for _, w in grids)


def _cli_words(message: str) -> str:
    """The sampler's keyword names as this command's flags."""
    for word, flag in (("pass crop=True", "pass --crop"), ("max_tokens=", "--max-tokens "),
                       ("raise max_tokens", "raise --max-tokens")):
        message = message.replace(word, flag)
    return message


def run(args: argparse.Namespace) -> int:
    try:
        lengths = _load_lengths(args)
        _geometry(args)
        t0 = time.perf_counter()
        sampler = build_sampler(args, lengths)
        st = sampler.stats(progress=True)
        seconds = time.perf_counter() - t0
    except ValueError as e:  # the frames file, the dataset or the sampler's arguments
        raise UserError(_cli_words(one_line(e))) from e
    s = summary(lengths, st, mode=args.mode, source=args.frames_file or args.dataset, parameters=_parameters(args),
                seconds=seconds)
    if args.plot:
        try:
            write_plot(args.plot, lengths, st, f"flexpack stats --mode {args.mode}")
        except OSError as e:
            raise UserError(f"cannot write plot {args.plot}: {e}") from e
    bundle = _bundle(args)
    if bundle is not None:
        s["datasets"] = per_dataset_shares(bundle, sampler)
        if len(set(grids := bundle.item_grids())) > 1:  # smaller grids pad to the largest: their share of it
            from flexpack.packing.grids import padding_share  # torch: not for --help

            s["grid_padding"] = padding_share(lengths, grids, _run_grid(bundle))
    print(json.dumps(s) if args.json else table(s))
    if bundle is not None and not args.json:
        print(f"{'dataset':<32} {'segments':>8} {'token share':>11}")
        for name, row in s["datasets"].items():
            print(f"{name:<32} {row['segments']:>8} {row['token_share']:>11.1%}")
    return 0
