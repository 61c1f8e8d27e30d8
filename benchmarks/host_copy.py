"""What moving a block's activations to the host and back would cost: pinned host <-> GPU copy bandwidth.

Activation offload keeps a checkpointed block's activations on the host instead of recomputing its forward in the
backward; it pays where a block's activations travel both ways faster than the block's forward runs (or hide behind
other blocks' compute). This times ``non_blocking`` copies of ``--gb`` GB between pinned host memory and the GPU
(CUDA events, median of ``--repeat``), one direction at a time and both at once on two streams, and writes the
bandwidths and, for the activations of one LingBot-VA-5B block at ``--tokens`` computed tokens
(:func:`flexpack.run.memory_plan.estimate`'s per-token bytes, float8), the seconds of one round trip.

    python benchmarks/host_copy.py --out benchmarks/results/host_copy_h200.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def timed(fn, repeat: int) -> float:
    """Median seconds of ``fn`` between CUDA events, after one warm-up call (``attention.bench``)."""
    from attention import bench

    return bench(fn, repeat, warmup=1) / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=2.0)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--tokens", type=int, default=65_536, help="computed tokens of one micro-batch (both copies)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    from flexpack.run import memory_plan as mp

    n = int(args.gb * 1e9) // 2
    dev = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    host = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    host2 = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    dev2 = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()

    def both() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            host2.copy_(dev2, non_blocking=True)
        dev.copy_(host, non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)

    gb = n * 2 / 1e9
    d2h = gb / timed(lambda: host.copy_(dev, non_blocking=True), args.repeat)
    h2d = gb / timed(lambda: dev.copy_(host, non_blocking=True), args.repeat)
    duplex = 2 * gb / timed(both, args.repeat)
    shape = mp.Shape(params=5_088_872_670, trained=5_088_872_670, frozen_bytes=4, layers=30, dim=3072,
                     ffn_dim=14336, tokens=args.tokens, act_bytes=2, float8=True, tokens_per_step=args.tokens)
    none = mp.estimate(shape, mp.Choice(0, "float32", "none")).parts["activations"]
    block_gb = none / shape.layers  # one block's activations, not checkpointed (the planner's per-token cost)
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "copy_gb": gb, "d2h_gb_per_s": d2h, "h2d_gb_per_s": h2d, "both_ways_gb_per_s": duplex,
           "tokens": args.tokens, "block_activations_gb": block_gb,
           "block_round_trip_s": block_gb / d2h + block_gb / h2d}
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
