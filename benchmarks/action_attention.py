r"""What action tokens cost FlexAttention's FA4 (FLASH) kernels on packed episodes, and why.

With 4 action tokens per latent frame an episode of F frames is 36 F tokens instead of 32 F, and an episode
boundary falls on a 128-token block boundary only when the frames before it are a multiple of 32 (against a
multiple of 4 without actions): nearly every boundary then cuts a block, whose row and column of blocks are
*partial* against both episodes. The kernels run full blocks without a mask and evaluate the mask in every
element of a partial block (two loads and compares per element for the key-range mask); empty blocks are
skipped. This script takes the packs the token-budget sampler draws for a length set with action tokens and
lays the same episodes out as:

* ``video``: 32 tokens a frame (no action tokens), the same frame budget;
* ``actions``: 32 + 4 tokens a frame, as training lays them out;
* ``actions128``: the same with a frame budget whose token count is a multiple of 128 (1,824 frames);
* ``aligned``: every episode starting on a 128-token boundary (padding tokens between episodes; not a layout
  training makes: the upper bound of what block alignment could buy, and what it costs in tokens);
* ``varlen`` (timed only): FA4's own variable-length kernel over the episodes (``flash_attn_varlen_func``), whose
  tiles restart at every episode: no partial block from a boundary, no mask function.

On the CPU (default) it counts, per layout, full / partial / empty 128 x 128 blocks, useful (query, key) pairs,
the pairs the kernels compute (every full and partial block whole) and the padding it adds; with ``--fit`` it
also reads the recorded H200 profiles of one step without and with action tokens
(``benchmarks/results/profile_wan5b_a{0,30}_h200.json``), counts the blocks of the two packs they profiled and
solves for the cost of a partial block in full blocks that explains the FA4 forward and backward times. With
``--time`` (CUDA, FA4 installed) it times FA4 forward and forward + backward on every layout (24 heads x 128,
bf16, median of ``--runs`` calls between CUDA events) and reports useful TFLOP/s (forward 4 D H pairs,
forward + backward 3.5 x that) and each layout's rate over ``video``'s.

    python benchmarks/action_attention.py --sets wan5b,long --fit --out benchmarks/results/action_attention_cpu.json
    python benchmarks/action_attention.py --sets wan5b,long --time --out $OUT/action_attention_h200.json   # H200
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexpack.attention.blockmask import fast_block_mask  # noqa: E402
from flexpack.attention.blockmask_check import block_structure, unmasked_pairs  # noqa: E402
from flexpack.attention.masks import document_mask  # noqa: E402
from flexpack.attention.segments import BLOCK  # noqa: E402
from flexpack.packing.batch_sampler import TokenBudgetBatchSampler  # noqa: E402
from flexpack.packing.layout import PAD, SequenceLayout, TokenLayout  # noqa: E402

VIDEO, ACTION, H, D = 32, 4, 24, 128
RESULTS = Path(__file__).resolve().parent / "results"
LAYOUTS = ("video", "actions", "actions128", "aligned", "varlen")


def packs_of(lengths: list[int], max_tokens: int, count: int) -> list[list[int]]:
    """The first ``count`` packs (latent frames per episode) the sampler draws with action tokens."""
    sampler = TokenBudgetBatchSampler(lengths, max_tokens, tokens_per_frame=VIDEO + ACTION)
    return [[lengths[i] for i in b] for b in list(sampler)[:count]]


def layout(lens: list[int], name: str, frames: int, row: int | None = None) -> tuple[TokenLayout, int]:
    """The token layout of one pack as ``name`` lays it out in a row of ``frames`` frames, and its padding
    tokens between episodes. ``aligned`` counts in units of 4 tokens (36 = 9 of them a frame), padding runs
    to the next 128 tokens between episodes; its row is ``row`` units (default: ``frames`` frames rounded up
    to hold them; a fixed ``row`` keeps one shape, and one kernel compile, for every pack)."""
    if name == "video":
        return SequenceLayout.from_rows([lens], frames).tokens(VIDEO), 0
    if name in ("actions", "actions128"):
        return SequenceLayout.from_rows([lens], frames + (4 if name == "actions128" else 0)).tokens(VIDEO, ACTION), 0
    assert name == "aligned", name
    unit, per_block = 4, BLOCK // 4
    runs, gap_slots, used = [], [], 0
    for n in lens:
        gap = -used % per_block
        if gap:
            gap_slots.append(len(runs))
            runs.append(gap)
            used += gap
        runs.append(n * (VIDEO + ACTION) // unit)
        used += runs[-1]
    row = row or -(-max(used, frames * (VIDEO + ACTION) // unit) // per_block) * per_block
    assert used <= row, f"aligned pack of {used} units in a row of {row}"
    sl = SequenceLayout.from_rows([runs], row)
    doc = sl.frame_doc.clone()
    for slot in gap_slots:  # the gap runs are padding, not episodes
        doc[doc == slot] = PAD
    sl = dataclasses.replace(sl, frame_doc=doc)
    return sl.tokens(unit), sum(runs[i] for i in gap_slots) * unit


def block_stats(tl: TokenLayout) -> dict:
    """Full / partial / empty 128 x 128 blocks of the document mask, useful and computed pairs."""
    mod = document_mask(tl)
    T = tl.num_tokens
    partial, full = block_structure(fast_block_mask(mod, T, T))
    n_full, n_part = int(full.sum()), int(partial.sum())
    return {"tokens": T, "full": n_full, "partial": n_part, "empty": partial.numel() - n_full - n_part,
            "useful_pairs": unmasked_pairs(mod), "computed_pairs": (n_full + n_part) * BLOCK * BLOCK}


def varlen_stats(lens: list[int]) -> dict:
    """Tiles FA4's varlen kernel computes: per episode a grid of 128 x 128 tiles from its own first token."""
    tiles = sum((-(-n * (VIDEO + ACTION) // BLOCK)) ** 2 for n in lens)
    return {"tokens": sum(lens) * (VIDEO + ACTION), "useful_pairs": sum((n * (VIDEO + ACTION)) ** 2 for n in lens),
            "computed_pairs": tiles * BLOCK * BLOCK, "partial": None, "full": None, "empty": None}


def summarize(rows: list[dict]) -> dict:
    full, part = sum(r["full"] or 0 for r in rows), sum(r["partial"] or 0 for r in rows)
    useful, computed = sum(r["useful_pairs"] for r in rows), sum(r["computed_pairs"] for r in rows)
    out = {"packs": len(rows), "useful_pairs": useful, "computed_pairs": computed,
           "useful_share": useful / computed, "pad_between_tokens": sum(r.get("pad_between_tokens", 0) for r in rows),
           "tokens": sum(r["tokens"] for r in rows)}
    if rows and rows[0]["full"] is not None:
        out.update(full=full, partial=part, empty=sum(r["empty"] for r in rows), partial_share=part / (full + part))
    return out


def fit_partial_cost(lengths: list[int], max_tokens: int = 65536) -> dict:
    """From the recorded H200 profiles of one 4-layer step on ``wan5b`` without and with action tokens: the
    FA4 forward and backward kernel times, the blocks of the two packs they profiled (the sampler's third pack
    at each token count: ``train_step.py --warmup 2 --profile``), and the cost ``c`` of a partial block in full
    blocks for which ``time ∝ full + c * partial`` gives both recorded time ratios."""
    out: dict = {}
    blocks = {}
    for ca, tpf in ((0, VIDEO), (30, VIDEO + ACTION)):
        prof = json.loads((RESULTS / f"profile_wan5b_a{ca}_h200.json").read_text())["wan5b"]
        top = prof["pack-float8-tensorwise"]["kernel_split"]["top"]
        ms = {kind: sum(t for name, t in top if f"flash_{kind}_sm90" in name.lower()) for kind in ("fwd", "bwd")}
        sampler = TokenBudgetBatchSampler(lengths, max_tokens, tokens_per_frame=tpf)
        lens = [lengths[i] for i in list(sampler)[2]]
        stats = block_stats(SequenceLayout.from_rows([lens], sampler.budget_frames).tokens(VIDEO, tpf - VIDEO))
        blocks[ca] = stats
        out[f"a{ca}"] = {"episodes": lens, **ms, **stats}
    b0, b1 = blocks[0], blocks[30]
    for kind in ("fwd", "bwd"):
        ratio = out["a30"][kind] / out["a0"][kind]
        # b1.full + c b1.partial = ratio (b0.full + c b0.partial)
        c = (ratio * b0["full"] - b1["full"]) / (b1["partial"] - ratio * b0["partial"])
        useful_rate = (b1["useful_pairs"] / b0["useful_pairs"]) / ratio
        out[kind] = {"time_ratio": ratio, "useful_rate_ratio": useful_rate, "partial_cost_in_full_blocks": c}
    return out


def predicted_rate(stats: dict, cost: float) -> float:
    """Useful pairs per unit of kernel time if a full block costs 1 and a partial one ``cost`` (varlen: its
    ragged last tiles masked by sequence length, counted as full)."""
    if stats.get("full") is None:
        return stats["useful_pairs"] / stats["computed_pairs"]
    blocks = stats["full"] + cost * stats["partial"]
    return stats["useful_pairs"] / (blocks * BLOCK * BLOCK)


def time_layouts(packs: list[list[int]], names: list[str], frames: int, runs: int) -> dict:
    """FA4 forward and forward + backward per layout (CUDA): medians per pack, useful TFLOP/s."""
    from attention import fwd_fb
    from flexpack.attention.flex import FlexAttnFunc

    out: dict = {}
    for name in names:
        rows = []
        for lens in packs:
            if name == "varlen":
                fwd, fb, useful = _time_varlen(lens, runs)
            else:
                row = max(layout(b, name, frames)[0].num_tokens for b in packs) // 4 if name == "aligned" else None
                tl, _ = layout(lens, name, frames, row)
                tl = tl.to("cuda")
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v = (torch.randn(1, H, tl.num_tokens, D, device="cuda", dtype=torch.bfloat16, generator=g)
                           .requires_grad_(True) for _ in range(3))
                attn = FlexAttnFunc("flex-flash")
                prep = attn.prepare(tl, "document")
                fwd, fb = fwd_fb(lambda: attn(q, k, v, prep), (q, k, v), runs)
                useful = unmasked_pairs(prep.mask_mod)
            rows.append({"fwd_ms": fwd, "fwd_bwd_ms": fb, "useful_pairs": useful,
                         "fwd_tflops": 4 * D * H * useful / fwd / 1e9,
                         "fwd_bwd_tflops": 3.5 * 4 * D * H * useful / fb / 1e9})
            print(f"  {name} {len(lens)} eps: fwd {fwd:.2f} ms, fwd+bwd {fb:.2f} ms, "
                  f"{rows[-1]['fwd_bwd_tflops']:.0f} useful TF/s", flush=True)
        useful = sum(r["useful_pairs"] for r in rows)
        out[name] = {"packs": rows, "fwd_tflops": 4 * D * H * useful / sum(r["fwd_ms"] for r in rows) / 1e9,
                     "fwd_bwd_tflops": 3.5 * 4 * D * H * useful / sum(r["fwd_bwd_ms"] for r in rows) / 1e9}
    base = out.get("video")
    for name, r in out.items():
        if base:
            r["fwd_bwd_rate_vs_video"] = r["fwd_bwd_tflops"] / base["fwd_bwd_tflops"]
            r["fwd_rate_vs_video"] = r["fwd_tflops"] / base["fwd_tflops"]
    return out


def _time_varlen(lens: list[int], runs: int) -> tuple[float, float, int]:
    from flash_attn.cute import flash_attn_varlen_func

    from attention import fwd_fb

    sizes = [n * (VIDEO + ACTION) for n in lens]
    total = sum(sizes)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
               for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32, device="cuda")

    def call() -> torch.Tensor:
        out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(sizes),
                                     max_seqlen_k=max(sizes))
        return out[0] if isinstance(out, tuple) else out

    fwd, fb = fwd_fb(call, (q, k, v), runs)
    return fwd, fb, sum(n * n for n in sizes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sets", default="wan5b,long", help="train_step.py's length sets")
    p.add_argument("--packs", type=int, default=12, help="packs per set (the sampler's first ones, with actions)")
    p.add_argument("--max-tokens", type=int, default=65536)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated: " + ", ".join(LAYOUTS))
    p.add_argument("--fit", action="store_true", help="fit the cost of a partial block to the recorded H200 profiles")
    p.add_argument("--time", action="store_true", help="time FA4 on every layout (CUDA with FA4)")
    p.add_argument("--runs", type=int, default=10, help="timed calls per pack and layout (--time)")
    p.add_argument("--out", type=Path, default=RESULTS / "action_attention_cpu.json")
    args = p.parse_args()
    from train_step import SETS, length_sets

    names = args.layouts.split(",")
    bad = sorted(set(names) - set(LAYOUTS)) + sorted(set(args.sets.split(",")) - set(SETS))
    if bad:
        p.error(f"unknown layout(s) or set(s) {bad}; layouts: {', '.join(LAYOUTS)}; sets: {', '.join(SETS)}")
    if args.time and not torch.cuda.is_available():
        p.error("--time needs CUDA (and FA4); without it the script counts blocks only")
    sets = length_sets(False)
    frames = args.max_tokens // (VIDEO + ACTION)
    result: dict = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "block": BLOCK,
                    "max_tokens": args.max_tokens, "frames_per_pack": frames,
                    "device": torch.cuda.get_device_name() if args.time else "cpu (block counts only)"}
    for set_name in args.sets.split(","):
        packs = packs_of(sets[set_name], args.max_tokens, args.packs)
        res = result[set_name] = {"episodes_per_pack": statistics.mean(len(b) for b in packs)}
        for name in names:
            rows = []
            for lens in packs:
                if name == "varlen":
                    rows.append(varlen_stats(lens))
                else:
                    tl, pad = layout(lens, name, frames)
                    rows.append({**block_stats(tl), "pad_between_tokens": pad})
            res[name] = summarize(rows)
            s = res[name]
            print(f"[{set_name}] {name}: partial {s.get('partial_share', float('nan')):.2%} of visited blocks, "
                  f"useful/computed {s['useful_share']:.4f}, padding {s['pad_between_tokens']} tokens", flush=True)
        if args.time:
            res["timed"] = time_layouts(packs, names, frames, args.runs)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    if args.fit:
        result["fit"] = fit = fit_partial_cost(sets["wan5b"], args.max_tokens)
        for set_name in args.sets.split(","):  # what the fitted costs predict for each layout's useful rate
            res = result[set_name]
            for name in names:
                res[name]["predicted_rate_vs_video"] = {
                    kind: predicted_rate(res[name], fit[kind]["partial_cost_in_full_blocks"])
                    / predicted_rate(res["video"], fit[kind]["partial_cost_in_full_blocks"])
                    for kind in ("fwd", "bwd")} if "video" in res else None
        for kind in ("fwd", "bwd"):
            f = result["fit"][kind]
            print(f"fit {kind}: FA4 time x{f['time_ratio']:.3f} with action tokens, useful rate x"
                  f"{f['useful_rate_ratio']:.3f}; a partial block costs {f['partial_cost_in_full_blocks']:.2f} "
                  "full ones")
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
