"""Wan2.2 VAE encode throughput for ``flexpack encode``: frames per second, fp32 vs bf16, plain and tiled.

Run on the H200 (BENCHMARKS.md records the table and the command):

    python benchmarks/encode.py --out benchmarks/results/encode_h200.json      # full
    python benchmarks/encode.py --smoke                                        # API check, tiny sizes, CPU too

The model is diffusers' ``AutoencoderKLWan`` built from the geometry of Wan2.2-TI2V-5B's ``vae/config.json``
(base_dim 160, decoder 256, z_dim 48, dim_mult 1-2-4-4, 2 res blocks, temporal downsample F-T-T,
12 input channels = RGB patchified 2x2, residual), with random weights: throughput does not depend on
the values, so no download is needed. Each case encodes one camera clip through
:class:`flexpack.data.encoders.WanVAEEncoder`'s own call (uint8 video -> normalized posterior mode), as
``flexpack encode`` does, 33 video frames (9 latent frames) per clip.

Timing: 2 warm-up calls, then >= 5 timed calls between CUDA events; the median is reported as video
frames per second (frames in / seconds), with the peak memory of the case. Cases: 480x640 (a LeRobot
camera, e.g. aloha) and 704x1280 (Wan2.2's own resolution) in fp32 and bf16, and 704x1280 bf16 with
tiling (256 px tiles) and with both cameras of a two-camera clip in one batch (``--slicing`` off / on).
Needs diffusers; not lerobot.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Wan2.2-TI2V-5B vae/config.json geometry (the values that differ from AutoencoderKLWan's defaults,
# plus the ones encode reads); latents_mean/std are placeholders: they do not change the work done.
WAN22_VAE = {
    "base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
    "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0, "in_channels": 12,
    "out_channels": 12, "patch_size": 2, "scale_factor_spatial": 16, "scale_factor_temporal": 4,
    "is_residual": True, "latents_mean": [0.0] * 48, "latents_std": [1.0] * 48,
}
SMOKE_VAE = {**WAN22_VAE, "base_dim": 8, "decoder_base_dim": 8, "z_dim": 4, "num_res_blocks": 1,
             "latents_mean": [0.0] * 4, "latents_std": [1.0] * 4}


def write_vae(folder: Path, config: dict) -> Path:
    """A random-weight AutoencoderKLWan folder (save_pretrained), as WanVAEEncoder loads it."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    AutoencoderKLWan(**config).save_pretrained(folder)
    return folder


def time_case(encoder, videos: list[torch.Tensor], *, warmup: int, iters: int, cuda: bool) -> dict:
    from flexpack.data.encoders import encode_cameras

    cams = [f"cam{i}" for i in range(len(videos))]
    for _ in range(warmup):
        encode_cameras(encoder, videos, cams)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            z = encode_cameras(encoder, videos, cams)
            end.record()
            torch.cuda.synchronize()
            seconds.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            z = encode_cameras(encoder, videos, cams)
            seconds.append(time.perf_counter() - t0)
    frames = sum(v.shape[0] for v in videos)
    median = statistics.median(seconds)
    return {"frames": frames, "latent_shape": list(z.shape), "median_s": median, "frames_per_s": frames / median,
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
            "all_s": [round(s, 5) for s in seconds]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="JSON file to write")
    p.add_argument("--smoke", action="store_true", help="a tiny VAE and small frames (API check, CPU works)")
    p.add_argument("--frames", type=int, default=33, help="video frames per clip (4k+1)")
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args(argv)

    from flexpack.data.encoders import WanVAEEncoder

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if not cuda and not args.smoke:
        raise SystemExit("benchmarks/encode.py measures CUDA throughput; use --smoke on CPU")
    sizes = [(64, 64)] if args.smoke else [(480, 640), (704, 1280)]
    frames = 5 if args.smoke else args.frames
    cases = [(h, w, dt, False, 1, False) for h, w in sizes for dt in ("float32", "bfloat16")]
    big = sizes[-1]
    cases += [(*big, "bfloat16", True, 1, False), (*big, "bfloat16", False, 2, False),
              (*big, "bfloat16", False, 2, True)]
    g = torch.Generator().manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_vae(Path(tmp) / "vae", SMOKE_VAE if args.smoke else WAN22_VAE)
        for h, w, dtype, tiling, cams, slicing in cases:
            enc = WanVAEEncoder(str(folder), device=device, dtype=getattr(torch, dtype), tiling=tiling, slicing=slicing,
                                tile_size=32 if args.smoke else 256)
            videos = [torch.randint(0, 256, (frames, 3, h, w), generator=g, dtype=torch.uint8) for _ in range(cams)]
            r = time_case(enc, videos, warmup=1 if args.smoke else 2, iters=2 if args.smoke else args.iters, cuda=cuda)
            row = {"height": h, "width": w, "dtype": dtype, "tiling": tiling, "cameras": cams, "slicing": slicing, **r}
            rows.append(row)
            mem = f"{row['peak_mem_gb']:.1f} GB" if row["peak_mem_gb"] is not None else "-"
            print(f"{h}x{w} {dtype:<9} tiling={tiling!s:<5} cameras={cams} slicing={slicing!s:<5} "
                  f"{row['frames_per_s']:8.1f} frames/s  "
                  f"({row['median_s'] * 1000:.0f} ms per {row['frames']} frames, peak {mem})",
                  flush=True)
            del enc
            if cuda:
                torch.cuda.empty_cache()
    for h, w in sizes:
        def key(r: dict) -> tuple:
            return r["height"], r["width"], r["dtype"], r["tiling"], r["cameras"]

        f32 = next(r for r in rows if key(r) == (h, w, "float32", False, 1))
        b16 = next(r for r in rows if key(r) == (h, w, "bfloat16", False, 1))
        print(f"{h}x{w}: bf16 / fp32 = {b16['frames_per_s'] / f32['frames_per_s']:.2f}x")
    result = {
        "benchmark": "encode", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "vae": "Wan2.2-TI2V-5B geometry, random weights" if not args.smoke else "tiny (smoke)",
        "frames_per_clip": frames, "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
