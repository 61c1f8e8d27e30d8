"""Attention over packed episodes on one GPU: which backend, how fast, and how fast the masks build.

Run on the H200 (see BENCHMARKS.md for the command and the recorded table):

    python benchmarks/attention.py --out $OUT/attention_h200.json          # full
    python benchmarks/attention.py --smoke                                 # API check, tiny sizes

Side by side, in one run, bf16, 24 heads x 128, episodes from data/episode_frames_ref.txt
(latent frames F = (n - 1) // 4 + 1, 36 tokens per latent frame), packs of 1, 4, 6, 8 episodes:
per-episode SDPA loop; flex_attention + create_block_mask(_compile=True) (Triton); torch varlen_attn;
padded batch SDPA with a key-padding mask; FlexAttnFunc (Triton and FLASH) for the document mask
and for the chunk-causal teacher-forcing mask (4 episodes, both copies), each with the kernels'
mask evaluated as key ranges (default) and as the mask's own per-token keys ("_keys"); FA4's
built-in causal varlen kernel over the same copies as a reference for the teacher-forcing rate;
block-mask build time (ours vs create_block_mask); compile count over 200 steps of changing
lengths at a fixed budget.

Timing: 3 warm-up calls, then >= 20 timed calls each between CUDA events; the median is reported.
The headline ratio vs the per-episode loop is also measured paired: loop and ours alternate in
7 rounds and the median of the per-round ratios is reported (robust to clock drift).
TFLOP/s count unmasked (query, key) pairs only: forward 4*D*H*pairs, forward+backward 3.5x that
(the backward's five matmuls are 2.5x the forward's two; FlashAttention's benchmarks count alike).
Block-mask builds are timed by wall clock around a synchronized call (they are launch-bound).
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
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flexpack.attention.blockmask_check import unmasked_pairs  # noqa: E402
from flexpack.attention.flex import AUTO_CUDA, FlexAttnFunc, compile_count, compiled_flex_attention, has_flash  # noqa: E402
from flexpack.packing.layout import SequenceLayout, TokenLayout  # noqa: E402

H, D, TPF = 24, 128, 36
DEV = "cuda"
warnings.filterwarnings("ignore", category=DeprecationWarning)


def load_latent_frames(path: Path) -> list[int]:
    lines = [ln.strip() for ln in path.read_text().splitlines()]
    return [(int(x) - 1) // 4 + 1 for x in lines if x and not x.startswith("#")]


def draw_pack(rng: random.Random, frames: list[int], n: int, cap: int, tries: int = 3000) -> list[int]:
    """n episode lengths whose total is as large as possible but <= cap frames (seeded)."""
    best: list[int] = []
    for _ in range(tries):
        pick = rng.sample(frames, n)
        if sum(best) < sum(pick) <= cap:
            best = pick
    if not best:
        raise ValueError(f"no pack of {n} episodes fits {cap} frames")
    return best


def bench(fn: Callable[[], object], runs: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` between CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def wall(fn: Callable[[], object], runs: int, warmup: int = 3) -> float:
    """Median wall-clock milliseconds of a synchronized call (for launch-bound mask builds)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def fwd_fb(make_out: Callable[[], torch.Tensor], inputs: tuple, runs: int) -> tuple[float, float]:
    # forward timed with grad enabled: the graph training runs (and no extra no_grad compile)
    t_fwd = bench(make_out, runs)
    g = torch.randn_like(make_out())

    def fb() -> None:
        torch.autograd.grad(make_out(), inputs, g)

    return t_fwd, bench(fb, runs)


def tflops(pairs: int, ms: float, fb: bool) -> float:
    """TFLOP/s on unmasked pairs: forward 4*D*H*pairs, forward+backward 3.5x that."""
    return (3.5 if fb else 1.0) * 4 * D * H * pairs / ms / 1e9


def paired_ratio(loop: Callable[[], object], ours: Callable[[], object], rounds: int = 7, runs: int = 10) -> float:
    """Median over alternating rounds of (loop ms / ours ms)."""
    return statistics.median(bench(loop, runs) / bench(ours, runs) for _ in range(rounds))


