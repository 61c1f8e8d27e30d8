"""Block-mask build time at the 74,880-token budget: FlexAttnFunc.prepare per mask and pack, side by side.

Run on the H200 (see BENCHMARKS.md):

    python benchmarks/blockmask_build.py --out $OUT/blockmask_build_h200.json

For each case (document mask for packs of 1, 4, 6, 8 episodes; chunk-causal, 8 episodes;
teacher forcing, 2-6 episodes x 2 copies, chunk 4) and each variant of the compiled builder
(``graphs``: replayed CUDA graph, the default; ``launches``: the compiled kernels launched one by
one) the builder is warmed up, then all cases and variants are timed in interleaved rounds (wall
clock of a synchronized ``prepare``, the way a training step pays for it), so that drift hits
every one alike. Reported per case and variant: the median over all timed calls, the 90th
percentile, the minimum, kernel launches per build and GPU kernel time per build (torch.profiler).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.attention import draw_pack, load_latent_frames  # noqa: E402
from flexpack.attention.flex import FlexAttnFunc  # noqa: E402
from flexpack.packing.layout import SequenceLayout  # noqa: E402

TPF_VIDEO, TPF_ACTION = 32, 4


def cases(frames: list[int], cap: int, rng: random.Random) -> list[tuple[str, object, str, dict]]:
    out = []
    for n in (1, 4, 6, 8):
        lay = SequenceLayout.from_rows([draw_pack(rng, frames, n, cap)], cap).tokens(TPF_VIDEO, TPF_ACTION).to("cuda")
        out.append((f"document_{n}", lay, "document", {}))
    out.append(("chunk_causal_8", out[-1][1], "chunk_causal", {"chunk_size": 4}))
    for n in (2, 4, 6):
        lay = SequenceLayout.from_rows([draw_pack(rng, frames, n, cap // 2)], cap // 2).tokens(TPF_VIDEO, TPF_ACTION, copies=2).to("cuda")
        out.append((f"teacher_forcing_{n}", lay, "teacher_forcing", {"chunk_size": 4}))
    return out


def profile_build(attn: FlexAttnFunc, lay, kind: str, kw: dict, n: int = 10) -> tuple[float, float]:
    """(kernel launches, GPU kernel milliseconds) per build, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            attn.prepare(lay, kind, **kw)
        torch.cuda.synchronize()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch"))
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return launches / n, gpu_us / 1e3 / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frames-file", default="data/episode_frames_ref.txt")
    ap.add_argument("--cap-frames", type=int, default=2080)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--runs", type=int, default=10, help="timed calls per case, variant and round")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "blockmask_build_h200.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/blockmask_build.py needs CUDA")
    rng = random.Random(0)
    todo = cases(load_latent_frames(Path(args.frames_file)), args.cap_frames, rng)
    variants = {"graphs": FlexAttnFunc("flex"), "launches": FlexAttnFunc("flex", graph_block_mask=False)}
    for attn in variants.values():
        for _, lay, kind, kw in todo:  # compile (and capture) every signature first
            for _ in range(3):
                attn.prepare(lay, kind, **kw)
    torch.cuda.synchronize()
    times: dict[tuple[str, str], list[float]] = {(name, v): [] for name, *_ in todo for v in variants}
    for _ in range(args.rounds):
        for name, lay, kind, kw in todo:
            for v, attn in variants.items():
                for _ in range(args.runs):
                    t = time.perf_counter()
                    attn.prepare(lay, kind, **kw)
                    torch.cuda.synchronize()
                    times[(name, v)].append((time.perf_counter() - t) * 1e3)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": todo[0][1].num_tokens,
              "rounds": args.rounds, "runs": args.runs, "cases": {}}
    for name, lay, kind, kw in todo:
        result["cases"][name] = {"segment_bounds": list(variants["graphs"].prepare(lay, kind, **kw).segment_bounds())}
        for v, attn in variants.items():
            ts = sorted(times[(name, v)])
            launches, gpu_ms = profile_build(attn, lay, kind, kw)
            row = {"median_ms": statistics.median(ts), "p90_ms": ts[int(0.9 * (len(ts) - 1))], "min_ms": ts[0],
                   "max_ms": ts[-1], "launches": launches, "gpu_kernel_ms": gpu_ms}
            result["cases"][name][v] = row
            print(f"{name:<20} {v:<9} median {row['median_ms']:.3f} ms  p90 {row['p90_ms']:.3f}  min {row['min_ms']:.3f}"
                  f"  max {row['max_ms']:.3f}  launches {launches:.0f}  GPU {gpu_ms:.3f} ms")
        c = result["cases"][name]
        c["ratio_median_launches_over_graphs"] = c["launches"]["median_ms"] / c["graphs"]["median_ms"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
