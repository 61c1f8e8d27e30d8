"""Loss curves of bf16 and float8 training on the same data and seed: does float8 train the same?

A Wan2.2-5B-shape model (``--layers`` blocks, default 4) trained through ``flexpack train``'s loop
(``flexpack.training.loop.train(run)``, the run composed over them) on ``train_step.py``'s synthetic in-memory episodes
(reference lengths, no lerobot), once per ``parallel.float8`` mode, from the same initial weights
(``runtime.seed``), the same packs in the same order and the same per-episode noise. Every step's
loss is logged; the JSON is rewritten after each mode, so a run cut short keeps the finished modes.

    python benchmarks/float8_loss.py --steps 150 --out benchmarks/results/float8_loss_h200.json
    python benchmarks/plot_float8_loss.py benchmarks/results/float8_loss_h200.json   # -> .png next to it
    python benchmarks/float8_loss.py --smoke        # CPU, tiny model, emulated float8: checks the script
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from flexpack.parallel import float8  # noqa: E402
from flexpack.run.compose import run_for  # noqa: E402
from flexpack.run.config import TrainConfig, from_dict  # noqa: E402
from flexpack.run.state import checkpoint  # noqa: E402
from flexpack.training import loop
from train_step import Items, length_sets  # noqa: E402


def tail_mean(losses: list[float], n: int) -> float:
    return statistics.fmean(losses[-n:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="off,tensorwise,rowwise")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--max-tokens", type=int, default=16384,
                   help="tokens per pack (smaller than a real run: more steps fit)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--set", dest="lengths", default="short", choices=("ref", "short"))
    p.add_argument("--compile", action="store_true", help="compiled blocks (default eager: no compile time per mode; "
                   "the float8 recipe and its numerics are the same)")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU with emulated float8: checks the code path")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/float8_loss_h200.json"))
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.layers, args.max_tokens, args.steps = 2, 512, min(args.steps, 4)
        float8.MIN_DIM = 16  # the tiny model's layers
        float8.check = lambda mode, dev: None  # emulated off CUDA
    C, H, W, L, Dt = (4, 4, 4, 6, 32) if args.smoke else (48, 8, 16, 512, 4096)
    lengths = length_sets(args.smoke)[args.lengths]
    items = Items(lengths, C, H, W, L, Dt)
    preset = "tiny" if args.smoke else "wan2.2-5b"
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "layers": args.layers,
               "max_tokens": args.max_tokens, "lr": args.lr, "set": args.lengths, "steps": args.steps,
               "compile": args.compile, "command": " ".join(sys.argv), "runs": {}}
    save = checkpoint.Checkpointer.save
    checkpoint.Checkpointer.save = lambda self, *a, **k: None  # the curves are the output, not the weights
    for mode in args.modes.split(","):
        out = tempfile.mkdtemp(prefix="flexpack-f8loss-")
        cfg = from_dict(TrainConfig, {
            "data": {"mode": "pack", "max_tokens": args.max_tokens, "num_workers": 0 if args.smoke else 4},
            "model": {"preset": preset, "overrides": {"num_layers": args.layers, "action_channels": 0}},
            "optim": {"lr": args.lr, "betas": [0.9, 0.95], "grad_clip": 1.0},
            "schedule": {"steps": args.steps, "warmup_steps": max(1, args.steps // 10), "decay": "constant"},
            "checkpoint": {"every": 0},
            "runtime": {"dtype": "bfloat16", "out_dir": out, "seed": 0, "device": str(device.type)},
            "parallel": {"float8": mode, "compile": args.compile},
            "log": {"progress": False, "tensorboard": False, "every": 1}})
        packs = run_for(items, cfg, device=device)  # the sampler, collate and forward options `flexpack train` builds
        t0 = time.perf_counter()
        try:
            res = loop.train(packs)
            rows = res.metrics
            run = {"losses": [r["loss"] for r in rows], "grad_norms": [r["grad_norm"] for r in rows],
                   "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[len(rows) // 4:]),
                   "layers_float8": len(float8.converted(res.model))}
        except Exception as exc:  # keep the other modes' curves
            run = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        finally:
            shutil.rmtree(out, ignore_errors=True)
        run["wall_s"] = time.perf_counter() - t0
        results["runs"][mode] = run
        base = results["runs"].get("off", {}).get("losses")
        for m, r in results["runs"].items():  # the end of each curve against bf16's (mean of the last 10 %)
            if base and r.get("losses") and m != "off":
                n = max(1, len(base) // 10)
                r["final_rel_diff_vs_bf16"] = tail_mean(r["losses"], n) / tail_mean(base, n) - 1
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
        print(f"[float8 {mode}] " + (run.get("error") or f"loss {run['losses'][0]:.4f} -> {run['losses'][-1]:.4f}, "
              f"{run['tokens_per_s']:.0f} tok/s, {run['layers_float8']} float8 layers, "
              + (f"vs bf16 {run['final_rel_diff_vs_bf16']:+.2%}, " if "final_rel_diff_vs_bf16" in run else "")
              + f"wall {run['wall_s']:.0f} s"), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    checkpoint.Checkpointer.save = save


if __name__ == "__main__":
    main()
