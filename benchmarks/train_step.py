r"""Whole training steps: flexpack's own step code in pack and pad mode vs diffusers one episode per step.

What ``flexpack train`` runs for a step (model from a TrainConfig via ``build_model`` +
``parallelize``, ``train_step`` = ``accumulate`` + clip + fused AdamW, items through the real
collate, per-episode device noise) is timed on 65,536-token packs, against diffusers'
``WanTransformer3DModel`` of the same shape trained one episode per step (eager and
``torch.compile(dynamic=True)``, in bf16 and with the same layers in float8: ``benchmarks/diffusers_step.py``)
on the same episodes, and against flexpack's pad mode. Latents
are synthetic (no lerobot), text is 512 tokens per episode, no actions; fp32 weights with bf16
autocast everywhere. MFU counts useful FLOPs only (``flexpack.training.observe.flops``: attention on
unmasked pairs, forward + backward 3× the forward, no recompute) against an 8192³ bf16 matmul
measured in the same run.

    python benchmarks/train_step.py --out $OUT/train_step_h200.json                # ref and short, all variants
    python benchmarks/train_step.py --sets short --variants pack-compiled,diffusers-compiled
    python benchmarks/train_step.py --sets veryshort,long \
        --variants pack-compiled,pack-float8-tensorwise,diffusers-compiled,diffusers-float8-compiled
    python benchmarks/train_step.py --smoke                                        # CPU, tiny shapes: API check
    python benchmarks/train_step.py \
        --variants pack-compiled,pack-float8-rowwise,pack-float8-tensorwise,diffusers-compiled
    python benchmarks/train_step.py --layers 30 --activation-checkpointing selective --variants pack-float8-rowwise
    python benchmarks/train_step.py --variants pack-compiled,loop-compiled         # flexpack train vs its bare step

Sets (latent frames per episode): ``ref`` (103-362), ``short`` (56-146), ``veryshort`` (14-40, ~70 episodes a
pack), ``long`` (8-600, a long tail), ``wan5b`` (``train_wan5b.sh``'s 13 episodes); see :func:`length_sets`.

``pack-float8-MODE``: the compiled step with ``parallel.float8 = MODE``; ``diffusers-float8-{compiled,regional,eager}``:
diffusers with torchao's tensorwise float8 in the layers flexpack converts. Float8 variants need an sm89+ GPU
(refused in one line elsewhere, except ``--smoke``, which emulates them on the CPU). Per set the JSON compares
like with like: ``pack_vs_diffusers_compiled`` is the bf16 packed step over diffusers compiled in bf16,
``pack_float8_vs_diffusers_float8`` the fastest float8 packed step over diffusers compiled in float8
(``comparisons`` holds both rows); ``pack_tokens_per_s`` is the fastest packed step (``pack_variant`` names it) and
the ``float8`` key has its mode, its tokens/s and the bf16 step's. ``packing_waste`` and
``packing_waste_incl_repeats``: pad tokens of the set's packs, repeated (tail-padding) episodes counted as used and
as waste; ``text_slots``: the run's text key slots (empty slots cost key and value projections). ``loop-*``:
``benchmarks/loop_vs_step.py``; with one, the bare variants time the packs of the loop's first measured window
(``--steps`` = ``--loop-log-every``), so ``loop_vs_step`` compares the same packs.
``--activation-checkpointing`` (true / N / selective) applies to every flexpack variant.

Each variant: warm-up steps (compiles), a first pass over the timed steps with a sync around each
(host time; for diffusers also the first step at each episode length, ``first_pass_tokens_per_s``),
then the median of ``--steps`` steps queued without syncs. A set's entry in the JSON comes from one
run and is rewritten after every variant, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexpack.packing.lengths import read_frames_file  # noqa: E402
from flexpack.parallel.parallelize import compiled_graphs  # noqa: E402
from flexpack.run.compose import run_for  # noqa: E402
from flexpack.run.config import TrainConfig, from_dict  # noqa: E402
from flexpack.training.observe.flops import UsefulFlops, measured_bf16_peak  # noqa: E402
from flexpack.training.optim import build_optimizer  # noqa: E402
from flexpack.training.step import train_step  # noqa: E402

REF = Path(__file__).resolve().parents[1] / "data" / "episode_frames_ref.txt"
WAN5B = Path(__file__).resolve().parents[1] / "data" / "episode_frames_wan5b.txt"  # train_wan5b.sh's dataset
DATA = Path(__file__).resolve().parents[1] / "data"
SETS = ("ref", "short", "veryshort", "long", "wan5b")
VARIANTS = ("pack-compiled", "pack-float8-tensorwise", "pack-float8-rowwise", "pack-eager", "diffusers-compiled",
            "diffusers-regional", "diffusers-eager", "diffusers-float8-compiled", "pad-eager")
# also: diffusers-float8-regional / -eager; loop-compiled, loop-float8-MODE: the same packs through `flexpack train`
# (benchmarks/loop_vs_step.py)


def float8_of(variant: str) -> str:
    """parallel.float8 of a variant name (``pack-float8-rowwise`` → ``rowwise``); float8 variants are compiled."""
    return variant.split("float8-", 1)[1] if "float8-" in variant else "off"


def known_variant(name: str) -> bool:
    """Whether ``--variants`` names something this script runs."""
    if name.startswith("diffusers-"):
        from diffusers_step import variant

        try:
            variant(name)
            return True
        except ValueError:
            return False
    if name.startswith("loop-"):  # the loop of a packed variant
        return "pack-" + name.removeprefix("loop-") in VARIANTS
    return name.removesuffix("-textflash") in VARIANTS


def float8_refused(device: torch.device) -> str | None:
    """Why float8 matmuls cannot run on ``device`` (None where they can)."""
    if device.type != "cuda":
        return f"this run is on {device.type}"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}"
    return None


def parse_ac(text: str) -> bool | int | str:
    """``--activation-checkpointing``: true / false / a block count / selective."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    return "selective" if low == "selective" else int(low)


