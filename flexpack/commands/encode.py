"""``flexpack encode``: fill a LeRobot dataset's latent cache (:func:`flexpack.data.encode.encode_dataset`).

Under ``torchrun --nproc_per_node N -m flexpack.cli encode ...`` each rank encodes its share of the episodes.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from flexpack.errors import UserError, one_line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", type=Path, required=True,
                        help="LeRobot dataset folder, or a repo id (org/name) in lerobot's cache (HF_LEROBOT_HOME)")
    parser.add_argument("--encoder", default="pool",
                        help="'pool' (stand-in) or 'wan-vae:PATH' (local diffusers folder)")
    parser.add_argument("--cameras", nargs="+", default=None,
                        help="camera keys or short names, in width order (default: all)")
    parser.add_argument("--text-encoder", default="hash",
                        help="'hash' / 'hash:DIMxLEN' (stand-in), 'umt5:PATH' (Wan's umT5) "
                             "or 'hf:PATH' (a transformers encoder)")
    parser.add_argument("--text-device", default="cpu", help="device for umt5/hf text encoders (e.g. cuda)")
    parser.add_argument("--text-batch-size", type=int, default=16, help="task strings per text-encoder batch")
    parser.add_argument("--text-max-len", type=int, default=512, help="tokens per task text (Wan: 512)")
    parser.add_argument("--latents-dir", type=Path, default=None, help="cache folder (default DATASET/latents)")
    parser.add_argument("--video-backend", default="pyav", help="lerobot video backend (pyav or torchcodec)")
    parser.add_argument("--device", default="cpu",
                        help="device for the wan-vae encoder (under torchrun 'cuda' = cuda:LOCAL_RANK)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="wan-vae weights and activations (bfloat16: about half the memory and time on a GPU)")
    parser.add_argument("--tiling", action="store_true",
                        help="wan-vae: encode frames over --tile-size px in spatial tiles (memory)")
    parser.add_argument("--tile-size", type=int, default=256,
                        help="wan-vae --tiling: tile edge in pixels (default 256)")
    parser.add_argument("--slicing", action="store_true", help="wan-vae: one camera at a time through the VAE (memory)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (there is none where stderr is not a terminal)")


def _world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) without it."""
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


def run(args: argparse.Namespace) -> int:
    from flexpack.data.encode import encode_dataset

    rank, world_size, local_rank = _world()
    device = f"cuda:{local_rank}" if args.device == "cuda" and world_size > 1 else args.device
    try:
        report = encode_dataset(
            args.dataset, encoder=args.encoder, text_encoder=args.text_encoder, cameras=args.cameras,
            latents_dir=args.latents_dir, video_backend=args.video_backend, device=device,
            progress=not args.no_progress and sys.stderr.isatty(), text_device=args.text_device,
            text_batch_size=args.text_batch_size,
            text_max_len=args.text_max_len, dtype=args.dtype, tiling=args.tiling, slicing=args.slicing,
            tile_size=args.tile_size,
            rank=rank, world_size=world_size,
        )
    except (ValueError, OSError, ImportError) as exc:  # finished episodes stay cached: rerun to resume
        raise UserError(one_line(exc)) from exc
    who = f"rank {rank}/{world_size}: " if world_size > 1 else ""
    print(
        f"{who}encoded {len(report.encoded)} episode(s), skipped {len(report.skipped)} already cached, "
        f"wrote {len(report.texts_written)} task text(s) -> {report.latents_dir} (cameras {report.cameras})"
    )
    if report.stats_file is not None:
        print(f"{who}pooled action/state statistics over all frames -> {report.stats_file}")
    return 0
