r"""LingBot-VA training steps side by side: LeRobot's own step as it ships against flexpack's packed step.

LeRobot (``lerobot.policies.lingbot_va``): ``LingBotVAPolicy.training_loss_from_streams`` on precomputed
latents and text embeddings (its per-step VAE and UMT5 encoding is not charged), with its compiled flex
attention and ``init_mask`` (a ``create_block_mask`` over the whole batch every step), on batches of
``frame_chunk_size`` (4-latent-frame) clips, then backward, grad clipping and its AdamW (bf16 weights, as its
``dtype`` default builds the policy). Batches tried: a probe (``--lerobot-probe``), four times it, and the largest
that fits (the batch that fills ~90 % of the GPU by the probe's memory per clip, smaller on out-of-memory); the
fastest is reported, with every batch tried (``--lerobot-batch`` skips the search). Its clips are all one shape,
so one measurement serves every length set.

flexpack: ``train_step`` of the ``lingbot-va`` family (fp32 weights, bf16 autocast, compiled blocks,
Triton flex attention with the block mask built from the layout, fused AdamW) on packs of whole episodes of
the reference lengths (``data/episode_frames_ref.txt``) and the short set, in bf16 and float8 (``--float8``).
Both at the 5B width (the ``lingbot-va-5b`` preset) with ``--layers`` layers; 2 cameras of 128x128 (32
video tokens per latent frame) and 4 action steps per frame, 30 action channels (7 filled), 512 text tokens.

Tokens/s count useful tokens: latent frames x 36 tokens of one copy, for both (each trains a noisy and a clean
copy of every frame). MFU counts useful FLOPs (``flexpack.training.observe.flops.UsefulFlops``, as
metrics.jsonl's ``mfu``) with self-attention on the pairs LingBot-VA's mask keeps for each episode's drawn chunk
size and window (``flexpack.families.lingbot.objective.lingbot_pairs``), not the document mask's n², against an
8192^3 bf16 matmul measured in the same run. Recompiles: graphs compiled after the warm-up (flexpack's counter;
dynamo's for
LeRobot).

    python benchmarks/lingbot_va.py                                  # H200: ref + short, bf16 + float8 tensorwise
    python benchmarks/lingbot_va.py --sets short --lerobot-batch 64  # no batch search
    python benchmarks/lingbot_va.py --smoke                          # CPU, tiny shapes: checks the code paths
    python benchmarks/lingbot_va.py --lerobot-mfu                    # CPU: LeRobot's MFU from the recorded run
    python benchmarks/lingbot_va.py --full-5b-metrics RUN/metrics.jsonl --full-5b-command "..."   # adds full_5b

On the CPU (``--smoke``) LeRobot's step runs forward only, with eager flex attention (FlexAttention has no
CPU backward). ``benchmarks/train_lingbot5b.sh`` runs the full 30-layer model through ``flexpack train``
and calls this script with ``--full-5b-metrics``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from diffusers_step import _dynamo_graphs  # noqa: E402
from flexpack.families.lingbot.objective import lingbot_pairs  # noqa: E402
from flexpack.models.registry import family  # noqa: E402
from flexpack.parallel.parallelize import compiled_graphs  # noqa: E402
from flexpack.run.compose import run_for  # noqa: E402
from flexpack.run.config import TrainConfig, from_dict  # noqa: E402
from flexpack.training.observe.flops import UsefulFlops, flops_breakdown, measured_bf16_peak  # noqa: E402
from flexpack.training.optim import build_optimizer  # noqa: E402
from flexpack.training.step import train_step  # noqa: E402
from train_step import (  # noqa: E402
    Items,
    _event_times,
    _peak_gb,
    _peak_reset,
    _sync,
    length_sets,
    parse_ac,
)

CLIP_FRAMES = 4  # LeRobot's frame_chunk_size: latent frames per training clip
ACTION_STEPS = 4  # action tokens per latent frame and copy


def shape(smoke: bool) -> tuple[int, int, int, int, int]:
    """(latent channels, latent H, latent W, text tokens, text width) of the benchmark's episodes; the H200 shape
    is 2 cameras of 128x128 joined on width (32 video tokens a frame in 2x2 patches)."""
    return (48, 4, 4, 512, 64) if smoke else (48, 8, 16, 512, 4096)


def lerobot_flops_per_token(layers: int, smoke: bool) -> float:
    """Useful FLOPs (forward + backward) per token of one copy of LeRobot's step, counted as flexpack's
    (``flexpack.training.observe.flops``, both copies, the lingbot mask's pairs), averaged over the chunk sizes
    and windows LeRobot draws (uniform over the family's ``chunk_range`` and ``window_range``): each
    ``CLIP_FRAMES``-frame clip is one episode with its own ``text_len`` text tokens."""
    preset = "lingbot-va-tiny" if smoke else "lingbot-va-5b"
    m = family("lingbot-va").config(preset, num_layers=layers)
    _, H, W, text_len, _ = shape(smoke)
    nv, na = (H // m.patch_size[1]) * (W // m.patch_size[2]), ACTION_STEPS
    per = [flops_breakdown(m, [CLIP_FRAMES], [text_len], video_tokens=nv, action_tokens=na, copies=2,
                           pairs=[lingbot_pairs(CLIP_FRAMES, nv, na, c, w)]).total
           for c in range(m.chunk_range[0], m.chunk_range[1] + 1)
           for w in range(m.window_range[0], m.window_range[1] + 1)]
    return statistics.mean(per) / (CLIP_FRAMES * (nv + na))


def lerobot_mfu(tokens_per_s: float, layers: int, smoke: bool, peak_flops: float) -> float:
    """LeRobot's MFU at ``tokens_per_s``: its useful FLOPs (:func:`lerobot_flops_per_token`) over ``peak_flops``."""
    return tokens_per_s * lerobot_flops_per_token(layers, smoke) / peak_flops


class LingbotItems(Items):
    """The benchmark's synthetic items with LeRobot's action layout: 30 channels, the first 7 filled."""

    def __getitem__(self, i: int) -> dict:
        item = super().__getitem__(i)
        item["action_mask"][7:] = False
        item["action"][7:] = 0.0
        return item


def config(args: argparse.Namespace, float8: str) -> TrainConfig:
    over = {"num_layers": args.layers, "attn_backend": "dense" if args.smoke else "auto"}
    return from_dict(TrainConfig, {
        "data": {"mode": "pack", "max_tokens": args.max_tokens, "action_steps": ACTION_STEPS},
        "model": {"family": "lingbot-va", "preset": "lingbot-va-tiny" if args.smoke else "lingbot-va-5b",
                  "overrides": over},
        "optim": {"lr": 1e-5, "betas": [0.9, 0.95], "weight_decay": 1e-4, "grad_clip": 1.0},
        "runtime": {"dtype": "bfloat16"}, "log": {"progress": False},
        "parallel": {"compile": not args.smoke, "float8": float8,
                     "activation_checkpointing": args.activation_checkpointing},
    })


def run_flexpack(args, items: LingbotItems, float8: str, device: torch.device, peak: float) -> dict:
    cfg = config(args, float8)
    run = run_for(items, cfg, device=device)
    packs = list(run.sampler)[: args.warmup + args.steps]
    made = [run.collate([items[i] for i in b]) for b in packs]
    if device.type == "cuda":
        made = [b.pin_memory() for b in made]
    model = run.build_model()
    opt = build_optimizer(model, cfg.optim, fused=device.type == "cuda")
    for k in range(args.warmup):
        train_step(model, opt, [made[k]], run, step=k)
    _sync(device)
    graphs = compiled_graphs()
    _peak_reset(device)
    timed = made[args.warmup:]
    first = args.warmup
    times, sums = _event_times(lambda k: train_step(model, opt, [timed[k]], run, step=first + k)[0], len(timed),
                               device)
    tpf = run.geometry.tokens_per_frame
    tokens = [int(b.layout.episode_frames.sum()) * tpf for b in timed]
    useful = UsefulFlops(run.model_config, run.geometry, objective=run.objective, seed=cfg.runtime.seed)
    flops = [useful(b.layout, first + k) for k, b in enumerate(timed)]  # the chunks and windows the steps drew
    losses = [float(s[0]) for s in sums]
    out = {"tokens_per_s": statistics.median(n / t for n, t in zip(tokens, times)),
           "step_s": statistics.median(times), "mfu": statistics.median(f / t / peak for f, t in zip(flops, times)),
           "peak_mem_gb": _peak_gb(device), "recompiles_after_warmup": compiled_graphs() - graphs,
           "tokens_per_step": statistics.median(tokens), "episodes_per_pack": statistics.mean(len(b) for b in packs),
           "float8": float8, "finite": bool(np.isfinite(losses).all()), "losses": losses}
    return out


def lerobot_policy(args, device: torch.device):
    """LeRobot's policy at the benchmark's shape (its training attention: attn_mode 'flex') and its AdamW."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.lingbot_va.configuration_lingbot_va import LingBotVAConfig
    from lerobot.policies.lingbot_va.modeling_lingbot_va import LingBotVAPolicy

    shape = (dict(num_attention_heads=2, attention_head_dim=32, text_dim=64, freq_dim=32, ffn_dim=128)
             if args.smoke else {})
    cfg = LingBotVAConfig(num_layers=args.layers, attn_mode="flex", device=device.type, **shape,
                          input_features={"observation.images.image": PolicyFeature(type=FeatureType.VISUAL,
                                                                                   shape=(3, 128, 128))})
    torch.manual_seed(0)
    policy = LingBotVAPolicy(cfg).to(device)
    preset = cfg.get_optimizer_preset()
    opt = torch.optim.AdamW(policy.get_optim_params(), lr=preset.lr, betas=preset.betas, eps=preset.eps,
                            weight_decay=preset.weight_decay)
    return policy, opt, cfg


def run_lerobot(args, B: int, policy, opt, cfg, shape: tuple[int, int, int, int], device: torch.device) -> dict:
    """LeRobot's step on batches of B clips: warm-up, then the median of ``--lerobot-steps`` steps."""
    C, H, W, L = shape
    g = torch.Generator(device="cpu").manual_seed(B)
    dt = policy.dtype
    lat = torch.randn(B, C, CLIP_FRAMES, H, W, generator=g).to(device, dt)
    act = torch.zeros(B, cfg.action_dim, CLIP_FRAMES, cfg.action_per_frame, 1)
    act[:, cfg.used_action_channel_ids] = torch.rand(B, len(cfg.used_action_channel_ids), CLIP_FRAMES,
                                                     cfg.action_per_frame, 1, generator=g) * 2 - 1
    mask = torch.zeros_like(act)
    mask[:, cfg.used_action_channel_ids] = 1.0
    act, mask = act.to(device, dt), mask.to(device, dt)
    text = (torch.randn(B, L, cfg.text_dim, generator=g) * 0.1).to(device, dt)
    params = policy.get_optim_params()

    def step(_k: int = 0) -> float:
        if args.smoke:  # FlexAttention has no CPU backward: the forward and loss only
            with torch.no_grad():
                return float(policy.training_loss_from_streams(lat, act, mask, text)[0])
        loss, _ = policy.training_loss_from_streams(lat, act, mask, text)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.optimizer_grad_clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    for k in range(args.warmup):
        step(k)
    _sync(device)
    graphs = _dynamo_graphs()
    _peak_reset(device)
    times, losses = _event_times(step, args.lerobot_steps, device)
    tokens = B * CLIP_FRAMES * (H // 2) * (W // 2) + B * CLIP_FRAMES * cfg.action_per_frame  # one copy, useful
    return {"batch": B, "tokens_per_s": statistics.median(tokens / t for t in times),
            "step_s": statistics.median(times), "tokens_per_step": tokens, "peak_mem_gb": _peak_gb(device),
            "recompiles_after_warmup": _dynamo_graphs() - graphs, "finite": bool(np.isfinite(losses).all()),
            "backward": not args.smoke}


def search_batches(attempt, probe: int, static: float, total: float, most: int) -> None:
    """Run ``attempt(B)`` (a result with ``peak_mem_gb``, or None when out of memory) at the ``probe`` batch, at
    four times it where the largest batch is at least eight times it (LeRobot's mask build grows with the
    square of the batch, so a smaller batch may be faster), and at the largest that fits: the batch that fills
    90 % of ``total`` bytes by the probe's memory per clip over the ``static`` bytes (at most ``most``), then
    0.75x as long as it runs out of memory."""
    first = attempt(probe)
    if first is None:
        return
    per_clip = max((first["peak_mem_gb"] * 1e9 - static) / probe, 1.0)
    B = min(int((0.9 * total - static) / per_clip), most) // 8 * 8
    if B >= 8 * probe:
        attempt(4 * probe)
    while B > probe and attempt(B) is None:
        B = int(B * 0.75) // 8 * 8


def lerobot_side(args, shape, device: torch.device) -> dict:
    """LeRobot's step at the largest batch that fits (see the module docstring), or ``--lerobot-batch``."""
    from lerobot.policies.lingbot_va.utils import FlexAttnFunc

    if args.smoke:  # its compiled flex attention does not build on the CPU: the eager functions
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        FlexAttnFunc.flex_attn = staticmethod(flex_attention)
        FlexAttnFunc.compiled_create_block_mask = staticmethod(
            lambda *a, _compile=None, **k: create_block_mask(*a, **k))
    policy, opt, cfg = lerobot_policy(args, device)
    tried: dict[int, dict] = {}

    def attempt(B: int) -> dict | None:
        try:
            tried[B] = run_lerobot(args, B, policy, opt, cfg, shape, device)
            print(f"[lerobot] batch {B}: {tried[B]['tokens_per_s']:.0f} tok/s, peak {tried[B]['peak_mem_gb']} GB",
                  flush=True)
            return tried[B]
        except torch.OutOfMemoryError:
            tried[B] = {"batch": B, "error": "out of memory"}
            print(f"[lerobot] batch {B}: out of memory", flush=True)
            opt.zero_grad(set_to_none=True)
            FlexAttnFunc.attention_mask = FlexAttnFunc.cross_attention_mask = None
            gc.collect()
            torch.cuda.empty_cache()
            return None

    if args.lerobot_batch or device.type != "cuda":
        attempt(args.lerobot_batch or args.lerobot_probe)
    else:
        static = torch.cuda.memory_allocated(device)
        search_batches(attempt, args.lerobot_probe, static, torch.cuda.get_device_properties(device).total_memory,
                       args.lerobot_max_batch)
    ok = [r for r in tried.values() if "error" not in r]
    best = max(ok, key=lambda r: r["tokens_per_s"]) if ok else {}
    return {**best, "largest_batch_that_fits": max((r["batch"] for r in ok), default=None),
            "tried": {str(b): r for b, r in sorted(tried.items())}, "weights": str(policy.dtype).removeprefix("torch."),
            "optimizer": "torch.optim.AdamW (LeRobot's preset: lr 1e-5, betas (0.9, 0.95), wd 1e-4), clip 1.0"}


def full_5b(metrics: Path, command: str, float8: str, ac: str) -> dict:
    """The issue's ``full_5b`` from a ``flexpack train`` run's metrics.jsonl (windows 2+: the first holds the
    compile): median tokens/s (useful: one copy) and MFU, the largest peak memory."""
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "tokens_per_s" in r]
    later = rows[1:] or rows
    if not later:
        raise SystemExit(f"{metrics}: no logged step with tokens_per_s")
    tok = statistics.median(r["tokens_per_s"] for r in later)
    return {"tokens_per_s": tok, "computed_tokens_per_s": 2 * tok,  # noisy + clean copy of every frame
            "mfu": statistics.median(r["mfu"] for r in later) if "mfu" in later[0] else None,
            "peak_mem_gb": max(r.get("peak_mem_gb", 0.0) for r in later), "float8": float8,
            "activation_checkpointing": ac, "windows": len(rows), "steps": rows[-1].get("step"),
            "loss_first_last": [rows[0].get("loss"), rows[-1].get("loss")], "command": command}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sets", default="ref,short", help="comma-separated: ref, short")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=6, help="timed flexpack steps per variant")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32768, help="data.max_tokens (one copy; twice that computed)")
    p.add_argument("--float8", default="tensorwise", help="comma-separated float8 modes of flexpack ('' = none)")
    p.add_argument("--activation-checkpointing", type=parse_ac, default=False, metavar="true|false|N|selective",
                   help="parallel.activation_checkpointing of flexpack (--layers 30 needs it)")
    p.add_argument("--lerobot-batch", type=int, default=0, help="LeRobot's batch of clips; 0 = the largest that fits")
    p.add_argument("--lerobot-probe", type=int, default=16, help="the probe batch of the search")
    p.add_argument("--lerobot-max-batch", type=int, default=4096, help="the search's upper bound")
    p.add_argument("--lerobot-steps", type=int, default=4, help="timed LeRobot steps per batch size")
    p.add_argument("--no-lerobot", action="store_true", help="flexpack only (e.g. without lerobot installed)")
    p.add_argument("--lerobot-mfu", action="store_true",
                   help="only add LeRobot's MFU (useful FLOPs as flexpack's) to --out from its recorded tokens/s")
    p.add_argument("--full-5b-metrics", type=Path, default=None, help="a flexpack train run's metrics.jsonl: full_5b")
    p.add_argument("--full-5b-command", default="", help="the command of that run")
    p.add_argument("--full-5b-float8", default="tensorwise")
    p.add_argument("--full-5b-ac", default="true")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the code paths, times nothing real")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/lingbot_va_h200.json"))
    args = p.parse_args()
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    if args.lerobot_mfu:  # LeRobot's MFU from the recorded tokens/s and peak of --out
        if results.get("smoke", True):
            raise SystemExit(f"--lerobot-mfu: {args.out} is not a recorded GPU run (its shapes are the default ones)")
        for name in ("ref", "short"):
            le = results.get(name, {}).get("lerobot", {})
            if le.get("tokens_per_s"):
                le["mfu"] = lerobot_mfu(le["tokens_per_s"], results["layers"], False,
                                        results["bf16_matmul_tflops"] * 1e12)
                results[name]["lerobot_mfu"] = le["mfu"]
        save(args.out, results)
        print(json.dumps({n: results[n].get("lerobot_mfu") for n in ("ref", "short") if n in results}))
        return
    if args.full_5b_metrics is not None:
        results["full_5b"] = full_5b(args.full_5b_metrics, args.full_5b_command, args.full_5b_float8, args.full_5b_ac)
        save(args.out, results)
        print(json.dumps(results["full_5b"], indent=1))
        return
    unknown = set(args.sets.split(",")) - {"ref", "short"}
    if unknown:
        p.error(f"--sets: unknown set(s) {sorted(unknown)}; use ref, short")
    if args.smoke:
        args.layers, args.max_tokens, args.steps, args.warmup, args.lerobot_steps = 2, 512, 2, 1, 1
        args.float8, args.lerobot_batch = "", args.lerobot_batch or 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    peak = measured_bf16_peak(device) if device.type == "cuda" else 1e12
    C, H, W, L, Dt = shape(args.smoke)
    command = " ".join(["python", *sys.argv])
    results.update(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   date=time.strftime("%Y-%m-%d"), torch=torch.__version__, layers=args.layers, smoke=args.smoke,
                   bf16_matmul_tflops=peak / 1e12, max_tokens=args.max_tokens, command=command)
    variants = ["off", *[m for m in args.float8.split(",") if m]]
    sets = args.sets.split(",")
    for set_name in sets:  # flexpack first: LeRobot's mask build sets a global inductor option as it compiles
        items = LingbotItems(length_sets(args.smoke)[set_name], C, H, W, L, Dt, Ca=30, A=ACTION_STEPS)
        res = results.setdefault(set_name, {})
        res["command"] = command
        for f8 in variants:
            name = "bf16" if f8 == "off" else f"float8-{f8}"
            try:
                r = run_flexpack(args, items, f8, device, peak)
            except Exception as exc:  # keep the other variants' numbers; say what failed
                r = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            res.setdefault("flexpack", {})[name] = r
            print(f"[{set_name}] flexpack {name}: " + (r.get("error") or f"{r['tokens_per_s']:.0f} tok/s, mfu "
                  f"{r['mfu']:.3f}, peak {r['peak_mem_gb']} GB, recompiles {r['recompiles_after_warmup']}"), flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            save(args.out, results)
    lerobot: dict = {}
    if not args.no_lerobot:  # one measurement: LeRobot's clips do not depend on the length set
        try:
            lerobot = lerobot_side(args, (C, H, W, L), device)
            if lerobot.get("tokens_per_s"):
                lerobot["mfu"] = lerobot_mfu(lerobot["tokens_per_s"], args.layers, args.smoke, peak)
        except Exception as exc:
            lerobot = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    for set_name in sets:
        results[set_name]["lerobot"] = lerobot
        summarize(results[set_name])
    save(args.out, results)
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if not isinstance(vv, dict)} if isinstance(v, dict) else v
                      for k, v in results.items()}, indent=1))