def length_sets(smoke: bool) -> dict[str, list[int]]:
    """Latent frames per episode: the reference lengths (F 103-362), a short-episode set (F 56-146,
    uniform, seeded: real robot datasets often have 50-150 latent frames), ``veryshort`` (F 14-40, ~70
    episodes per 65,536-token pack: ``data/episode_frames_veryshort.txt``), ``long`` (F 8-600, log-normal
    with a long tail: ``data/episode_frames_long.txt``) and ``wan5b``, the 13 episodes of
    ``benchmarks/train_wan5b.sh``'s dataset (F 69-350) repeated 40 times, as its epochs do.
    ``smoke``: tiny lengths for 512-token packs of 4-token frames (veryshort: ~68 episodes a pack, whose count
    crosses 64 between packs)."""
    if smoke:
        return {"ref": [5, 7, 3, 9, 4, 6, 8, 5] * 12, "short": [2, 3, 4, 2, 3] * 40, "wan5b": [9, 8, 7, 2] * 20,
                "veryshort": [1, 2, 3, 1, 2, 1, 4, 1] * 40, "long": [1, 2, 30, 3, 12, 40, 1, 6] * 12}
    return {"ref": read_frames_file(REF), "short": np.random.default_rng(0).integers(56, 147, 1280).tolist(),
            "veryshort": read_frames_file(DATA / "episode_frames_veryshort.txt"),
            "long": read_frames_file(DATA / "episode_frames_long.txt"), "wan5b": read_frames_file(WAN5B) * 40}


def config(args: argparse.Namespace, mode: str, compile_: bool, float8: str = "off") -> TrainConfig:
    over = {"num_layers": args.layers, "action_channels": args.action_channels}
    model = {"preset": "tiny" if args.smoke else "wan2.2-5b", "overrides": over}
    return from_dict(TrainConfig, {
        "data": {"mode": mode, "max_tokens": args.max_tokens, "batch_size": getattr(args, "pad_batch", 4),
                 "pad_multiple": 8},
        "model": model,
        "optim": {"lr": 1e-5, "betas": [0.9, 0.95], "grad_clip": 1.0},
        "runtime": {"dtype": "bfloat16"}, "log": {"progress": False},
        "parallel": {"compile": compile_, "float8": float8, "activation_checkpointing": args.activation_checkpointing,
                     "activation_memory_budget": args.memory_budget if compile_ else 1.0},
    })


