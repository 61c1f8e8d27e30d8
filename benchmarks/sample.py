"""Packed sampling vs one (episode, cut point) at a time: solver throughput on the same model.

The Wan2.2-5B shape at reduced depth (``--layers``, default 4; fp32 weights, bf16 autocast, 48-channel
8x16 latents = 32 video tokens + 4 action tokens per latent frame, 512 text tokens), 64 held-out
episodes × 4 cut points, ``--steps`` Euler steps, ``--horizon`` latent frames predicted per cut:

- **packed**: :class:`flexpack.sampling.solver.PackedSampler` as ``flexpack sample`` runs it — every
  pair one document of 65,536-token packs (the training collate), blocks compiled once
  (``parallelize(compile=True)``, CUDA), one text-key shape for the run;
- **loop**: the same weights sampling each pair alone at its own length (the eager model: a
  compiled one would recompile for every length), on ``--loop-pairs`` pairs spread over the set,
  each length warmed up once before the timed pass.

Both count valid tokens × model calls, so ``packed_vs_loop`` is the speed-up of the same work.
``recompiles_after_warmup``: graphs compiled during the timed packed runs (blocks + attention), after
a warm-up on an eighth of the pairs; it must be 0 across episode lengths. Times are wall seconds
between device syncs around whole runs (a run syncs at its end anyway, to hand results back);
packed: the median of ``--repeats`` runs over all pairs.

    python benchmarks/sample.py --out benchmarks/results/sample_h200.json     # H200: both sets
    python benchmarks/sample.py --tiny                                       # CPU, tiny model: checks the code path

Sets: ``short`` (F 56-146 latent frames, seeded) and ``ref`` (the reference lengths, F 103-362),
64 episodes each, drawn with a fixed seed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexpack.packing.lengths import read_frames_file  # noqa: E402
from flexpack.parallel.parallelize import BLOCK_GRAPHS, ParallelOptions, compiled_graphs, parallelize  # noqa: E402
from flexpack.run.compose import compose  # noqa: E402
from flexpack.run.config import TrainConfig, from_dict  # noqa: E402
from flexpack.run.model import build_model  # noqa: E402
from flexpack.sampling.pairs import cut_points, make_pair  # noqa: E402
from flexpack.sampling.solver import PackedSampler, SampleOptions, pack_text_slots  # noqa: E402

REF = Path(__file__).resolve().parents[1] / "data" / "episode_frames_ref.txt"


def length_sets(tiny: bool, episodes: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(0)
    if tiny:
        return {"short": rng.integers(6, 14, episodes).tolist(), "ref": rng.integers(12, 30, episodes).tolist()}
    ref = read_frames_file(REF)
    return {"short": rng.integers(56, 147, episodes).tolist(),
            "ref": [ref[i] for i in rng.choice(len(ref), episodes, replace=False)]}


def config(args: argparse.Namespace) -> TrainConfig:
    model = {"preset": "tiny", "overrides": {"num_layers": args.layers, "in_channels": 4, "action_channels": 6,
                                             "text_dim": 32}} if args.tiny else \
        {"preset": "wan2.2-5b", "overrides": {"num_layers": args.layers}}
    return from_dict(TrainConfig, {"data": {"mode": "pack", "max_tokens": args.max_tokens, "action_steps": 4},
                                   "model": model, "objective": {"chunk_size": 1},
                                   "runtime": {"dtype": "bfloat16"}, "log": {"progress": False}})


def make_items(lengths: list[int], C: int, H: int, W: int, Ca: int, L: int, Dt: int) -> list[dict]:
    out = []
    for i, F in enumerate(lengths):
        g = torch.Generator().manual_seed(1000 + i)
        out.append({"latent": torch.randn(C, F, H, W, generator=g), "action": torch.rand(Ca, F, 4, generator=g) * 2 - 1,
                    "action_mask": torch.ones(Ca, F, 4, dtype=torch.bool),
                    "text": torch.randn(L, Dt, generator=g) * 0.1, "text_len": L, "episode_index": i})
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def run_set(args, lengths: list[int], device: torch.device) -> dict:
    cfg = config(args)
    C, H, W, L, Dt = (4, 4, 4, 6, 32) if args.tiny else (48, 8, 16, 512, 4096)
    run = compose(cfg, "sample", hw=(H, W), device=device)  # pairs made in memory: latents of this grid
    m, tpf = run.model_config, run.geometry.tokens_per_frame  # patches + action steps, as training counts them
    items = make_items(lengths, C, H, W, m.action_channels, L, Dt)
    specs = [(i, c) for i, F in enumerate(lengths) for c in cut_points(F, args.cuts, args.horizon, 1)]
    fresh = lambda sub: [make_pair(items[i], c, args.horizon) for i, c in sub]  # noqa: E731
    opts = SampleOptions(steps=args.steps, solver="euler", dtype="bfloat16" if device.type == "cuda" else "float32")
    torch.manual_seed(0)
    with device:
        base = build_model(cfg, m).eval()
    compiled = parallelize(base, device=device, options=ParallelOptions(compile=device.type == "cuda"))  # in place
    slots = pack_text_slots(fresh(specs), args.max_tokens, tpf)  # the timed run's, for the warm-up too
    packed = PackedSampler(compiled, run, opts, text_slots=slots)
    # warm-up: the first pack's shape compiles (one shape for all packs), then the timed run of all pairs
    packed.run(fresh(specs[: max(1, len(specs) // 8)]))
    graphs, block_graphs = compiled_graphs(), BLOCK_GRAPHS.n
    if device.type == "cuda":  # any compile after the warm-up names its reason on stderr
        torch._logging.set_logs(recompiles=True)
    rates, times = [], []
    for _ in range(args.repeats):  # the median of whole runs over all pairs
        packed.tokens, packed.forwards = 0, 0
        pairs = fresh(specs)
        times.append(_timed(lambda: packed.run(pairs), device))
        rates.append(packed.tokens / times[-1])
    recompiles = compiled_graphs() - graphs
    block_recompiles = BLOCK_GRAPHS.n - block_graphs  # the rest: attention kernels and block-mask builders
    packed_tps, t_packed = statistics.median(rates), statistics.median(times)

    # the loop: each pair alone, eager blocks (a static-shape compile would recompile per length)
    with device:
        eager = build_model(cfg, m).eval()
    eager.load_state_dict(base.state_dict())
    sub = specs[:: max(1, len(specs) // args.loop_pairs)][: args.loop_pairs]
    for spec in sub:  # warm-up at every length timed (allocator, attention kernels compiled per shape)
        p = fresh([spec])
        PackedSampler(eager, run, opts, max_tokens=p[0].frames * tpf).run(p)
    tokens, t_loop = 0, 0.0
    for spec in sub:
        p = fresh([spec])
        s = PackedSampler(eager, run, opts, max_tokens=p[0].frames * tpf)
        t_loop += _timed(lambda: s.run(p), device)
        tokens += s.tokens
    loop_tps = tokens / t_loop
    return {"packed_tokens_per_s": packed_tps, "loop_tokens_per_s": loop_tps, "packed_vs_loop": packed_tps / loop_tps,
            "recompiles_after_warmup": recompiles, "block_recompiles_after_warmup": block_recompiles,
            "pairs": len(specs), "episodes": len(lengths),
            "frames": [min(lengths), max(lengths)], "packed_model_calls": packed.forwards, "packed_s": t_packed,
            "packed_runs": args.repeats, "loop_pairs_timed": len(sub), "loop_s": t_loop, "steps": args.steps,
            "horizon": args.horizon,
            "tokens_per_frame": tpf, "max_tokens": args.max_tokens,
            "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sets", default="short,ref")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--cuts", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--horizon", type=int, default=8, help="latent frames predicted per cut point")
    p.add_argument("--max-tokens", type=int, default=65536)
    p.add_argument("--loop-pairs", type=int, default=32, help="pairs timed one at a time (a rate: a subset suffices)")
    p.add_argument("--repeats", type=int, default=3, help="timed packed runs (the median is reported)")
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU: checks the code path, times nothing real")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/sample_h200.json"))
    args = p.parse_args()
    if args.tiny:
        args.layers, args.max_tokens, args.episodes, args.steps, args.horizon, args.loop_pairs = 2, 400, 8, 2, 2, 4
        args.repeats = 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results.update(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   date=time.strftime("%Y-%m-%d"), torch=torch.__version__, layers=args.layers,
                   command=" ".join(sys.argv))
    sets = length_sets(args.tiny, args.episodes)
    for name in args.sets.split(","):
        r = results[name] = {**run_set(args, sets[name], device), "command": " ".join(sys.argv)}
        print(f"{name}: packed {r['packed_tokens_per_s']:.0f} tok/s, loop {r['loop_tokens_per_s']:.0f} tok/s, "
              f"x{r['packed_vs_loop']:.2f}, recompiles after warm-up {r['recompiles_after_warmup']}", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        # after every set: a cut-short run keeps what it measured
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