def save(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))


def summarize(res: dict) -> None:
    """The issue's flat keys of one length set: flexpack at bf16 against LeRobot, float8 beside it."""
    bf16, le = res["flexpack"].get("bf16", {}), res.get("lerobot", {})
    ours, theirs = bf16.get("tokens_per_s"), le.get("tokens_per_s")
    res.update(flexpack_tokens_per_s=ours, lerobot_tokens_per_s=theirs,
               flexpack_vs_lerobot=ours / theirs if ours and theirs else None, mfu=bf16.get("mfu"),
               peak_mem_gb=bf16.get("peak_mem_gb"), recompiles_after_warmup=bf16.get("recompiles_after_warmup"),
               lerobot_batch=le.get("batch"), lerobot_recompiles_after_warmup=le.get("recompiles_after_warmup"),
               lerobot_mfu=le.get("mfu"))
    for name, r in res["flexpack"].items():
        if name.startswith("float8") and r.get("tokens_per_s"):
            res.setdefault("float8", {})[name.removeprefix("float8-")] = {
                "tokens_per_s": r["tokens_per_s"], "vs_lerobot": r["tokens_per_s"] / theirs if theirs else None,
                "vs_bf16": r["tokens_per_s"] / ours if ours else None, "mfu": r["mfu"], "peak_mem_gb": r["peak_mem_gb"],
                "recompiles_after_warmup": r["recompiles_after_warmup"]}


if __name__ == "__main__":
    main()