class Items:
    """Synthetic dataset items (the keys LatentEpisodeDataset yields), made once per episode on demand."""

    def __init__(self, lengths: list[int], C: int, H: int, W: int, L: int, Dt: int, Ca: int = 0, A: int = 0) -> None:
        """``Ca`` action channels of ``A`` action steps per frame (the config's ``data.action_steps``); 0: none."""
        self.frames, self.shape, self.L, self.Dt, self.Ca, self.A = lengths, (C, H, W), L, Dt, Ca, A

    def __len__(self) -> int:
        return len(self.frames)

    def lengths(self) -> list[int]:
        return list(self.frames)

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(1000 + i)
        C, H, W = self.shape
        item = {"latent": torch.randn(C, self.frames[i], H, W, generator=g).to(torch.bfloat16),
                "text": torch.randn(self.L, self.Dt, generator=g).to(torch.bfloat16) * 0.1,
                "episode_index": i, "segment": -1}
        if self.Ca:  # actions in [-1, 1], every value counted (as a dataset without padding)
            assert self.A > 0, "Items with action channels need A, the config's data.action_steps"
            item["action"] = torch.rand(self.Ca, self.frames[i], self.A, generator=g) * 2 - 1
            item["action_mask"] = torch.ones(self.Ca, self.frames[i], self.A, dtype=torch.bool)
        return item


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_and_wall(fn, device: torch.device) -> tuple[float, float]:
    """Seconds ``fn()`` takes to return (host time to queue it, the GPU idle at the start) and until
    its GPU work is done."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    host = time.perf_counter() - t0
    _sync(device)
    return host, time.perf_counter() - t0


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def _medians(times: list[float], host: list[float], tokens: list[int], flops: list[float], peak: float) -> dict:
    tok_s = [n / t for n, t in zip(tokens, times)]
    return {"step_s": statistics.median(times), "host_ms_per_step": 1e3 * statistics.median(host),
            "tokens_per_s": statistics.median(tok_s),
            "tokens_per_s_total": sum(tokens) / sum(times),  # over all timed packs, as a loop window counts
            "mfu": statistics.median(f / t / peak for f, t in zip(flops, times)),
            "steps": len(times), "tokens_per_step": statistics.median(tokens)}


def run_flexpack(args, name: str, lengths: list[int], batches: list[list[int]], items: Items, mode: str,
                 compile_: bool, device: torch.device, peak: float) -> dict:
    cfg = config(args, mode, compile_, float8_of(name))
    run = run_for(items, cfg, device=device)  # the train loop's geometry, sampler, collate and forward options
    m, geometry, collate = run.model_config, run.geometry, run.collate
    tpf = geometry.tokens_per_frame
    plan = batches if mode == "pack" else list(run.sampler)[: len(batches)]
    model = run.build_model()  # as `flexpack train` builds, wraps and loads it
    opt = build_optimizer(model, cfg.optim, fused=device.type == "cuda")
    made = [collate([items[i] for i in b]) for b in plan]
    if device.type == "cuda":
        made = [b.pin_memory() for b in made]
    warm = args.warmup
    for k in range(warm):  # compiles, captures, allocator warm-up
        train_step(model, opt, [made[k]], run, step=k)
    _sync(device)
    syncs = count_syncs(lambda: train_step(model, opt, [made[warm - 1]], run, step=warm), device)
    graphs_after_warmup = compiled_graphs()
    _peak_reset(device)
    timed = made[warm:]
    # pass 1, a sync around every step: host time to queue one step (the GPU idle meanwhile)
    host = [_host_and_wall(lambda: train_step(model, opt, [batch], run, step=warm + k), device)[0]
            for k, batch in enumerate(timed[: args.host_steps or len(timed)])]
    # pass 2, as the train loop runs: no sync between steps; an event before each step
    times, sums = _event_times(lambda k: train_step(model, opt, [timed[k]], run, step=warm + len(timed) + k)[0],
                               len(timed), device)
    losses = [float(x[0]) for x in sums]
    tokens = [int(b.layout.episode_frames.sum()) * tpf for b in timed]
    useful = UsefulFlops(m, geometry, objective=run.objective, seed=cfg.runtime.seed)
    flops = [useful(b.layout, warm + len(timed) + k) for k, b in enumerate(timed)]  # the steps of pass 2
    out = _medians(times, host, tokens, flops, peak)
    out.update(peak_mem_gb=_peak_gb(device), recompiles_after_warmup=compiled_graphs() - graphs_after_warmup,
               host_syncs_per_step=syncs, float8=cfg.parallel.float8,
               activation_checkpointing=cfg.parallel.activation_checkpointing,
               losses=losses, finite=all(np.isfinite(losses)),
               computed_tokens_per_step=made[0].layout.frame_doc.numel() * tpf)
    if args.profile and mode == "pack" and device.type == "cuda":
        out["kernel_split"] = profile_split(lambda: train_step(model, opt, [made[warm]], run, step=0), device)
    return out


def count_syncs(fn, device: torch.device) -> int | None:
    """Host-device synchronizations in one call of ``fn`` (CUDA's sync debug mode warns on each)."""
    if device.type != "cuda":
        return None
    import warnings

    _sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    _sync(device)
    # one warning per synchronizing call; the mode's own "prototype feature" notice is not one
    return sum("called a synchronizing" in str(w.message) for w in caught)


def _event_times(step, n: int, device: torch.device) -> tuple[list[float], list]:
    """Seconds per call of ``step(k)``, k < n, from device events queued between calls (no host
    sync until the end, so the host runs ahead as in training); returns (times, step results)."""
    if device.type != "cuda":
        out, times = [], []
        for k in range(n):
            t0 = time.perf_counter()
            out.append(step(k))
            times.append(time.perf_counter() - t0)
        return times, out
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    out = []
    for k in range(n):
        events[k].record()
        out.append(step(k))
    events[n].record()
    events[n].synchronize()
    return [events[k].elapsed_time(events[k + 1]) / 1e3 for k in range(n)], out


def profile_split(fn, device: torch.device) -> dict:
    """Share of CUDA kernel time per category in one step (attention / gemm / elementwise / other)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        _sync(device)
    cats: dict[str, float] = {"attention": 0.0, "gemm": 0.0, "elementwise": 0.0, "optimizer": 0.0, "other": 0.0}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0))
        n = e.key.lower()
        if t <= 0 or e.key.startswith("ProfilerStep"):
            continue
        if "flash" in n or "flex" in n or "attention" in n or "fmha" in n or "cutlass" in n and "attn" in n:
            cats["attention"] += t
        elif "gemm" in n or "sm90" in n or "cublas" in n or "matmul" in n or "xmma" in n or "nvjet" in n:
            cats["gemm"] += t
        elif "adam" in n or "multi_tensor" in n:
            cats["optimizer"] += t
        elif "triton" in n or "elementwise" in n or "reduce" in n or "copy" in n or "norm" in n or "cat" in n:
            cats["elementwise"] += t
        else:
            cats["other"] += t
    total = sum(cats.values()) or 1.0
    top = sorted(((getattr(e, "device_time_total", 0.0), e.key) for e in prof.key_averages()), reverse=True)[:60]
    return {"shares": {k: v / total for k, v in cats.items()}, "device_ms": total / 1e3,
            "top": [[k[:90], round(t / 1e3, 3)] for t, k in top]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sets", default="ref,short", help="comma-separated: " + ", ".join(SETS))
    p.add_argument("--action-channels", type=int, default=0,
                   help="model.action_channels of the flexpack variants (4 action tokens per frame); diffusers has "
                        "no actions, so its variants need 0")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=65536)
    p.add_argument("--profile", action="store_true", help="kernel-time split of one packed step")
    p.add_argument("--memory-budget", type=float, default=1.0,
                   help="parallel.activation_memory_budget of the compiled flexpack variants")
    p.add_argument("--activation-checkpointing", type=parse_ac, default=False, metavar="true|false|N|selective",
                   help="parallel.activation_checkpointing of the flexpack variants (--layers 30 needs it)")
    p.add_argument("--no-diffusers", action="store_true", help="drop the diffusers variants from --variants")
    p.add_argument("--diffusers-steps", type=int, default=None,
                   help="timed packs for diffusers (default --steps): its episodes run one by one, twice")
    p.add_argument("--loop-steps", type=int, default=30, help="measured steps of the loop-* variants (after a first "
                   "window of --loop-log-every steps that holds the compile)")
    p.add_argument("--loop-log-every", type=int, default=10, help="log.every of the loop-* variants; with "
                   "one, --steps must equal it (the bare step then times the loop's first measured window)")
    p.add_argument("--host-steps", type=int, default=0,
                   help="timed packs of the host-time pass (a sync around each; default all --steps)")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the code paths, times nothing real")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/train_step_h200.json"))
    args = p.parse_args()
    if args.smoke:
        args.layers, args.max_tokens, args.steps, args.warmup = 2, 512, 2, 1
        args.loop_log_every = args.loop_steps = args.steps
    has_loop = any(v.startswith("loop") for v in args.variants.split(","))
    variants = [v for v in args.variants.split(",") if not (args.no_diffusers and v.startswith("diffusers"))]
    unknown = set(args.sets.split(",")) - set(SETS)
    if unknown:
        p.error(f"--sets: unknown set(s) {sorted(unknown)}; use {', '.join(SETS)}")
    bad = [v for v in variants if not known_variant(v)]
    if bad:
        p.error(f"--variants: unknown variant(s) {bad}; use {', '.join(VARIANTS)} (or diffusers-float8-regional, "
                "diffusers-float8-eager, loop-compiled, loop-float8-MODE)")
    if args.action_channels < 0:
        p.error(f"--action-channels must be >= 0, got {args.action_channels}")
    if args.action_channels and any(v.startswith("diffusers") for v in variants):
        p.error(f"--action-channels {args.action_channels} with a diffusers variant: diffusers' Wan has no actions "
                "(drop them with --no-diffusers or --variants)")
    if has_loop and args.steps != args.loop_log_every:
        p.error(f"--steps ({args.steps}) must equal --loop-log-every ({args.loop_log_every}) with a loop-* variant: "
                "the bare step times the packs of the loop's first measured window")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    why = None if args.smoke else float8_refused(device)
    f8 = [v for v in variants if "float8" in v]
    if f8 and why:
        p.error(f"{', '.join(f8)}: float8 matmuls need an NVIDIA GPU of compute capability 8.9 or newer; {why} "
                "(drop them from --variants; --smoke emulates them on the CPU)")
    peak = measured_bf16_peak(device) if device.type == "cuda" else 1e12
    C, H, W, L, Dt = (4, 4, 4, 6, 32) if args.smoke else (48, 8, 16, 512, 4096)  # 32 video tokens per frame
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results.update(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   date=time.strftime("%Y-%m-%d"), torch=torch.__version__, layers=args.layers,
                   bf16_matmul_tflops=peak / 1e12, command=" ".join(sys.argv))
    sets = length_sets(args.smoke)
    for set_name in args.sets.split(","):
        lengths = sets[set_name]
        cfg = config(args, "pack", True)
        items = Items(lengths, C, H, W, L, Dt, Ca=args.action_channels, A=cfg.data.action_steps)
        packs = run_for(items, cfg, device=device)  # the packs every variant trains on
        tpf = packs.geometry.tokens_per_frame
        drawn = list(packs.sampler)
        # with a loop-* variant the bare step times the packs of the loop's first measured window (the loop's
        # steps log_every .. 2*log_every-1), so loop_vs_step compares the same packs
        at = args.loop_log_every if has_loop else args.warmup
        batches = drawn[: args.warmup] + drawn[at: at + args.steps]
        res = results[set_name] = {"command": " ".join(sys.argv), "bf16_matmul_tflops": peak / 1e12}  # one run per set
        res["episodes_per_pack"] = statistics.mean(len(b) for b in batches)
        res["frames"] = [min(lengths), max(lengths)]
        waste = packs.sampler.stats()  # the epoch the packs come from
        res.update(packing_waste=waste.waste, packing_waste_incl_repeats=waste.waste_incl_repeats,
                   packs_per_epoch=waste.micro_batches, text_slots=packs.text_slots)
        args.pad_batch = max(1, round(args.max_tokens / (statistics.mean(lengths) * tpf)))
        for v in variants:
            t0 = time.perf_counter()
            held = torch.cuda.memory_allocated(device) / 1e9 if device.type == "cuda" else None  # a leak shows here
            try:
                if v.startswith("diffusers"):
                    from diffusers_step import run_diffusers

                    n = args.warmup + (args.diffusers_steps or args.steps)
                    r = run_diffusers(args, v, lengths, batches[:n], items, device, peak)
                elif v.startswith("loop"):
                    from loop_vs_step import run_loop

                    r = run_loop(args, v, lengths, items, device, config(args, "pack", True, float8_of(v)), peak,
                                 bare_packs=batches[args.warmup:])
                else:
                    from flexpack.attention import flex

                    mode = "pad" if v.startswith("pad") else "pack"
                    text_backend = flex.AUTO_CUDA["text"]
                    if v.endswith("textflash"):  # experiment: FA4 for the text cross-attention too
                        flex.AUTO_CUDA["text"] = "flex-flash"
                    try:
                        r = run_flexpack(args, v, lengths, batches, items, mode, "compiled" in v or "float8" in v,
                                         device, peak)
                    finally:
                        flex.AUTO_CUDA["text"] = text_backend
            except Exception as exc:  # keep the other variants' numbers; say what failed
                r = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            r["wall_s"], r["mem_at_start_gb"] = time.perf_counter() - t0, held
            res[v] = r
            _summarize(res)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1))
            print(f"[{set_name}] {v}: " + (r.get("error") or
                  f"{r['tokens_per_s']:.0f} tok/s, step {r['step_s']*1e3:.0f} ms, mfu {r.get('mfu') or 0:.3f}, "
                  f"host {r.get('host_ms_per_step') or 0:.0f} ms, syncs {r.get('host_syncs_per_step')}, "
                  f"peak {r.get('peak_mem_gb') or 0:.1f} GB, recompiles {r.get('recompiles_after_warmup')}, "
                  f"wall {r['wall_s']:.0f} s"),
                  flush=True)
            if args.layers > 8:  # compiled code may hold the last model: at 30 layers two would not fit
                torch._dynamo.reset()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if not isinstance(vv, dict)} for k, v in results.items()
                      if isinstance(v, dict)}, indent=1))


def _summarize(res: dict) -> None:
    """The issue's flat keys per length set, from whatever variants have numbers (see the module docstring)."""
    def tok(v):
        return res.get(v, {}).get("tokens_per_s")

    def fastest(names):
        return max((v for v in names if tok(v)), key=tok, default=None)

    bf16 = res.get("pack-compiled", {}) if tok("pack-compiled") else res.get("pack-eager", {})
    f8 = fastest(v for v in res if v.startswith("pack-float8-"))
    pack_v = fastest(v for v in ("pack-compiled", "pack-eager", f8) if v)
    pack = res.get(pack_v, {}) if pack_v else {}
    if f8:
        res["float8"] = {"mode": float8_of(f8), "tokens_per_s": tok(f8), "bf16_tokens_per_s": bf16.get("tokens_per_s"),
                         "speedup_vs_bf16": tok(f8) / bf16["tokens_per_s"] if bf16.get("tokens_per_s") else None,
                         "modes": {float8_of(v): tok(v) for v in res if v.startswith("pack-float8-") and tok(v)}}
    for v in (v for v in list(res) if v.startswith("loop-") and tok(v)):  # vs the bare step of the same settings
        bare = res.get("pack-" + v.removeprefix("loop-"), {})
        same = res[v].get("same_window_tokens_per_s")  # the loop's window over the bare step's packs
        step = bare.get("tokens_per_s_total") if same else None
        res[v]["loop_vs_step"] = same / step if step else None
        res.setdefault("loop_vs_step", {})[v] = res[v]["loop_vs_step"]
    d_bf16 = fastest(("diffusers-compiled", "diffusers-regional"))
    d_f8 = fastest(("diffusers-float8-compiled", "diffusers-float8-regional"))
    # like for like: both compiled, both bf16 or both float8 (diffusers in tensorwise; flexpack's fastest mode)
    rows = {"bf16": ("pack-compiled" if tok("pack-compiled") else None, d_bf16), "float8": (f8, d_f8)}
    res["comparisons"] = {k: {"pack_variant": a, "pack_tokens_per_s": tok(a) if a else None, "diffusers_variant": b,
                              "diffusers_tokens_per_s": tok(b) if b else None,
                              "ratio": tok(a) / tok(b) if a and b else None} for k, (a, b) in rows.items()}
    packed = [res[v] for v in res if v.startswith(("pack-", "pad-")) and tok(v)]
    res.update(pack_variant=pack_v, pack_tokens_per_s=tok(pack_v) if pack_v else None,
               pack_bf16_tokens_per_s=tok(rows["bf16"][0]) if rows["bf16"][0] else None,
               pack_float8_tokens_per_s=tok(f8) if f8 else None,
               diffusers_compiled_tokens_per_s=tok(d_bf16) if d_bf16 else None,
               diffusers_float8_tokens_per_s=tok(d_f8) if d_f8 else None,
               diffusers_eager_tokens_per_s=tok("diffusers-eager"), pad_tokens_per_s=tok("pad-eager"),
               pack_vs_diffusers_compiled=res["comparisons"]["bf16"]["ratio"],
               pack_float8_vs_diffusers_float8=res["comparisons"]["float8"]["ratio"],
               mfu_pack=pack.get("mfu"),  # useful FLOPs over the measured bf16 peak: the bf16-equivalent MFU
               peak_mem_gb_pack=pack.get("peak_mem_gb"),
               # the most any packed or padded variant of the set compiled after its warm-up
               recompiles_after_warmup=max((r.get("recompiles_after_warmup") or 0 for r in packed), default=None),
               host_ms_per_step=pack.get("host_ms_per_step"))


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    main()
