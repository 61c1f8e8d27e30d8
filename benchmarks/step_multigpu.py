r"""Training steps under FSDP2 on several GPUs: one global batch of episodes per optimizer step, batch 1 or packed.

Run under ``torchrun`` (any ``--nproc_per_node``, 1 included; plain ``python`` is one rank). Every optimizer step
trains the same global batch of ``--global-episodes`` episodes (default 128) of the reference lengths
(``train_step.py``'s length sets), spread over the ranks in one of two ways:

- ``batch1``: one episode per micro-step (pad mode, ``data.batch_size = 1``, frames padded up to
  ``--pad-multiple``, blocks compiled: one graph per padded length), ``global / N`` micro-steps a step on each
  rank (16 on 8 GPUs), gradients reduced once a step;
- ``packed``: the step's episodes packed into micro-batches of ``--max-tokens`` tokens
  (:func:`flexpack.packing.bins.pack_bins`; a bin count that is no multiple of N gets tail-padding bins of repeated
  episodes, as the sampler does), about 4 micro-steps a step.

Micro-batches are dealt to ranks heaviest first in snake order (by :func:`~flexpack.packing.batch_sampler.batch_cost`),
so every rank runs the same number of micro-steps with similar work. The model is built as ``flexpack train``
builds it (``Run.build_model``: float8 → compile → activation checkpointing → ``fully_shard`` per block), the step
is ``train_step`` (accumulation with one gradient reduction a step, clip, AdamW). ``--family lingbot`` is
LingBot-VA-5B (``lingbot_va.py``'s episodes: 32 video + 4 action tokens a frame, 30 action channels),
``--family wan`` the Wan2.2-5B shape of WanVA (``train_step.py``'s: 32 video tokens a frame, no actions).

Recorded per run (``runs`` in the JSON, keyed ``FAMILY-VARIANT-PRECISION-wN-gG``): the median step time after the
warm-up (per step the slowest rank's, from CUDA events), useful tokens/s per GPU (every episode of the global
batch counted once, repeats not), MFU (useful FLOPs of every rank, ``UsefulFlops``, over N times the bf16 peak
measured on each GPU), the communication share (NCCL kernels' share of the GPU kernel time in a
``torch.profiler`` window of ``--profile-steps`` steps; on the CPU the gloo collectives' share of the window's
wall time, named ``comm_kind``), recompiles after the warm-up, peak memory (the largest rank's), and the rank
imbalance: max / mean over ranks of the time each spends outside collectives in the profiled steps (its wall
time per step, ``rank_wall_imbalance``, is also kept; collectives make those nearly equal). ``weak_scaling``:
tokens/s per GPU of each run over the 1-GPU run with as many episodes per GPU (``--episodes-per-gpu`` keeps the
per-GPU batch fixed at every N).

    torchrun --nproc_per_node 8 benchmarks/step_multigpu.py --family lingbot --layers 30 \
        --activation-checkpointing true --variants batch1,packed --float8 off,tensorwise
    torchrun --nproc_per_node 2 benchmarks/step_multigpu.py --smoke       # tiny model, CPU, gloo: the code paths

``benchmarks/multigpu_h200.sh N`` runs the whole set. Float8 needs torchao and an sm89+ GPU (``--smoke`` emulates
it on the CPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from flexpack.packing.batch_sampler import batch_cost  # noqa: E402
from flexpack.packing.bins import pack_bins  # noqa: E402
from flexpack.parallel import float8  # noqa: E402
from flexpack.parallel.parallelize import compiled_graphs  # noqa: E402
from flexpack.run.compose import run_for  # noqa: E402
from flexpack.training.observe.flops import UsefulFlops, measured_bf16_peak  # noqa: E402
from flexpack.training.optim import build_optimizer  # noqa: E402
from flexpack.training.step import train_step  # noqa: E402
from train_step import SETS, Items, _event_times, _sync, length_sets, parse_ac  # noqa: E402

VARIANTS = ("batch1", "packed")
KEYS = ("step_s", "tokens_per_s_per_gpu", "mfu", "comm_share", "recompiles_after_warmup", "peak_mem_gb",
        "rank_imbalance")  # what every run records (tests/test_step_multigpu.py checks them)


def setup_dist(smoke: bool) -> tuple[int, int, torch.device]:
    """(rank, world size, device): a process group under torchrun (NCCL on GPUs, gloo on the CPU), one GPU a rank."""
    cuda = torch.cuda.is_available() and not smoke
    if "RANK" in os.environ and not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return rank, size, torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def gather(value):
    """``value`` of every rank, in rank order (a list of one without a process group)."""
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def family_setup(args: argparse.Namespace, lengths: list[int]):
    """(items, config(mode, float8)) of ``--family``: the episodes and configs of ``train_step.py`` (wan) or
    ``lingbot_va.py`` (lingbot), with this script's mode, pad multiple and compile setting."""
    ns = argparse.Namespace(layers=args.layers, action_channels=0, smoke=args.smoke, max_tokens=args.max_tokens,
                            pad_batch=1, activation_checkpointing=args.activation_checkpointing, memory_budget=1.0)
    if args.family == "lingbot":
        import lingbot_va

        items = lingbot_va.LingbotItems(lengths, *lingbot_va.shape(args.smoke), Ca=30, A=lingbot_va.ACTION_STEPS)

        def base(float8: str):
            return lingbot_va.config(ns, float8)
    else:
        import train_step

        C, H, W, L, Dt = (4, 4, 4, 6, 32) if args.smoke else (48, 8, 16, 512, 4096)
        items = Items(lengths, C, H, W, L, Dt)

        def base(float8: str):
            return train_step.config(ns, "pack", True, float8)

    def config(mode: str, float8: str):
        cfg = base(float8)
        data = replace(cfg.data, mode=mode, batch_size=1, pad_multiple=args.pad_multiple)
        return replace(cfg, data=data, parallel=replace(cfg.parallel, compile=args.compile))
    return items, config


