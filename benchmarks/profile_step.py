"""Where a training step's time goes: ``profile.steps`` on the Wan2.2-5B shape with a few layers.

Runs the real train loop (:func:`flexpack.training.loop.train`: sampler, pack collate, noise, forward,
backward, AdamW, logging) with ``profile.steps = --steps`` over in-memory episodes (random latents
and text of the right shapes; lengths from ``data/episode_frames_ref.txt``), then prints the
profile summary: shares of device time per category, MFU, tokens/s, forward/backward seconds per
micro-step. The schedule is exactly warm-up + 1 + steps long, so the window ends with the run.

    python benchmarks/profile_step.py --out $OUT/profile_step          # GPU: wan2.2-5b, 4 layers, 65,536-token packs
    python benchmarks/profile_step.py --smoke                          # CPU: tiny preset, small packs (API check)

Shape (GPU run): two 128x128 cameras through a 16x VAE and 2x2 patches = 32 video tokens per latent
frame (an 8 x 16 latent), 4 action steps, 36 tokens per frame, 512 umT5 text tokens (4096 wide) per
episode, bf16 autocast, one GPU. MFU counts useful FLOPs (:mod:`flexpack.training.observe.flops`) against the
bf16 peak an 8192³ matmul reaches at the start (the run's ``profile.peak_tflops`` unset; H200: 733–795).
The run folder keeps ``profile/`` (trace, per-micro-step lines, summary), ``metrics.jsonl`` and
``tb/``; the final checkpoint is removed (it is not what is measured).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flexpack.packing.lengths import read_frames_file  # noqa: E402
from flexpack.run.compose import run_for  # noqa: E402
from flexpack.run.config import load_config  # noqa: E402
from flexpack.run.memory_data import RandomEpisodes  # noqa: E402
from flexpack.run.resolve import model_config_of  # noqa: E402
from flexpack.training.observe.profile_summary import CATEGORIES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny preset on CPU, small packs: checks the script runs")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=3, help="profiled steps (profile.steps)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up steps before them (profile.warmup)")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--mask", default="document", choices=("document", "chunk_causal"))
    ap.add_argument("--eager", action="store_true", help="parallel.compile=false (default: the train loop's own "
                    "choice, compiled blocks on CUDA)")
    ap.add_argument("--frames-file", default=str(ROOT / "data" / "episode_frames_ref.txt"))
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "profile_step"), help="run folder")
    args = ap.parse_args()

    cuda = torch.cuda.is_available() and not args.smoke
    if args.smoke:
        overrides = ["model.preset='tiny'", "model.overrides={attn_backend='dense', in_channels=48, text_dim=64, "
                     "action_channels=6}", "data.max_tokens=400", "runtime.device='cpu'", "runtime.dtype='float32'"]
        hw, text_len, text_dim, lengths = (2, 2), 16, 64, [3, 5, 8, 13, 21, 9, 4, 7] * 4
        steps, warmup = min(args.steps, 2), min(args.warmup, 1)
    else:
        overrides = [f"model.overrides={{attn_backend='auto', num_layers={args.layers}}}",
                     f"data.max_tokens={args.max_tokens}", f"runtime.dtype='{'bfloat16' if cuda else 'float32'}'"]
        hw, text_len, text_dim = (8, 16), 512, 4096  # two 8 x 8 camera latents side by side
        lengths = read_frames_file(args.frames_file)
        steps, warmup = args.steps, args.warmup
    if args.mask != "document":
        overrides += [f"model.mask='{args.mask}'", "model.chunk_size=4"]
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)  # a fresh run: never resume an earlier measurement
    total = warmup + 1 + steps
    cfg = load_config(ROOT / "configs" / "wan5b_pack.toml", overrides + [
        f"runtime.out_dir='{out}'", f"schedule.steps={total}", "schedule.warmup_steps=1", "checkpoint.every=0",
        "log.every=1", "log.tensorboard=false", "parallel.activation_checkpointing=false",
        f"optim.accum_steps={args.accum}", f"profile.steps={steps}", f"profile.warmup={warmup}",
        "data.num_workers=2" if cuda else "data.num_workers=0"] + (["parallel.compile=false"] if args.eager else []))
    m = model_config_of(cfg)
    dataset = RandomEpisodes(lengths, channels=m.in_channels, hw=hw, action_channels=m.action_channels,
                             action_steps=cfg.data.action_steps, text_len=text_len, text_dim=text_dim,
                             mask_drop=0.0)  # every action value counts, as before
    run = run_for(dataset, cfg)  # the train loop's sampler, collate, geometry and forward options
    tpf = run.geometry.tokens_per_frame

    from flexpack.training import loop

    loop.train(run)  # profile.steps / profile.warmup: the library reads no environment variable
    shutil.rmtree(out / "checkpoints", ignore_errors=True)

    s = json.loads((out / "profile" / "summary_rank0.json").read_text())
    lines = [json.loads(x) for x in (out / "profile" / "steps_rank0.jsonl").read_text().splitlines()]
    prof = [x for x in lines if x["phase"] == "profiled"]
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{m.num_layers} layers of {cfg.model.preset}, {cfg.data.max_tokens} tokens per pack, "
          f"{tpf} tokens per frame, "
          f"{args.mask} mask, {'eager' if args.eager else 'parallel.compile=' + str(cfg.parallel.compile)}, {name}; "
          f"time base: {s['time_base']}")
    print("| " + " | ".join(CATEGORIES) + " | MFU | tokens/s | fwd s | bwd s |")
    print("|" + "---|" * (len(CATEGORIES) + 4))
    mfu = "—" if s["mfu"] is None else f"{100 * s['mfu']:.1f} %"
    med = {k: statistics.median(x[k] for x in prof) for k in ("fwd_s", "bwd_s")}
    print("| " + " | ".join(f"{100 * s['categories'][c]:.1f} %" for c in CATEGORIES)
          + f" | {mfu} | {s['tokens_per_s']:,.0f} | {med['fwd_s']:.3f} | {med['bwd_s']:.3f} |")
    result = {"device": name, "preset": cfg.model.preset, "layers": m.num_layers, "max_tokens": cfg.data.max_tokens,
              "tokens_per_frame": tpf, "mask": args.mask, "compile": not args.eager, "summary": s, "micro_steps": lines}
    (out / "profile_step.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out / 'profile_step.json'} (trace: {out / 'profile' / 'trace_rank0.json'})")


if __name__ == "__main__":
    main()
