"""LingBot-VA-5B under GPU memory budgets: what the planner chooses, the peak, the speed and the loss.

Each variant runs in its own process through ``flexpack train``'s loop (:func:`flexpack.training.loop.train`) on
in-memory episodes shaped as ``benchmarks/train_lingbot5b.sh``'s dataset (two 128x128 cameras: 32 video + 4
action tokens a latent frame, 30 action channels, 512 x 4096 text; ``wan5b`` lengths), capped with
``torch.cuda.set_per_process_memory_fraction`` at its budget; ``max_memory_allocated`` and
``max_memory_reserved`` are reported with the host's peak resident memory. Stages:

    python benchmarks/memory_budget.py --stage calibrate --out OUT/memory_calibrate_h200.json  # the planner's costs
    python benchmarks/memory_budget.py --stage budgets --budgets 130,80,48 --lora-budget 24 \\
        --out benchmarks/results/memory_budget_h200.json     # the full 30 layers at each budget
    python benchmarks/memory_budget.py --stage quality --steps 300 --out benchmarks/results/memory_quality_h200.json
    python benchmarks/memory_budget.py --smoke --stage all  # CPU, tiny model: every code path, times nothing
    python benchmarks/memory_budget.py --tiny --stage quality --steps 300 \
        --out benchmarks/results/memory_quality_cpu.json  # the quality stage on a CPU: tiny LingBot-VA, real steps

``calibrate``: 4 and 8 blocks, with and without checkpointing, float8 and bf16, and every optimizer option at 8
blocks: the per-token activation costs of :class:`flexpack.run.memory_plan.Costs` and each estimate against its
measured peak. ``budgets``: ``memory.budget_gb`` at each budget (the plan's line, its options, peak, tokens/s, MFU,
host memory, loss), ``--lora-budget`` with LoRA (``lora.rank``), and the unconstrained run as today's reference
(float8, every block checkpointed, AdamW). ``quality``: the same data and seed for ``--steps`` steps per optimizer
option (AdamW, 8-bit, 4-bit, on the host) and LoRA: each loss curve and its end against AdamW's
(``benchmarks/plot_memory_quality.py`` draws them). ``--tiny``: the tiny LingBot-VA preset on the CPU with the
steps, tokens and layers given (the optimizer on the host needs CUDA and is left out there).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flexpack.run.resolve import model_config_of

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def base_config(spec: dict) -> dict:
    smoke = spec.get("smoke", False)
    tiny = smoke or spec.get("tiny", False)
    over = {"num_layers": spec["layers"], "action_channels": 30 if not smoke else 6}
    return {
        "data": {"mode": "pack", "max_tokens": spec["max_tokens"], "num_workers": 0 if smoke else 4,
                 "action_steps": 4},
        "model": {"family": "lingbot-va", "preset": "lingbot-va-tiny" if tiny else "lingbot-va-5b", "overrides": over},
        # every variant unclipped: the optimizer on the host cannot clip
        "optim": {"lr": spec.get("lr", 1e-5), "betas": [0.9, 0.95], "grad_clip": 0.0},
        "schedule": {"steps": spec["steps"], "warmup_steps": max(1, spec["steps"] // 10), "decay": "constant"},
        "checkpoint": {"every": 0},
        "runtime": {"dtype": "bfloat16", "out_dir": spec["out_dir"], "seed": 0, "device": spec["device"]},
        "parallel": {"float8": spec.get("float8", "off"), "activation_checkpointing": spec.get("ac", False)},
        "log": {"progress": False, "tensorboard": False, "every": 1},
    }


def parse_set(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` of ``--set``: the value read as ``flexpack train --set`` reads it."""
    from flexpack.run.config_parse import parse_value

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"--set takes KEY=VALUE, got {text!r}")
    return key.strip(), parse_value(value.strip())


def merge(cfg: dict, dotted: dict) -> dict:
    for key, value in dotted.items():
        node = cfg
        *path, last = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    return cfg