def deal(micro: list[list[int]], sizes: list[int], computed: int, world: int) -> list[list[list[int]]]:
    """Micro-batches (episode lists) to ranks, heaviest first in snake order: equal counts, similar work."""
    assert len(micro) % world == 0, "micro-batches must split evenly over ranks"  # the plans make them so
    cost = [batch_cost([sizes[i] for i in b], computed or sum(sizes[i] for i in b)) for b in micro]
    order = sorted(range(len(micro)), key=lambda k: (-cost[k], k))
    ranks: list[list[list[int]]] = [[] for _ in range(world)]
    for n, k in enumerate(order):
        lap, pos = divmod(n, world)
        ranks[pos if lap % 2 == 0 else world - 1 - pos].append(micro[k])
    return ranks


def step_plan(variant: str, episodes: list[int], lengths: list[int], world: int, budget_frames: int, tpf: int,
              seed: int) -> tuple[list[list[list[int]]], int]:
    """(micro-batches of each rank, repeated episodes) of one step over the global batch ``episodes``."""
    sizes = {i: lengths[i] * tpf for i in episodes}
    if variant == "batch1":
        return deal([[i] for i in episodes], sizes, 0, world), 0
    bins = pack_bins([lengths[i] for i in episodes], budget_frames, multiple=world, rng=np.random.default_rng(seed))
    micro = [[episodes[k] for k in b] for b in bins]
    return deal(micro, sizes, budget_frames * tpf, world), sum(len(b) for b in micro) - len(episodes)


# CPU ops of the collectives and their waits (gloo runs them on its own threads; FSDP2's gather and reduce
# regions hold the waits in their self time)
CPU_COMM = ("c10d::", "_c10d_functional::", "gloo", "FSDP::all_gather", "FSDP::post_backward_reduce")


