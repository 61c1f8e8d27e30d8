"""Block-mask build time at the 74,880-token budget: FlexAttnFunc.prepare per mask and pack, side by side.

Run on the H200 (see BENCHMARKS.md):

    python benchmarks/blockmask_build.py --out $OUT/blockmask_build_h200.json

For each case (document mask for packs of 1, 4, 6, 8 episodes; chunk-causal, 8 episodes;
teacher forcing, 2-6 episodes x 2 copies, chunk 4) and each variant of the compiled builder
(``graphs``: replayed CUDA graph, the default; ``launches``: the compiled kernels launched one by
one; ``fixed``: graphs on the fixed segment grid of the pack's shape, as WanVA builds its masks, one cell per
frame instead of the power of two above the segment count) the builder is warmed up, then all cases and
variants are timed in interleaved rounds (wall
clock of a synchronized ``prepare``, the way a training step pays for it), so that drift hits
every one alike. Reported per case and variant: the median over all timed calls, the 90th
percentile, the minimum and maximum, kernel launches per build and GPU kernel time per build
(torch.profiler); and per variant the worst case (``worst``: the case with the highest median, the
highest p90 and the single slowest call). An eager fallback of the compiled builder (a warning)
is an error here: every case must run compiled. ``--cases`` and ``--variants`` pick a subset:

    python benchmarks/blockmask_build.py --cases document_8,teacher_forcing_4,text_8 --variants graphs,fixed
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import warnings
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
        half = SequenceLayout.from_rows([draw_pack(rng, frames, n, cap // 2)], cap // 2)
        lay = half.tokens(TPF_VIDEO, TPF_ACTION, copies=2).to("cuda")
        out.append((f"teacher_forcing_{n}", lay, "teacher_forcing", {"chunk_size": 4}))
    # drawn last: the earlier cases keep the packs of earlier measurements
    lens = draw_pack(rng, frames, 8, cap)  # cross-attention: 512 text keys per slot, some of them padding
    lay = SequenceLayout.from_rows([lens], cap,
                                   text_len=[rng.randint(64, 512) for _ in lens]).tokens(TPF_VIDEO, TPF_ACTION)
    out.append(("text_8", lay.to("cuda"), "text", {"text_tokens": 512, "text_slots": 8}))
    return out


def profile_build(attn: FlexAttnFunc, lay, kind: str, kw: dict, n: int = 10) -> tuple[float, float]:
    """(kernel launches, GPU kernel milliseconds) per build, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            attn.prepare(lay, kind, **kw)
        torch.cuda.synchronize()
    events = prof.key_averages()
    launch_keys = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
    launches = sum(e.count for e in events if e.key in launch_keys)
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return launches / n, gpu_us / 1e3 / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frames-file", default="data/episode_frames_ref.txt")
    ap.add_argument("--cap-frames", type=int, default=2080)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--runs", type=int, default=10, help="timed calls per case, variant and round")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--variants", default="graphs,launches", help="comma-separated: graphs, launches, fixed")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "blockmask_build_h200.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/blockmask_build.py needs CUDA")
    rng = random.Random(0)
    todo = cases(load_latent_frames(Path(args.frames_file)), args.cap_frames, rng)
    if args.cases:
        wanted = args.cases.split(",")
        unknown = sorted(set(wanted) - {name for name, *_ in todo})
        if unknown:
            ap.error(f"--cases: unknown {unknown}; cases: {', '.join(name for name, *_ in todo)}")
        todo = [c for c in todo if c[0] in wanted]
    every = {"graphs": lambda: FlexAttnFunc("flex"), "launches": lambda: FlexAttnFunc("flex", graph_block_mask=False),
             "fixed": lambda: FlexAttnFunc("flex", fixed_segments=True)}
    bad = sorted(set(args.variants.split(",")) - set(every))
    if bad:
        ap.error(f"--variants: unknown {bad}; use {', '.join(every)}")
    variants = {v: every[v]() for v in args.variants.split(",")}
    # a shape that does not compile would be timed eagerly: fail instead
    warnings.filterwarnings(
        "error", message=r".*(building eagerly|capturing the block-mask build as a CUDA graph failed).*")
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
        result["cases"][name] = {f"segment_bounds_{v}": list(a.prepare(lay, kind, **kw).segment_bounds())
                                 for v, a in variants.items()}
        for v, attn in variants.items():
            ts = sorted(times[(name, v)])
            launches, gpu_ms = profile_build(attn, lay, kind, kw)
            row = {"median_ms": statistics.median(ts), "p90_ms": ts[int(0.9 * (len(ts) - 1))], "min_ms": ts[0],
                   "max_ms": ts[-1], "launches": launches, "gpu_kernel_ms": gpu_ms}
            result["cases"][name][v] = row
            print(f"{name:<20} {v:<9} median {row['median_ms']:.3f} ms  p90 {row['p90_ms']:.3f}"
                  f"  min {row['min_ms']:.3f}  max {row['max_ms']:.3f}  launches {launches:.0f}  GPU {gpu_ms:.3f} ms")
        c = result["cases"][name]
        for v in ("launches", "fixed"):
            if v in c and "graphs" in c:
                c[f"ratio_median_{v}_over_graphs"] = c[v]["median_ms"] / c["graphs"]["median_ms"]
    result["worst"] = {}
    for v in variants:
        rows = {name: result["cases"][name][v] for name, *_ in todo}
        result["worst"][v] = {key: {"case": max(rows, key=lambda n: rows[n][key]),
                                    "ms": max(r[key] for r in rows.values())}
                              for key in ("median_ms", "p90_ms", "max_ms")}
        w = result["worst"][v]
        print(f"worst ({v}): median {w['median_ms']['ms']:.3f} ms ({w['median_ms']['case']}), "
              f"p90 {w['p90_ms']['ms']:.3f} ms ({w['p90_ms']['case']}), "
              f"slowest call {w['max_ms']['ms']:.3f} ms ({w['max_ms']['case']})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