def child(spec: dict) -> dict:
    """One variant in this process: the plan, then the steps; the facts as a dict."""
    import torch

    from flexpack.parallel import float8
    from flexpack.run import memory_plan
    from flexpack.run.compose import run_for
    from flexpack.run.config import TrainConfig, from_dict
    from flexpack.run.state import checkpoint
    from flexpack.training import loop
    from train_step import Items, length_sets

    smoke = spec.get("smoke", False)
    device = torch.device(spec["device"])
    if smoke:
        float8.MIN_DIM = 16
        float8.check = lambda mode, dev: None
    if device.type == "cuda" and spec.get("cap_gb"):
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["cap_gb"] * 1e9 / total), device.index or 0)
    checkpoint.Checkpointer.save = lambda self, *a, **k: None  # the steps are measured, not the weights
    cfg = from_dict(TrainConfig, merge(base_config(spec), spec.get("set", {})))
    tiny = smoke or spec.get("tiny", False)
    C, H, W, L, Dt = (48, 2, 4, 6, 64) if tiny else (48, 8, 16, 512, 4096)
    items = Items(length_sets(tiny)["wan5b"], C, H, W, L, Dt, Ca=model_config_of(cfg).action_channels,
                  A=cfg.data.action_steps)
    run = run_for(items, cfg, device=device)
    out: dict = {}
    try:
        planned = memory_plan.apply(run)
        if planned is not run:
            shape = memory_plan.shape_of(planned)
            c = planned.config
            ac = c.parallel.activation_checkpointing
            choice = memory_plan.Choice(shape.layers if ac is True else int(ac or 0),
                                        getattr(c.optim, "states", "float32"), getattr(c.optim, "offload", "none"))
            est = memory_plan.estimate(shape, choice)
            out["plan"] = {"activation_checkpointing": ac, "states": choice.states, "offload": choice.offload,
                           "est_gb": round(est.gpu_gb, 2), "est_host_gb": round(est.host_gb, 2)}
        else:
            shape = memory_plan.shape_of(run)
            c = run.config
            ac = c.parallel.activation_checkpointing
            choice = memory_plan.Choice(shape.layers if ac is True else int(ac or 0),
                                        getattr(c.optim, "states", "float32"), getattr(c.optim, "offload", "none"))
            out["est_gb"] = round(memory_plan.estimate(shape, choice).gpu_gb, 2)
        est = memory_plan.estimate(shape, choice)
        out.update(params=shape.params, trained=shape.trained, tokens=shape.tokens, dim=shape.dim,
                   ffn_dim=shape.ffn_dim, layers=shape.layers, est_parts=est.parts)
        t0 = time.perf_counter()
        print(f"training from {time.strftime('%H:%M:%S')}", flush=True)  # a timed-out variant's tail says where
        res = loop.train(planned)
        rows = res.metrics
        later = rows[len(rows) // 3:] or rows
        out.update({
            "losses": [r["loss"] for r in rows],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in later),
            "step_s": statistics.median(r["step_s"] for r in later),
            "mfu": statistics.median(r["mfu"] for r in later) if "mfu" in later[0] else None,
            "peak_mem_gb": max(r["peak_mem_gb"] for r in rows),
            "peak_reserved_gb": max((r.get("peak_reserved_gb") or 0) for r in rows) or None,
            "wall_s": time.perf_counter() - t0})
    except Exception as exc:  # out of memory under the cap, a refused budget: kept as the variant's result
        out["error"] = f"{type(exc).__name__}: {exc}"[:1500]
    out["host_peak_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    return out


def spawn(spec: dict, timeout: float) -> dict:
    """``spec`` in a fresh process (its own allocator, cap and compile caches); its result or its failure."""
    out_dir = tempfile.mkdtemp(prefix="flexpack-membudget-")
    spec = {**spec, "out_dir": out_dir}
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                           timeout=timeout, env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
        lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        res = json.loads(lines[-1][7:]) if lines else {"error": (p.stderr or p.stdout)[-1500:]}
        plan_line = [x for x in p.stdout.splitlines() if x.startswith("budget ")]
        if plan_line:
            res["plan_line"] = plan_line[0]
    except subprocess.TimeoutExpired as exc:  # what the child had said by then: where it was
        said = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                       for x in (exc.stdout, exc.stderr))
        res = {"error": f"timed out after {timeout:.0f} s", "output_tail": said[-3000:]}
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    res["wall_total_s"] = time.perf_counter() - t0
    return res