def comm_split(fn, device: torch.device) -> tuple[float, float, str]:
    """(communication seconds, other seconds, kind) of ``fn()`` under torch.profiler: NCCL kernels against the
    other GPU kernels on CUDA; on the CPU, the collectives' ops (:data:`CPU_COMM`, self CPU time) against the rest
    of the wall time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
        _sync(device)
    wall = time.perf_counter() - t0
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        comm = sum(e.time_range.elapsed_us() for e in kernels if "nccl" in e.name.lower()) / 1e6
        total = sum(e.time_range.elapsed_us() for e in kernels) / 1e6
        return comm, total - comm, "nccl_kernel_share_of_gpu_kernel_time"
    comm = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith(CPU_COMM)) / 1e6
    return comm, max(wall - comm, 0.0), "gloo_share_of_cpu_wall_time"


def run_variant(args, variant: str, float8_mode: str, items, config, steps: list[list[int]], rank: int, world: int,
                device: torch.device, peak: float) -> dict:
    """One run: build, warm up, time ``--steps`` steps, profile ``--profile-steps``; every rank returns it."""
    cfg = config("pad" if variant == "batch1" else "pack", float8_mode)
    run = run_for(items, cfg, rank=rank, world_size=world, device=device)
    if device.type == "cuda":  # torchao and an sm89+ GPU, in one line, as `flexpack train` checks (--smoke emulates)
        float8.check(float8_mode, device)
    float8.check_tokens(float8_mode, cfg.data, run.geometry, device)  # a pack / padded row of 16k tokens
    tpf, lengths = run.geometry.tokens_per_frame, items.lengths()
    budget = run.geometry.frame_budget if variant == "packed" else 0
    plans = [step_plan(variant, eps, lengths, world, budget, tpf, cfg.runtime.seed + s) for s, eps in enumerate(steps)]
    mine = [[run.collate([items[i] for i in mb]) for mb in plan[rank]] for plan, _ in plans]
    if device.type == "cuda":
        mine = [[b.pin_memory() for b in step] for step in mine]
    model = run.build_model()
    opt = build_optimizer(model, cfg.optim, fused=device.type == "cuda")
    warm, n = args.warmup, args.steps
    for s in range(warm):
        train_step(model, opt, mine[s], run, step=s)
    _sync(device)
    graphs = compiled_graphs()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, sums = _event_times(lambda k: train_step(model, opt, mine[warm + k], run, step=warm + k)[0], n, device)
    losses = [float(x[0]) for x in sums]  # this rank's share; summed over ranks below
    recompiles = compiled_graphs() - graphs
    peak_mem = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    prof_at = warm + n
    comm, busy, kind = comm_split(lambda: [train_step(model, opt, mine[prof_at + k], run, step=prof_at + k)
                                           for k in range(args.profile_steps)], device)
    useful = UsefulFlops(run.model_config, run.geometry, objective=run.objective, seed=cfg.runtime.seed)
    flops = [sum(useful(b.layout, warm + k) for b in mine[warm + k]) for k in range(n)]
    per_rank = gather({"times": times, "losses": losses, "flops": flops, "recompiles": recompiles, "peak": peak_mem,
                       "comm": comm, "busy": busy, "peak_flops": peak, "micro": len(mine[0]),
                       "tokens": [int(sum(int(b.layout.episode_frames.sum()) for b in mine[warm + k])) * tpf
                                  for k in range(n)],
                       "computed": [sum(b.layout.frame_doc.numel() for b in mine[warm + k]) * tpf for k in range(n)]})
    model = opt = None  # freed before the next run builds its model
    gc.collect()
    if args.layers > 8:
        torch._dynamo.reset()  # compiled code may hold the last model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    step_s = [max(r["times"][k] for r in per_rank) for k in range(n)]  # the slowest rank's step
    useful_tokens = [sum(lengths[i] for i in steps[warm + k]) * tpf for k in range(n)]
    total_flops = [sum(r["flops"][k] for r in per_rank) for k in range(n)]
    peak_sum = sum(r["peak_flops"] for r in per_rank)
    busy_s = [r["busy"] / args.profile_steps for r in per_rank]
    wall = [statistics.median(r["times"]) for r in per_rank]
    comm_all = sum(r["comm"] for r in per_rank)
    return {
        "variant": variant, "family": args.family, "float8": float8_mode, "world_size": world,
        "global_episodes": len(steps[0]), "episodes_per_gpu": len(steps[0]) / world, "layers": args.layers,
        "activation_checkpointing": cfg.parallel.activation_checkpointing, "compile": run.parallel.compile,
        "max_tokens": cfg.data.max_tokens if variant == "packed" else None,
        "pad_multiple": cfg.data.pad_multiple if variant == "batch1" else None,
        "micro_steps_per_rank": per_rank[0]["micro"], "repeated_episodes": statistics.mean(r for _, r in plans),
        "step_s": statistics.median(step_s), "step_s_all": step_s,
        "tokens_per_s_per_gpu": statistics.median(t / s / world for t, s in zip(useful_tokens, step_s)),
        "useful_tokens_per_step": statistics.median(useful_tokens),
        "trained_tokens_per_step": statistics.median(sum(r["tokens"][k] for r in per_rank) for k in range(n)),
        # with pad frames (batch1) and a pack's trailing pad (packed)
        "computed_tokens_per_step": statistics.median(sum(r["computed"][k] for r in per_rank) for k in range(n)),
        "mfu": statistics.median(f / s / peak_sum for f, s in zip(total_flops, step_s)),
        "bf16_peak_tflops_per_gpu": peak_sum / world / 1e12,
        "comm_share": comm_all / (comm_all + sum(r["busy"] for r in per_rank)), "comm_kind": kind,
        "comm_share_per_rank": [r["comm"] / ((r["comm"] + r["busy"]) or 1.0) for r in per_rank],
        "recompiles_after_warmup": max(r["recompiles"] for r in per_rank),
        "peak_mem_gb": max((r["peak"] for r in per_rank if r["peak"] is not None), default=None),
        "rank_imbalance": max(busy_s) / statistics.mean(busy_s) if statistics.mean(busy_s) > 0 else None,
        "rank_busy_s_per_step": busy_s,
        "rank_wall_imbalance": max(wall) / statistics.mean(wall),
        "losses": [sum(r["losses"][k] for r in per_rank) for k in range(n)],
        "finite": bool(all(np.isfinite(r["losses"]).all() for r in per_rank)),
    }


def weak_scaling(runs: dict) -> dict:
    """Tokens/s per GPU of each run over the 1-GPU run of the same family, variant, precision, episodes per GPU and
    layers (``--episodes-per-gpu`` makes that run; a ``--global-episodes`` run of as many per GPU pairs with it too)."""
    groups: dict[str, dict[int, float]] = {}
    for r in runs.values():
        if r.get("tokens_per_s_per_gpu"):
            key = f"{r['family']}-{r['variant']}-{r['float8']}-e{r['episodes_per_gpu']:g}-l{r['layers']}"
            groups.setdefault(key, {})[r["world_size"]] = r["tokens_per_s_per_gpu"]
    return {k: {"tokens_per_s_per_gpu": {str(w): t for w, t in sorted(v.items())},
                "efficiency": {str(w): t / v[1] for w, t in sorted(v.items())} if 1 in v else None}
            for k, v in groups.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", choices=("lingbot", "wan"), default="lingbot")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--set", default="ref", choices=SETS, help="episode lengths (train_step.py's sets)")
    p.add_argument("--variants", default="batch1,packed", help="comma-separated: " + ", ".join(VARIANTS))
    p.add_argument("--float8", default="off", help="comma-separated parallel.float8 modes: off, tensorwise, rowwise")
    p.add_argument("--activation-checkpointing", type=parse_ac, default=True, metavar="true|false|N|selective")
    p.add_argument("--global-episodes", type=int, default=128, help="episodes per optimizer step, over all ranks")
    p.add_argument("--episodes-per-gpu", type=int, default=0,
                   help="weak scaling: this many episodes per rank and step (global = it x N; overrides "
                        "--global-episodes)")
    p.add_argument("--max-tokens", type=int, default=32768, help="packed: data.max_tokens of a micro-batch")
    p.add_argument("--pad-multiple", type=int, default=64,
                   help="batch1: data.pad_multiple (frames; each padded length compiles its own graph: 5 on the "
                        "reference lengths at 64)")
    p.add_argument("--compile", type=lambda s: s.lower() == "true", default=None, metavar="true|false",
                   help="parallel.compile (default: true on CUDA, false on the CPU)")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--profile-steps", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU over gloo: the code paths, no timing")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON (default benchmarks/results/step_multigpu_h200xN.json); runs are added to it")
    args = p.parse_args()
    if args.smoke:
        args.layers, args.steps, args.warmup, args.profile_steps = 2, 2, 1, 1
        args.max_tokens = 128 if args.family == "lingbot" else 64
        args.pad_multiple = 4
        if args.global_episodes == 128 and not args.episodes_per_gpu:
            args.global_episodes = 8
    variants = args.variants.split(",")
    modes = args.float8.split(",")
    if set(variants) - set(VARIANTS):
        p.error(f"--variants: unknown {sorted(set(variants) - set(VARIANTS))}; use {', '.join(VARIANTS)}")
    if set(modes) - {"off", "tensorwise", "rowwise"}:
        p.error(f"--float8: unknown mode(s) {sorted(set(modes) - {'off', 'tensorwise', 'rowwise'})}; "
                "use off, tensorwise, rowwise")
    rank, world, device = setup_dist(args.smoke)
    if args.compile is None:
        args.compile = device.type == "cuda"
    global_eps = args.episodes_per_gpu * world if args.episodes_per_gpu else args.global_episodes
    if global_eps % world:
        p.error(f"--global-episodes {global_eps} must be a multiple of the world size {world} (batch 1 a rank)")
    lengths = length_sets(args.smoke)[args.set]
    n_steps = args.warmup + args.steps + args.profile_steps
    order = np.random.default_rng(0).permutation(len(lengths)).tolist()
    order = (order * (-(-n_steps * global_eps // len(order))))[: n_steps * global_eps]  # repeats past one epoch
    steps = [order[s * global_eps:(s + 1) * global_eps] for s in range(n_steps)]
    items, config = family_setup(args, lengths)
    peak = measured_bf16_peak(device) if device.type == "cuda" else 1e12  # the CPU's is a placeholder
    out = args.out or Path(f"benchmarks/results/step_multigpu_h200x{world}.json")
    command = " ".join([f"torchrun --nproc_per_node {world}" if "RANK" in os.environ else "python", *sys.argv])
    failed: list[str] = []
    for variant in variants:
        for f8 in modes:
            name = (f"{args.family}-{variant}-{'bf16' if f8 == 'off' else 'float8-' + f8}-w{world}-g{global_eps}"
                    f"-l{args.layers}")
            t0 = time.perf_counter()
            try:
                r = run_variant(args, variant, f8, items, config, steps, rank, world, device, peak)
            except Exception as exc:  # keep the other runs' numbers; say what failed (every rank fails alike)
                r = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                failed.append(name)
            r.update(command=command, set=args.set, weak=bool(args.episodes_per_gpu), smoke=args.smoke,
                     wall_s=time.perf_counter() - t0)
            if rank == 0:
                res = json.loads(out.read_text()) if out.exists() else {}
                res.update(command=command, device=torch.cuda.get_device_name(device) if device.type == "cuda"
                           else "cpu (gloo)", world_size=world, torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                           smoke=args.smoke)
                res.setdefault("runs", {})[name] = r
                res["weak_scaling"] = weak_scaling(res["runs"])
                out.parent.mkdir(parents=True, exist_ok=True)
                tmp = out.with_suffix(".tmp")
                tmp.write_text(json.dumps(res, indent=1))
                tmp.replace(out)
                print(f"{name}: " + (r.get("error") or
                      f"step {r['step_s']:.3f} s, {r['tokens_per_s_per_gpu']:.0f} tok/s/GPU, mfu {r['mfu']:.3f}, "
                      f"comm {r['comm_share']:.2f}, imbalance {r['rank_imbalance'] or 0:.2f}, "
                      f"recompiles {r['recompiles_after_warmup']}, peak {r['peak_mem_gb'] or 0:.1f} GB, "
                      f"{r['micro_steps_per_rank']} micro-steps/rank, wall {r['wall_s']:.0f} s"), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    if failed:
        raise SystemExit(f"step_multigpu: {len(failed)} run(s) failed: {', '.join(failed)} (their errors are in {out})")


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    main()