def qkv(T: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return tuple(torch.randn(1, H, T, D, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_(True)
                 for _ in range(3))


def methods_document(lay: TokenLayout, runs: int, flash: bool) -> tuple[dict, dict]:
    """All document-mask methods on one pack: {name: (fwd_ms, fb_ms)} and block-mask build times."""
    T = lay.num_tokens
    q, k, v = qkv(T)
    runs_ = list(zip(lay.doc_start.tolist(), lay.doc_len.tolist()))
    res: dict = {}

    def loop_out() -> list[torch.Tensor]:
        return [F.scaled_dot_product_attention(q[:, :, s:s + n], k[:, :, s:s + n], v[:, :, s:s + n]) for s, n in runs_]

    def loop_fb() -> None:
        outs = loop_out()
        torch.autograd.grad(outs, (q, k, v), [torch.ones_like(o) for o in outs])

    res["sdpa_loop"] = (bench(loop_out, runs), bench(loop_fb, runs))
    ref = torch.cat(loop_out(), dim=2)
    n_tok = ref.shape[2]

    # create_block_mask over the same mask_mod, run by the same compiled Triton flex kernel
    # (an identical kernel: only the block mask's origin differs, and no extra compile)
    mod = FlexAttnFunc("flex").prepare(lay, "document").mask_mod
    cbm = create_block_mask(mod, 1, 1, T, T, device=DEV, _compile=True)
    builds = {"create_block_mask_ms": wall(lambda: create_block_mask(mod, 1, 1, T, T, device=DEV, _compile=True), 10)}
    flex_c = compiled_flex_attention(q, k)
    res["flex_cbm_triton"] = fwd_fb(lambda: flex_c(q, k, v, cbm, None), (q, k, v), runs)

    from torch.nn.attention.varlen import varlen_attn

    qt, kt, vt = (x.detach()[0, :, :n_tok].transpose(0, 1).contiguous().requires_grad_(True)  # (T, H, D)
                  for x in (q, k, v))
    bounds = sorted({0, n_tok} | {s for s, _ in runs_} | {s + n for s, n in runs_})  # episodes only
    cu = torch.tensor(bounds, dtype=torch.int32, device=DEV)
    mx = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    res["varlen"] = fwd_fb(lambda qt=qt, kt=kt, vt=vt: varlen_attn(qt, kt, vt, cu, cu, mx, mx), (qt, kt, vt), runs)
    del qt, kt, vt

    L = max(n for _, n in runs_)
    B = len(runs_)
    pb = [torch.zeros(B, H, L, D, device=DEV, dtype=torch.bfloat16) for _ in range(3)]
    for i, (s, n) in enumerate(runs_):
        for dst, src in zip(pb, (q, k, v)):
            dst[i, :, :n] = src.detach()[0, :, s:s + n]
    pb = [x.requires_grad_(True) for x in pb]
    kpm = (torch.arange(L, device=DEV)[None, :]
           < torch.tensor([n for _, n in runs_], device=DEV)[:, None])[:, None, None, :]
    res["padded_sdpa"] = fwd_fb(lambda pb=pb: F.scaled_dot_product_attention(*pb, attn_mask=kpm), tuple(pb), runs)
    del pb

    variants = (("ours_triton", "flex", True), ("ours_flash", "flex-flash", True),
                ("ours_flash_keys", "flex-flash", False), ("ours_auto", "auto", True))
    for name, backend, ranges in variants:
        if backend == "flex-flash" and not flash:
            continue
        attn = FlexAttnFunc(backend, range_masks=ranges)
        prep = attn.prepare(lay, "document")
        try:
            res[name] = fwd_fb(lambda: attn(q, k, v, prep), (q, k, v), runs)
            err = (attn(q, k, v, prep)[:, :, :n_tok].float() - ref.float()).abs().max().item()
            pad_zero = bool(attn(q, k, v, prep)[:, :, n_tok:].eq(0).all())
            print(f"  {name}: max |out - sdpa loop| = {err:.4f}; pad rows zero: {pad_zero}")
        except Exception as e:  # noqa: BLE001 - record and carry on (e.g. FLASH constraints)
            res[name] = (float("nan"), float("nan"))
            print(f"  {name} failed: {type(e).__name__}: {str(e)[:300]}")
        if name == "ours_auto":
            g = torch.randn(1, H, T, D, device=DEV, dtype=torch.bfloat16)
            builds["fb_ratio_paired"] = paired_ratio(
                loop_fb, lambda: torch.autograd.grad(attn(q, k, v, prep), (q, k, v), g))
            builds["fwd_ratio_paired"] = paired_ratio(loop_out, lambda: attn(q, k, v, prep))
    attn = FlexAttnFunc("flex")
    builds["blockmask_ms"] = wall(lambda: attn.prepare(lay, "document"), 30)
    builds["blockmask_gpu_ms"] = bench(lambda: attn.prepare(lay, "document"), 30)  # GPU time alone
    return res, builds


def teacher_forcing(lay: TokenLayout, chunk: int, runs: int, flash: bool) -> dict:
    T = lay.num_tokens
    q, k, v = qkv(T, seed=1)
    out: dict = {}
    attn = FlexAttnFunc("flex")
    prep = attn.prepare(lay, "teacher_forcing", chunk_size=chunk)
    pairs = unmasked_pairs(prep.mask_mod)
    out["pairs"], out["pair_fraction"] = pairs, pairs / T / T
    out["tf_blockmask_ms"] = wall(lambda: attn.prepare(lay, "teacher_forcing", chunk_size=chunk), 30)
    mod = prep.mask_mod
    create_block_mask(mod, 1, 1, T, T, device=DEV, _compile=True)
    out["tf_create_block_mask_ms"] = wall(lambda: create_block_mask(mod, 1, 1, T, T, device=DEV, _compile=True), 5)
    variants = (("triton", "flex", True), ("triton_keys", "flex", False), ("flash", "flex-flash", True),
                ("flash_keys", "flex-flash", False))
    for name, backend, ranges in variants:
        if backend == "flex-flash" and not flash:
            continue
        a = FlexAttnFunc(backend, range_masks=ranges)
        p = a.prepare(lay, "teacher_forcing", chunk_size=chunk)
        try:
            f, fb = fwd_fb(lambda: a(q, k, v, p), (q, k, v), runs)
        except Exception as e:  # noqa: BLE001
            print(f"  tf {name} failed: {type(e).__name__}: {str(e)[:300]}")
            f = fb = float("nan")
        out[f"{name}_fwd_ms"], out[f"{name}_fb_ms"] = f, fb
        out[f"{name}_fwd_tflops"], out[f"{name}_fb_tflops"] = tflops(pairs, f, False), tflops(pairs, fb, True)
    if flash:
        out.update(fa4_causal_reference(lay, runs))
    return out


def fa4_causal_reference(lay: TokenLayout, runs: int) -> dict:
    """FA4's own causal varlen kernel over the layout's copy runs: a reference rate for causal-like masks."""
    from flash_attn.cute.interface import flash_attn_varlen_func

    starts = lay.doc_start.tolist()
    lens = lay.doc_len.tolist()
    bounds = sorted({b for s, n in zip(starts, lens) for b in (s, s + n // 2, s + n)})  # noisy, clean copies
    cu = torch.tensor(bounds, dtype=torch.int32, device=DEV)
    mx = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    n_tok = bounds[-1] - bounds[0]
    qt, kt, vt = (x[0].transpose(0, 1)[bounds[0]:bounds[-1]].contiguous().requires_grad_(True)
                  for x in qkv(lay.num_tokens, seed=3))
    pairs = sum((b - a) * (b - a + 1) // 2 for a, b in zip(bounds[:-1], bounds[1:]))
    cu = cu - bounds[0]

    def run() -> torch.Tensor:
        r = flash_attn_varlen_func(qt, kt, vt, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx,
                                   causal=True)
        return r[0] if isinstance(r, tuple) else r

    try:
        f, fb = fwd_fb(run, (qt, kt, vt), runs)
    except Exception as e:  # noqa: BLE001
        print(f"  fa4 causal reference failed: {type(e).__name__}: {str(e)[:300]}")
        return {}
    return {"fa4_causal_tokens": n_tok, "fa4_causal_pairs": pairs, "fa4_causal_fwd_ms": f, "fa4_causal_fb_ms": fb,
            "fa4_causal_fwd_tflops": tflops(pairs, f, False), "fa4_causal_fb_tflops": tflops(pairs, fb, True)}


def tf_builds(frames: list[int], cap: int, chunk: int, rng: random.Random, n_layouts: int = 6) -> dict:
    """Compiled teacher-forcing block-mask builds over several packs: time, and eager fallbacks seen."""
    times, fallbacks = [], 0
    for _ in range(n_layouts):
        lens = draw_pack(rng, frames, rng.randint(2, 6), cap)
        lay = SequenceLayout.from_rows([lens], cap).tokens(32, 4, copies=2).to(DEV)
        a = FlexAttnFunc("flex")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a.prepare(lay, "teacher_forcing", chunk_size=chunk)
        fallbacks += sum("building eagerly" in str(w.message) for w in caught)
        times.append(wall(lambda: a.prepare(lay, "teacher_forcing", chunk_size=chunk), 20))
    return {"tf_build_ms_all": times, "tf_build_ms_max": max(times), "tf_build_fallbacks": fallbacks}


def recompile_count(frames: list[int], cap: int, steps: int, backend: str, rng: random.Random) -> dict:
    """Compile count over ``steps`` fwd+bwd steps of changing lengths at one fixed token budget."""
    attn = FlexAttnFunc(backend)
    q, k, v = qkv(cap * TPF, seed=2)
    counts = []
    for step in range(steps):
        lens, total = [], 0
        while True:  # greedy fill with random episodes: a new length mix every step
            n = rng.choice(frames)
            if total + n > cap:
                break
            lens.append(n)
            total += n
        lay = SequenceLayout.from_rows([lens], cap).tokens(32, 4).to(DEV)
        out = attn(q, k, v, attn.prepare(lay, "document"))
        torch.autograd.grad(out.sum(), (q, k, v))
        counts.append(compile_count())
    return {"compiles_warmup": counts[0], "compiles_end": counts[-1], "recompiles_after_warmup": counts[-1] - counts[0],
            "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frames-file", default="data/episode_frames_ref.txt")
    ap.add_argument("--packs", default="1,4,6,8")
    ap.add_argument("--cap-frames", type=int, default=2080, help="frame budget of a pack (2080 x 36 = 74,880 tokens)")
    ap.add_argument("--chunk-size", type=int, default=4, help="chunk (latent frames) of the teacher-forcing mask")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 3 runs: catch API errors quickly")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "attention_h200.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention.py needs CUDA")
    frames = load_latent_frames(Path(args.frames_file))
    packs = [int(x) for x in args.packs.split(",")]
    cap, runs, steps = args.cap_frames, args.runs, args.steps
    if args.smoke:
        frames, cap, runs, steps, packs = [f // 8 + 1 for f in frames], 260, 3, 5, [1, 4, 8]
    flash = has_flash()
    rng = random.Random(0)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, FA4 {'yes' if flash else 'no'}")
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "fa4": flash,
                    "heads": H, "head_dim": D, "tokens_per_frame": TPF, "runs": runs,
                    "flops": "fwd 4*D*H*pairs, fwd+bwd 3.5x fwd, unmasked pairs only", "packs": {}}
    t0 = time.time()

    def save(note: str) -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(args.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=float))
        tmp.replace(args.out)
        print(f"[{time.time() - t0:6.1f} s] {note}; wrote {args.out}")

    hdr = (f"{'eps':>3} {'tokens':>7} {'method':<16} {'fwd ms':>8} {'fwd TF/s':>8} {'f+b ms':>8} {'f+b TF/s':>8} "
           f"{'vs loop f+b':>11}")
    draws = {n: draw_pack(rng, frames, n, cap) for n in packs}
    tf_lens = draw_pack(rng, frames, 4, cap // 2)

    def doc_pack(n: int) -> None:
        lens = draws[n]
        # every pack padded to the one token budget (pack mode: one shape, one compile)
        lay = SequenceLayout.from_rows([lens], cap).tokens(32, 4).to(DEV)
        pairs = int(sum((x * TPF) ** 2 for x in lens))
        res, builds = methods_document(lay, runs, flash)
        rows = {}
        print(hdr)
        for name, (f, fb) in res.items():
            rows[name] = {"fwd_ms": f, "fb_ms": fb, "fwd_tflops": tflops(pairs, f, False),
                          "fb_tflops": tflops(pairs, fb, True), "fb_ratio_vs_loop": res["sdpa_loop"][1] / fb,
                          "fwd_ratio_vs_loop": res["sdpa_loop"][0] / f}
            r = rows[name]
            print(f"{n:>3} {sum(lens) * TPF:>7} {name:<16} {f:8.2f} {r['fwd_tflops']:8.0f} {fb:8.2f} "
                  f"{r['fb_tflops']:8.0f} {r['fb_ratio_vs_loop']:11.2f}")
        print(f"    block mask build: ours {builds['blockmask_ms']:.3f} ms (GPU {builds['blockmask_gpu_ms']:.3f}),"
              f" create_block_mask(_compile=True) {builds['create_block_mask_ms']:.2f} ms;"
              f" paired ratio vs loop: f+b {builds.get('fb_ratio_paired', float('nan')):.3f}, "
              f"fwd {builds.get('fwd_ratio_paired', float('nan')):.3f}")
        result["packs"][str(n)] = {"frames": lens, "tokens": sum(lens) * TPF, "budget_tokens": lay.num_tokens,
                                   "pairs": pairs, "methods": rows, **builds}
        if n == 8:
            result.update({"fb_ratio_vs_loop": rows["ours_auto"]["fb_ratio_vs_loop"],
                           "fwd_ratio_vs_loop": rows["ours_auto"]["fwd_ratio_vs_loop"],
                           "fb_ratio_vs_loop_paired": builds["fb_ratio_paired"],
                           "fwd_ratio_vs_loop_paired": builds["fwd_ratio_paired"],
                           "blockmask_ms": builds["blockmask_ms"],
                           "create_block_mask_ms": builds["create_block_mask_ms"]})
        if n == 4:
            result["fb_ratio_vs_loop_4"] = rows["ours_auto"]["fb_ratio_vs_loop"]
            result["fb_ratio_vs_loop_4_paired"] = builds["fb_ratio_paired"]
        save(f"pack {n}")

    order = sorted(packs, key=lambda n: (n != max(packs), n != 4, n))  # most important first
    doc_pack(order[0])
    lay_tf = SequenceLayout.from_rows([tf_lens], cap // 2).tokens(32, 4, copies=2).to(DEV)
    tf = teacher_forcing(lay_tf, args.chunk_size, runs, flash)
    tf.update({"frames": tf_lens, "tokens": sum(tf_lens) * TPF * 2, "budget_tokens": lay_tf.num_tokens,
               "chunk_size": args.chunk_size})
    result["teacher_forcing"] = tf
    # the rate of what FlexAttnFunc("auto") runs for this mask (AUTO_CUDA), range masks on
    auto_name = "flash" if flash and AUTO_CUDA["teacher_forcing"] == "flex-flash" else "triton"
    result["tf_chunk_causal_fb_tflops"], result["tf_backend"] = tf[f"{auto_name}_fb_tflops"], auto_name
    result["tf_blockmask_ms"] = tf["tf_blockmask_ms"]
    tf.update(tf_builds(frames, cap // 2, args.chunk_size, rng))
    print(f"teacher forcing: {tf['tokens']} tokens, {tf['pair_fraction']:.1%} pairs, chunk {args.chunk_size}: "
          + ", ".join(f"{k} {v:.2f}" for k, v in tf.items() if isinstance(v, float)))
    save("teacher forcing")
    lay8 = SequenceLayout.from_rows([draws[order[0]]], cap).tokens(32, 4).to(DEV)
    a = FlexAttnFunc("flex")
    result["cc_blockmask_ms"] = wall(lambda: a.prepare(lay8, "chunk_causal", chunk_size=args.chunk_size), 30)
    print(f"chunk-causal block mask build ({order[0]} eps): {result['cc_blockmask_ms']:.3f} ms")
    rc = recompile_count(frames, cap, steps, "auto", rng)
    result.update(rc)
    print(f"compiles over {steps} steps of changing lengths at {cap * TPF} tokens: {rc}")
    save("recompiles")
    for n in order[1:]:
        doc_pack(n)
    keys = ("fb_ratio_vs_loop", "fb_ratio_vs_loop_paired", "fwd_ratio_vs_loop", "blockmask_ms", "create_block_mask_ms",
            "recompiles_after_warmup", "tf_chunk_causal_fb_tflops", "tf_blockmask_ms", "fb_ratio_vs_loop_4",
            "fb_ratio_vs_loop_4_paired", "cc_blockmask_ms")
    print(json.dumps({k: result.get(k) for k in keys}, indent=1))


if __name__ == "__main__":
    main()