def variants(stage: str, args: argparse.Namespace) -> dict[str, dict]:
    f8 = "off" if args.smoke else "tensorwise"
    if stage == "calibrate":
        v = {}
        for layers in (2, 4) if args.smoke else (4, 8):
            for ac in (False, True):
                v[f"L{layers}_ac{int(ac)}_f8"] = {"layers": layers, "ac": ac, "float8": f8}
                v[f"L{layers}_ac{int(ac)}_bf16"] = {"layers": layers, "ac": ac, "float8": "off"}
        top = 4 if args.smoke else 8
        for states in ("8bit", "4bit"):
            v[f"L{top}_ac1_f8_{states}"] = {"layers": top, "ac": True, "float8": f8, "set": {"optim.states": states}}
        if not args.smoke:
            for off in ("optimizer", "optimizer+gradients"):
                v[f"L{top}_ac1_f8_{off}"] = {"layers": top, "ac": True, "float8": f8, "set": {"optim.offload": off}}
        v[f"L{top}_ac1_f8_lora16"] = {"layers": top, "ac": True, "float8": f8, "set": {"lora.rank": 16}}
        return {k: {**s, "steps": args.steps} for k, s in v.items()}
    if stage == "budgets":
        layers = 2 if args.smoke else 30
        v = {"reference": {"layers": layers, "ac": True, "float8": f8}}
        for x in [x for x in args.budgets.split(",") if x]:  # "auto": the device's memory, uncapped
            b = "auto" if x == "auto" else float(x)
            v[f"budget_{b if b == 'auto' else f'{b:g}'}"] = {
                "layers": layers, "float8": f8, "cap_gb": None if args.smoke or b == "auto" else b,
                "set": {"memory.budget_gb": b}}
        if args.lora_budget:
            b = args.lora_budget
            v[f"lora_budget_{b:g}"] = {"layers": layers, "float8": f8, "cap_gb": None if args.smoke else b,
                                       "set": {"memory.budget_gb": b, "lora.rank": args.lora_rank}}
        return {k: {**s, "steps": args.steps} for k, s in v.items()}
    if stage == "quality":
        opts = {"adamw": {}, "8bit": {"optim.states": "8bit"}, "4bit": {"optim.states": "4bit"},
                "offload": {"optim.offload": "optimizer"}, "lora": {"lora.rank": args.lora_rank, "optim.lr": 1e-4}}
        if args.smoke or args.tiny:  # the optimizer on the host needs CUDA
            opts.pop("offload")
        return {k: {"layers": args.quality_layers, "float8": "off", "ac": False, "steps": args.steps, "lr": 1e-4,
                    "max_tokens": args.quality_tokens, "set": s} for k, s in opts.items()}
    raise ValueError(stage)


def fit(runs: dict[str, dict]) -> dict:
    """The per-token activation costs the calibration runs imply (GB = 1e9 bytes): a block's activations without
    checkpointing and its kept input with, from the difference between the 4- and 8-block runs (what does not
    grow with the blocks cancels); float8's share of bf16's; each optimizer option's update seconds per 10⁹
    trained parameters over AdamW's."""
    def act(name: str) -> float | None:
        r = runs.get(name, {})
        if not r.get("peak_mem_gb"):
            return None
        parts = r["est_parts"]  # the forward's end: what is not the activations (the gradients come later)
        return r["peak_mem_gb"] - parts["weights"] - parts["optimizer"] - parts.get("casts", 0.0) - parts["fixed"]

    out: dict = {}
    sizes = sorted({int(k.split("_")[0][1:]) for k in runs if k.startswith("L")})
    if len(sizes) < 2:
        return out
    lo, hi = sizes[0], sizes[-1]
    for tag in ("f8", "bf16"):
        a_lo, a_hi = act(f"L{lo}_ac0_{tag}"), act(f"L{hi}_ac0_{tag}")
        b_lo, b_hi = act(f"L{lo}_ac1_{tag}"), act(f"L{hi}_ac1_{tag}")
        ref = runs.get(f"L{hi}_ac0_{tag}") or runs.get(f"L{hi}_ac1_{tag}") or {}
        tokens, dim = ref.get("tokens"), ref.get("dim")
        if None in (a_lo, a_hi, tokens):
            continue
        full = (a_hi - a_lo) / (hi - lo) * 1e9 / tokens  # bytes per token of one block, not checkpointed
        out[f"block_bytes_per_token_{tag}"] = full
        out[f"rest_gb_{tag}"] = a_lo - lo * full * tokens / 1e9
        if b_lo is not None and b_hi is not None:
            kept = (b_hi - b_lo) / (hi - lo) * 1e9 / tokens
            out[f"kept_bytes_per_token_{tag}"] = kept
            out[f"kept_per_dim_{tag}"] = kept / dim
    if "block_bytes_per_token_f8" in out and "block_bytes_per_token_bf16" in out:
        out["float8_share"] = out["block_bytes_per_token_f8"] / out["block_bytes_per_token_bf16"]
    base = runs.get(f"L{hi}_ac1_f8", {})
    for key in ("8bit", "4bit", "optimizer", "optimizer+gradients", "lora16"):
        r = runs.get(f"L{hi}_ac1_f8_{key}", {})
        if base.get("step_s") and r.get("step_s"):
            out[f"extra_step_s_{key}"] = r["step_s"] - base["step_s"]
            out[f"update_s_per_gparam_{key}"] = (r["step_s"] - base["step_s"]) / (base["trained"] / 1e9)
    return out


