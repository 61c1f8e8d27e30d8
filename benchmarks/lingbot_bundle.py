r"""LingBot-VA post-training on an upstream bundle, three ways side by side (issue 44): upstream's own recipe at
batch 1, flexpack at batch 1, flexpack packed, at one global batch of segments per optimizer step.

Data: a synthetic bundle in upstream's layout (``flexpack.data.bundle_synthetic.write_bundle``: v2.1 metadata and
parquet, per-camera ``.pth`` latents per ``action_config`` segment, ``empty_emb.pt``) with RoboTwin's shapes: a
main camera of 16x20 latents and two wrists of 8x10, composed ``tshape`` (wrists side by side over the main) into
24x20 (120 video tokens a latent frame in 2x2 patches); segments of 5-40 latent frames (uniform, seeded), frame_ids
stride 4 (16 action steps a latent frame); 16 action columns scattered to RoboTwin's ``used_action_channel_ids``
of the 30-d action space, made relative as upstream's RoboTwin loader does (``relative_pose:0,8``); 512 x 4096 text
per segment. Every variant reads it through ``data.format = "lingbot-bundle"`` (``BundleDataset``) and trains the
same ``--global-batch`` segments in each optimizer step (one fixed, seeded plan of item indices).

Variants (``--variants``):

* ``recipe``: upstream's own training step (``benchmarks/lingbot_upstream.py``: its model with flex attention and
  its per-micro-step ``create_block_mask``, activation checkpointing on every block, its noise, loss, clip 2.0,
  fused AdamW and LambdaLR from ``wan_va/train.py``) imported from ``--upstream``, one segment per micro-step
  (batch 1) with gradient accumulation over the global batch; weights in bf16 (its ``_configure_model`` casts to
  ``param_dtype`` when not sharded: one GPU, no FSDP; under FSDP2 its mixed-precision policy computes with bf16
  weights too, but keeps fp32 master weights and optimizer state: this run's optimizer step is the cheaper bf16
  one).
* ``batch1``: flexpack's ``train_step`` (``lingbot-va`` family: fp32 weights, bf16 autocast, Triton flex attention
  from the layout, fused AdamW) in pad mode, one segment per micro-batch (frames padded up to a multiple of
  ``--pad-multiple``), accumulating over the global batch: what packing alone buys. Its blocks compile as
  ``--batch1-compile`` says; the default ``auto`` is flexpack's own rule (compiled in pack mode only: pad mode's
  many shapes would each compile, ~5 at 5-40 frames padded to 8), so by default they run eagerly.
* ``packed``: the same step on packs of whole segments, blocks compiled: each optimizer step's segments bin-packed
  (``flexpack.packing.bins.pack_bins``) into micro-batches of the ``data.max_tokens`` budget, one shape.

Measured: ``--warmup`` optimizer steps (compiles), then the median of ``--steps`` timed optimizer steps (CUDA
events, no sync between steps). ``useful_tokens_per_s`` counts latent frames x (video tokens + action tokens) of one
copy (benchmarks/lingbot_va.py's count; both copies are computed), the same segments for all three; ``mfu``: useful
FLOPs (``flexpack.training.observe.flops``: linear layers on valid tokens, self-attention on the pairs LingBot-VA's
mask keeps for the chunk size and window each micro-step drew, cross-attention on 512 text tokens) over an 8192^3
bf16 matmul measured in this run; ``peak_mem_gb`` after the warm-up; ``recompiles_after_warmup``: dynamo graphs
compiled during the timed steps (flexpack's own counter beside it); ``pad_fraction``: computed tokens that are pad.

    python benchmarks/lingbot_bundle.py --upstream .upstream-lingbot-va               # GPU: 5B width, 4 layers
    python benchmarks/lingbot_bundle.py --upstream .upstream-lingbot-va --layers 30 --activation-checkpointing true
    python benchmarks/lingbot_bundle.py --upstream /tmp/lingbot-va --smoke --out /tmp/lb.json   # CPU, tiny shapes

``benchmarks/lingbot_bundle_h200.sh`` prepares the upstream checkout and wheels and runs it on the GPU machine.
``--smoke`` runs every path at tiny shapes on the CPU, where FlexAttention has no backward: upstream's flex
attention becomes SDPA over the same mask (``lingbot_upstream.dense_flex``), flexpack's the dense backend; its
numbers time nothing real. Stubbed modules (unused imports of upstream's code) are listed in the JSON.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch._dynamo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from diffusers_step import _dynamo_graphs  # noqa: E402
from flexpack.data.bundle_synthetic import SyntheticDataset, write_bundle  # noqa: E402
from flexpack.families.lingbot.objective import lingbot_pairs  # noqa: E402
from flexpack.packing.bins import pack_bins  # noqa: E402
from flexpack.parallel.parallelize import compiled_graphs  # noqa: E402
from flexpack.run.compose import build_run  # noqa: E402
from flexpack.run.config import TrainConfig, from_dict  # noqa: E402
from flexpack.training.observe.flops import UsefulFlops, flops_breakdown, measured_bf16_peak  # noqa: E402
from flexpack.training.optim import build_optimizer  # noqa: E402
from flexpack.training.step import train_step  # noqa: E402
from lingbot_va import save  # noqa: E402
from train_step import _event_times, _peak_gb, _peak_reset, _sync, parse_ac  # noqa: E402

CAMERAS = ("observation.images.cam_high", "observation.images.cam_left_wrist", "observation.images.cam_right_wrist")
ROBOTWIN_CHANNELS = (*range(0, 7), 28, *range(7, 14), 29)  # upstream's va_robotwin_cfg.used_action_channel_ids
ACTION_STEPS = 16  # action steps per latent frame: frame_ids stride 4 x the VAE's temporal stride 4
TEXT_TOKENS = 512  # upstream's init_mask builds the text mask for 512 tokens a segment
SEGMENTS_PER_EPISODE = 3
COMPILE = {"auto": "auto", "true": True, "false": False}  # --batch1-compile -> parallel.compile
VARIANTS = ("packed", "batch1", "recipe")  # flexpack first: upstream's init_mask sets a global inductor option
RECOMPILE_LIMIT = torch._dynamo.config.recompile_limit  # dynamo's default, before flexpack raises it


def shapes(smoke: bool) -> dict:
    """Latent grids per camera (h, w), segment lengths (latent frames) and text width."""
    if smoke:
        return {"grids": ((4, 4), (2, 2), (2, 2)), "frames": (2, 6), "text_dim": 64}
    return {"grids": ((16, 20), (8, 10), (8, 10)), "frames": (5, 40), "text_dim": 4096}


def segment_frames(n: int, smoke: bool, seed: int) -> list[int]:
    lo, hi = shapes(smoke)["frames"]
    return np.random.default_rng(seed).integers(lo, hi + 1, n).tolist()


def write_synthetic(root: Path, frames: list[int], smoke: bool, seed: int) -> Path:
    """A RoboTwin-shaped bundle whose segments have ``frames`` latent frames, ``SEGMENTS_PER_EPISODE`` consecutive
    segments an episode: a segment of F latent frames spans 16 (F - 1) + 1 video frames (4 (F - 1) + 1 encoded
    frames at stride 4)."""
    episodes = []
    for k in range(0, len(frames), SEGMENTS_PER_EPISODE):
        segs, start = [], 0
        for f in frames[k:k + SEGMENTS_PER_EPISODE]:
            segs.append((start, start + ACTION_STEPS * (f - 1) + 1))
            start = segs[-1][1]
        episodes.append(segs)
    sh = shapes(smoke)
    spec = SyntheticDataset(name="robotwin/synthetic", episodes=episodes, cameras=dict(zip(CAMERAS, sh["grids"])),
                            action_columns=len(ROBOTWIN_CHANNELS), stride=4)
    return write_bundle(root, [spec], text=(TEXT_TOKENS, sh["text_dim"]), seed=seed)


def config(args: argparse.Namespace, variant: str) -> TrainConfig:
    over = {"num_layers": args.layers, "attn_backend": "dense" if args.smoke else "auto",
            "action_per_frame": ACTION_STEPS, "used_action_channel_ids": list(ROBOTWIN_CHANNELS),
            "obs_cam_keys": list(CAMERAS), "action_snr_shift": 1.0, "frame_chunk_size": 2, "attn_window": 72}
    mode = "pack" if variant == "packed" else "pad"
    return from_dict(TrainConfig, {
        "data": {"root": str(args.bundle), "format": "lingbot-bundle", "camera_layout": "tshape",
                 "action_transform": "relative_pose:0,8", "action_steps": ACTION_STEPS, "stride": ACTION_STEPS,
                 "mode": mode, "max_tokens": args.max_tokens, "batch_size": 1, "pad_multiple": args.pad_multiple},
        "model": {"family": "lingbot-va", "preset": "lingbot-va-tiny" if args.smoke else "lingbot-va-5b",
                  "overrides": over},
        # upstream's robotwin_train optimizer: lr 1e-5, betas (0.9, 0.95), weight decay 0.1, clip 2.0
        "optim": {"lr": 1e-5, "betas": [0.9, 0.95], "weight_decay": 0.1, "grad_clip": 2.0},
        "runtime": {"dtype": "bfloat16"}, "log": {"progress": False},
        "parallel": {"compile": "auto" if variant == "packed" else COMPILE[args.batch1_compile], "float8": args.float8,
                     "activation_checkpointing": args.activation_checkpointing},
    })


def plan(n_items: int, args: argparse.Namespace) -> list[list[int]]:
    """Item indices of every optimizer step (warm-up first): a seeded permutation cut into global batches."""
    need = args.global_batch * (args.warmup + args.steps)
    order = np.random.default_rng(args.seed).permutation(n_items)
    return [[int(i) for i in order[k:k + args.global_batch]] for k in range(0, need, args.global_batch)]


def micro_batches(variant: str, step: list[int], lengths: list[int], run, k: int, seed: int) -> list[list[int]]:
    """One optimizer step's micro-batches: a segment each (batch1) or bin-packed to the run's frame budget."""
    if variant != "packed":
        return [[i] for i in step]
    bins = pack_bins([lengths[i] for i in step], run.sampler.budget_frames, rng=np.random.default_rng(seed + k))
    return [[step[j] for j in b] for b in bins]


class ItemCache:
    """Dataset items read once and shared by the variants (the same bundle, read the same way)."""

    def __init__(self) -> None:
        self.items: dict[int, dict] = {}

    def get(self, ds, i: int) -> dict:
        if i not in self.items:
            self.items[i] = ds[i]
        return self.items[i]


def summary(times: list[float], tokens: list[int], flops: list[float], peak: float, device) -> dict:
    return {"step_s": statistics.median(times), "useful_tokens_per_s": statistics.median(n / t for n, t in
                                                                                          zip(tokens, times)),
            "mfu": statistics.median(f / t / peak for f, t in zip(flops, times)),
            "useful_tokens_per_step": statistics.median(tokens), "peak_mem_gb": _peak_gb(device)}


def run_flexpack(args, variant: str, steps: list[list[int]], cache: ItemCache, device, peak: float) -> dict:
    cfg = config(args, variant)
    run = build_run(cfg, device=device)
    lengths, tpf = run.dataset.lengths(), run.geometry.tokens_per_frame
    micro = [micro_batches(variant, s, lengths, run, k, args.seed) for k, s in enumerate(steps)]
    made = [[run.collate([cache.get(run.dataset, i) for i in mb]) for mb in m] for m in micro]
    if device.type == "cuda":
        made = [[b.pin_memory() for b in m] for m in made]
    model = run.build_model()
    opt = build_optimizer(model, cfg.optim, fused=device.type == "cuda")
    for k in range(args.warmup):
        train_step(model, opt, made[k], run, step=k)
    _sync(device)
    graphs, ours = _dynamo_graphs(), compiled_graphs()
    _peak_reset(device)
    w = args.warmup
    times, sums = _event_times(lambda k: train_step(model, opt, made[w + k], run, step=w + k)[0], args.steps, device)
    useful = UsefulFlops(run.model_config, run.geometry, objective=run.objective, seed=cfg.runtime.seed)
    timed = made[w:]
    tokens = [sum(int(b.layout.episode_frames.sum()) for b in m) * tpf for m in timed]
    computed = [sum(b.layout.frame_doc.numel() for b in m) * tpf for m in timed]
    flops = [sum(useful(b.layout, w + k) for b in m) for k, m in enumerate(timed)]
    losses = [float(s[0]) for s in sums]
    out = summary(times, tokens, flops, peak, device)
    out.update(recompiles_after_warmup=_dynamo_graphs() - graphs, flexpack_graphs_after_warmup=compiled_graphs() - ours,
               micro_batches_per_step=statistics.mean(len(m) for m in micro),
               pad_fraction=1.0 - sum(tokens) / sum(computed), params=sum(p.numel() for p in model.parameters()),
               weights="float32 (bf16 autocast)", float8=cfg.parallel.float8,
               activation_checkpointing=cfg.parallel.activation_checkpointing, compiled=run.parallel.compile,
               mode=cfg.data.mode, max_tokens=cfg.data.max_tokens if variant == "packed" else None,
               losses=losses, finite=bool(np.isfinite(losses).all()))
    return out


def run_recipe(args, steps: list[list[int]], cache: ItemCache, device, peak: float) -> dict:
    import lingbot_upstream as lu

    # dynamo's default recompile limit, as users run upstream (flexpack's compiled blocks raised it for themselves)
    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    up = lu.load(args.upstream)
    if tuple(up.config.used_action_channel_ids) != ROBOTWIN_CHANNELS or up.config.patch_size != (1, 2, 2):
        raise ValueError(f"upstream's {lu.CONFIG} config changed: used_action_channel_ids "
                         f"{up.config.used_action_channel_ids}, patch_size {up.config.patch_size}")
    if device.type == "cpu":
        lu.use_cpu_attention(up)
    run = build_run(config(args, "batch1"), device=device)  # the same items, geometry and model shape
    tpf, nv, na = run.geometry.tokens_per_frame, run.geometry.video_tokens, run.geometry.action_tokens
    recipe = lu.Recipe(up, run.model_config, args.global_batch, device)
    batches = [[lu.upstream_batch(cache.get(run.dataset, i)) for i in s] for s in steps]
    for k in range(args.warmup):
        recipe.optimizer_step(batches[k])
    _sync(device)
    graphs = _dynamo_graphs()
    _peak_reset(device)
    first = len(recipe.drawn)
    w = args.warmup
    times, sums = _event_times(lambda k: recipe.optimizer_step(batches[w + k]), args.steps, device)
    lengths = run.dataset.lengths()
    tokens = [sum(lengths[i] for i in s) * tpf for s in steps[w:]]
    drawn = recipe.drawn[first:]
    flops = []
    for k, s in enumerate(steps[w:]):
        per = zip(s, drawn[k * len(s):(k + 1) * len(s)])
        flops.append(sum(flops_breakdown(run.model_config, [lengths[i]], TEXT_TOKENS, video_tokens=nv,
                                         action_tokens=na, copies=2,
                                         pairs=[lingbot_pairs(lengths[i], nv, na, c, win)]).total
                         for i, (c, win) in per))
    losses = [float(s) for s in sums]
    out = summary(times, tokens, flops, peak, device)
    padded = sum(-(-lengths[i] * 2 * tpf // 128) * 128 for s in steps[w:] for i in s)  # upstream pads to 128
    out.update(recompiles_after_warmup=_dynamo_graphs() - graphs, micro_batches_per_step=args.global_batch,
               pad_fraction=1.0 - 2 * sum(tokens) / padded, params=recipe.params,
               weights=str(up.config.param_dtype).removeprefix("torch."), activation_checkpointing="every block "
               "(upstream's apply_ac)", compiled="flex_attention and create_block_mask only (as upstream)",
               fsdp=False, recompile_limit=RECOMPILE_LIMIT, source="upstream", upstream_commit=up.commit,
               upstream_config=lu.CONFIG,
               stubbed_modules=up.stubbed, losses=losses, finite=bool(np.isfinite(losses).all()),
               cpu_attention="SDPA over the block mask's dense mask" if device.type == "cpu" else None)
    return out


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("FLEXPACK_COMMIT", "unknown")


def ratios(results: dict) -> dict:
    """Useful tokens/s of one variant over another's (this run's, so one device); the parameter counts compared
    (upstream's model and flexpack's lingbot-va are the same model, parameter for parameter)."""
    v = results["variants"]
    tok = {k: r.get("useful_tokens_per_s") for k, r in v.items()}

    def ratio(a: str, b: str) -> float | None:
        return tok[a] / tok[b] if tok.get(a) and tok.get(b) else None

    params = {r["params"] for r in v.values() if "params" in r}
    return {"packed_vs_recipe": ratio("packed", "recipe"), "packed_vs_batch1": ratio("packed", "batch1"),
            "batch1_vs_recipe": ratio("batch1", "recipe"), "params_match": len(params) == 1 if params else None}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--upstream", type=Path, default=None, help="checkout of robbyant/lingbot-va (recipe variant)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {VARIANTS}")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=32, help="segments per optimizer step")
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per variant")
    p.add_argument("--warmup", type=int, default=1, help="optimizer steps before timing")
    p.add_argument("--max-tokens", type=int, default=32768, help="packed: data.max_tokens (one copy)")
    p.add_argument("--pad-multiple", type=int, default=8, help="batch1: frames padded up to a multiple of this")
    p.add_argument("--batch1-compile", default="auto", choices=("auto", "true", "false"),
                   help="batch1: parallel.compile (auto: flexpack's rule, off in pad mode)")
    p.add_argument("--float8", default="off", help="parallel.float8 of the flexpack variants")
    p.add_argument("--activation-checkpointing", type=parse_ac, default=False, metavar="true|false|N|selective",
                   help="parallel.activation_checkpointing of the flexpack variants (upstream's: every block)")
    p.add_argument("--bundle", type=Path, default=None, help="bundle folder: written there when absent "
                   "(default: a temporary folder)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU: every path, nothing timed for real")
    p.add_argument("--out", type=Path, default=None, help="results JSON (default benchmarks/results/"
                   "lingbot_bundle_h200.json on CUDA; required with --smoke or without CUDA)")
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    if bad := sorted(set(args.variants) - set(VARIANTS)):
        p.error(f"--variants: unknown {bad}; use {VARIANTS}")
    if "recipe" in args.variants and not any((args.upstream or Path("/nonexistent")).joinpath(*sub).is_file()
                                             for sub in (("wan_va", "train.py"), ("train.py",))):
        p.error(f"--upstream {args.upstream}: the recipe variant needs a checkout of robbyant/lingbot-va (its "
                "wan_va/train.py), or leave recipe out of --variants")
    if args.smoke:
        args.layers, args.global_batch, args.steps, args.warmup, args.max_tokens = 2, 4, 1, 1, 352
    cuda = torch.cuda.is_available() and not args.smoke
    if args.out is None:
        if not cuda:
            p.error("--out is required off the GPU (the default file holds GPU results)")
        args.out = Path("benchmarks/results/lingbot_bundle_h200.json")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    peak = measured_bf16_peak(device) if device.type == "cuda" else 1e12  # CPU: a placeholder, no real MFU
    n_items = args.global_batch * (args.warmup + args.steps)
    tmp = None
    if args.bundle is None:
        tmp = tempfile.TemporaryDirectory(prefix="lingbot-bundle-")
        args.bundle = Path(tmp.name) / "bundle"
    if not (args.bundle / "empty_emb.pt").is_file():
        t0 = time.perf_counter()
        write_synthetic(args.bundle, segment_frames(n_items, args.smoke, args.seed), args.smoke, args.seed)
        print(f"[bundle] {n_items} segments written to {args.bundle} in {time.perf_counter() - t0:.0f} s", flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    command = " ".join(["python", *(sys.argv if argv is None else ["benchmarks/lingbot_bundle.py", *argv])])
    results = {"command": command, "device": name, "date": time.strftime("%Y-%m-%d"), "commit": commit(),
               "torch": torch.__version__, "smoke": args.smoke, "layers": args.layers,
               "global_batch": args.global_batch, "warmup_steps": args.warmup, "timed_steps": args.steps,
               "bf16_matmul_tflops": peak / 1e12,
               "bundle": {"cameras": dict(zip(CAMERAS, shapes(args.smoke)["grids"])), "layout": "tshape",
                          "segment_frames": list(shapes(args.smoke)["frames"]), "action_steps": ACTION_STEPS,
                          "text": [TEXT_TOKENS, shapes(args.smoke)["text_dim"]], "segments": n_items},
               "variants": {}}
    cache = ItemCache()
    steps = None
    for variant in [v for v in VARIANTS if v in args.variants]:
        if steps is None:
            steps = plan(len(build_run(config(args, "batch1"), device=device).dataset), args)
        try:
            r = (run_recipe(args, steps, cache, device, peak) if variant == "recipe"
                 else run_flexpack(args, variant, steps, cache, device, peak))
        except Exception as exc:  # keep the other variants' numbers; say what failed
            r = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        r["device"] = name
        results["variants"][variant] = r
        print(f"[{variant}] " + (r.get("error") or f"{r['useful_tokens_per_s']:.0f} useful tok/s, mfu {r['mfu']:.3f}, "
              f"peak {r['peak_mem_gb']} GB, recompiles {r['recompiles_after_warmup']}, "
              f"{r['micro_batches_per_step']:.1f} micro-batches/step, pad {r['pad_fraction']:.3f}"), flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        results.update(ratios(results))
        save(args.out, results)
    print({k: results[k] for k in ("packed_vs_recipe", "packed_vs_batch1", "batch1_vs_recipe")}, flush=True)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