def summarize(stage: str, runs: dict[str, dict], tag: str = "") -> dict:
    """Ratios the issue's targets read: each budget's tokens/s against the reference; each option's final loss
    (mean of the last 10 %) against AdamW's."""
    out: dict = {}
    if stage == "budgets" and runs.get("reference" + tag, {}).get("tokens_per_s"):
        ref = runs["reference" + tag]["tokens_per_s"]
        out = {k: r["tokens_per_s"] / ref for k, r in runs.items() if r.get("tokens_per_s") and k != "reference" + tag}
    if stage == "calibrate":
        out = fit(runs)
    if stage == "quality" and runs.get("adamw" + tag, {}).get("losses"):
        base = runs["adamw" + tag]["losses"]
        n = max(1, len(base) // 10)
        end = statistics.fmean(base[-n:])
        out = {k: statistics.fmean(r["losses"][-n:]) / end - 1 for k, r in runs.items() if r.get("losses")}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", default="budgets", choices=("calibrate", "budgets", "quality", "all"))
    p.add_argument("--budgets", default="130,80,48", help="GB each, comma-separated; 'auto': the device's memory")
    p.add_argument("--lora-budget", type=float, default=24.0)
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32768, help="tokens of one copy per pack (the 5B run's)")
    p.add_argument("--quality-layers", type=int, default=4)
    p.add_argument("--quality-tokens", type=int, default=16384)
    p.add_argument("--only", default="", help="comma-separated variant names of the stage (default all)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config value for every variant (e.g. model.overrides.attn_backend=flex-flash); repeatable")
    p.add_argument("--tag", default="", help="appended to every variant's name (runs of other settings side by side)")
    p.add_argument("--timeout", type=float, default=400.0, help="seconds per variant")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU: every code path, times nothing real")
    p.add_argument("--tiny", action="store_true", help="the tiny LingBot-VA preset on the CPU with the steps, tokens "
                   "and layers given (the quality stage without a GPU)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return
    import torch

    device = "cuda" if torch.cuda.is_available() and not (args.smoke or args.tiny) else "cpu"
    if args.smoke:
        args.max_tokens, args.quality_tokens, args.quality_layers = 256, 256, 2
        args.steps = min(args.steps, 4)
        args.budgets, args.lora_budget = "8", 8.0
    stages = ("calibrate", "budgets", "quality") if args.stage == "all" else (args.stage,)
    only = {x for x in args.only.split(",") if x}
    extra = dict(parse_set(x) for x in args.set)
    for stage in stages:
        cpu = args.smoke or args.tiny
        out = args.out or ROOT / "benchmarks" / "results" / f"memory_{stage}_{'cpu' if cpu else 'h200'}.json"
        result = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
                  "date": time.strftime("%Y-%m-%d"), "stage": stage, "command": " ".join(["python"] + sys.argv),
                  "max_tokens": args.max_tokens, "runs": {}}
        for name, spec in variants(stage, args).items():
            if only and name not in only:
                continue
            spec = {"max_tokens": args.max_tokens, **spec, "device": device, "smoke": args.smoke, "tiny": args.tiny,
                    "set": {**spec.get("set", {}), **extra}}
            name += args.tag
            r = spawn(spec, args.timeout)
            result["runs"][name] = {"spec": {k: v for k, v in spec.items() if k not in ("device", "smoke", "tiny")},
                                    **r}
            result["summary"] = summarize(stage, result["runs"], args.tag)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1))  # rewritten after each variant: a cut run keeps the rest
            tail = r.get("output_tail", "").strip().splitlines()[-3:]
            print(f"[{stage} {name}] " + (r.get("error", "")[:300] + "".join(f"\n  {x}" for x in tail) or
                  f"{r.get('plan_line', '')} peak {r['peak_mem_gb']:.1f} GB (est {r.get('plan', r).get('est_gb')}), "
                  f"reserved {r.get('peak_reserved_gb')}, {r['tokens_per_s']:.0f} tok/s, mfu {r.get('mfu')}, "
                  f"host {r['host_peak_gb']:.1f} GB, loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}, "
                  f"{r['wall_total_s']:.0f} s"), flush=True)
        print(f"[{stage}] summary {json.dumps(result.get('summary', {}))} -> {out}", flush=True)


if __name__ == "__main__":
    main()
