"""benchmarks/lingbot_bundle.py (issue 44): its synthetic bundle has RoboTwin's shapes as the run reads them, every
variant trains the same segments per optimizer step, its CPU stand-in for upstream's flex attention equals
FlexAttention, and its CPU smoke run writes every key (flexpack's variants always; upstream's recipe where a
checkout of robbyant/lingbot-va and easydict are at hand)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import lingbot_bundle as lb  # noqa: E402
import lingbot_upstream as lu  # noqa: E402

VARIANT_KEYS = {"useful_tokens_per_s", "mfu", "peak_mem_gb", "recompiles_after_warmup", "step_s", "pad_fraction",
                "micro_batches_per_step", "params", "losses", "finite", "device"}
TOP_KEYS = {"command", "device", "date", "commit", "packed_vs_recipe", "packed_vs_batch1", "params_match"}


def _args(tmp_path: Path, *extra: str):
    args = lb.parse(["--variants", "packed,batch1", "--out", str(tmp_path / "out.json"), *extra])
    args.bundle = tmp_path / "bundle"
    return args


def test_synthetic_bundle_reads_with_robotwin_shapes(tmp_path: Path) -> None:
    """The GPU shapes (no model built): tshape 24x20 grid = 120 video tokens, 16 action steps on RoboTwin's 16
    channels of 30, 512 x 4096 text, and a 32768-token pack of 240 frames."""
    args = _args(tmp_path)
    frames = [5, 40, 17]
    lb.write_synthetic(args.bundle, frames, False, 0)
    run = lb.build_run(lb.config(args, "packed"), device=torch.device("cpu"))
    assert run.dataset.lengths() == frames
    g = run.geometry
    assert (g.video_tokens, g.action_tokens, g.copies, run.sampler.budget_frames) == (120, 16, 2, 240)
    item = run.dataset[1]
    assert item["latent"].shape == (48, 40, 24, 20) and item["text"].shape == (512, 4096)
    assert item["action"].shape == (30, 40, 16)
    filled = item["action_mask"].any(dim=(1, 2)).nonzero().flatten().tolist()
    assert filled == sorted(lb.ROBOTWIN_CHANNELS)
    assert item["frame_ids"][1] - item["frame_ids"][0] == 4
    batch = lu.upstream_batch(item)
    assert {k: (tuple(v.shape), v.dtype) for k, v in batch.items()} == {
        "latents": ((1, 48, 40, 24, 20), torch.bfloat16), "actions": ((1, 30, 40, 16, 1), torch.float32),
        "actions_mask": ((1, 30, 40, 16, 1), torch.bool), "text_emb": ((1, 512, 4096), torch.bfloat16)}
    batch["actions"].mul_(0)  # upstream's _add_noise works in place: the item keeps its values
    assert item["action"].abs().sum() > 0


def test_every_variant_trains_the_same_segments(tmp_path: Path) -> None:
    args = _args(tmp_path, "--global-batch", "6", "--steps", "2", "--warmup", "1")
    steps = lb.plan(20, args)
    assert [len(s) for s in steps] == [6, 6, 6] and len({i for s in steps for i in s}) == 18
    assert steps == lb.plan(20, args)  # seeded
    lengths = list(range(1, 21))

    class Run:  # what micro_batches reads of a pack-mode run
        class sampler:
            budget_frames = 25

    for k, step in enumerate(steps):
        assert lb.micro_batches("batch1", step, lengths, Run, k, 0) == [[i] for i in step]
        bins = lb.micro_batches("packed", step, lengths, Run, k, 0)
        assert sorted(i for b in bins for i in b) == sorted(step)
        assert all(sum(lengths[i] for i in b) <= 25 for b in bins)


def test_cpu_stand_in_equals_flex_attention() -> None:
    """dense_flex (upstream's attention on the CPU, where FlexAttention has no backward) gives FlexAttention's
    output, zeros on the padding rows that may attend nothing included, and has a gradient."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    seq = torch.tensor([0] * 90 + [1] * 120 + [-1] * 46)  # two documents, then padding (upstream pads to 128)

    def mask_mod(b, h, q, kv):
        return (seq[q] == seq[kv]) & (seq[q] >= 0) & (kv <= q + 7)

    bm = create_block_mask(mask_mod, 1, 1, 256, 256, device="cpu")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 32, generator=g) for _ in range(3))
    want = flex_attention(q, k, v, block_mask=bm)
    q.requires_grad_(True)
    got = lu.dense_flex(q, k, v, block_mask=bm, kernel_options={"BLOCK_M": 64})
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got[:, :, 210:].abs().max() == 0
    got.sum().backward()
    assert torch.isfinite(q.grad).all() and q.grad[:, :, :210].abs().sum() > 0


def _smoke(tmp_path: Path, *extra: str, env: dict | None = None) -> dict:
    out = tmp_path / "lingbot_bundle.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lingbot_bundle.py"), "--smoke", "--out", str(out),
                           *extra], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def _check_variant(r: dict) -> None:
    assert VARIANT_KEYS <= set(r), (sorted(VARIANT_KEYS - set(r)), r.get("error"))
    assert r["useful_tokens_per_s"] > 0 and r["mfu"] > 0 and r["finite"]
    assert r["recompiles_after_warmup"] == 0 and 0 <= r["pad_fraction"] < 1


def test_smoke_flexpack_variants(tmp_path: Path) -> None:  # ~5 s on 2 cores
    res = _smoke(tmp_path, "--variants", "packed,batch1")
    assert TOP_KEYS <= set(res) and res["device"] == "cpu" and res["smoke"]
    for name in ("packed", "batch1"):
        _check_variant(res["variants"][name])
    v = res["variants"]
    assert v["packed"]["useful_tokens_per_step"] == v["batch1"]["useful_tokens_per_step"]  # the same segments
    assert v["batch1"]["micro_batches_per_step"] == 4 and v["packed"]["micro_batches_per_step"] < 4
    assert res["params_match"] and res["packed_vs_batch1"] > 0 and res["packed_vs_recipe"] is None


def _upstream() -> Path | None:
    for cand in (os.environ.get("LINGBOT_VA_UPSTREAM", ""), str(ROOT / ".upstream-lingbot-va")):
        if cand and (Path(cand) / "wan_va" / "train.py").is_file():
            return Path(cand)
    return None


@pytest.mark.slow  # upstream's imports (diffusers, transformers) and three tiny models on the CPU: 20-40 s
@pytest.mark.skipif(_upstream() is None, reason="no upstream checkout (LINGBOT_VA_UPSTREAM or .upstream-lingbot-va)")
@pytest.mark.skipif(importlib.util.find_spec("easydict") is None, reason="easydict (upstream's configs) not installed")
def test_smoke_with_upstream_recipe(tmp_path: Path) -> None:
    res = _smoke(tmp_path, "--upstream", str(_upstream()))
    for name in ("packed", "batch1", "recipe"):
        _check_variant(res["variants"][name])
    recipe = res["variants"]["recipe"]
    assert recipe["source"] == "upstream" and recipe["weights"] == "bfloat16" and not recipe["fsdp"]
    assert {"dataset", "utils.sever_utils"} <= set(recipe["stubbed_modules"])
    assert recipe["cpu_attention"] and recipe["micro_batches_per_step"] == res["global_batch"]
    assert res["params_match"]  # upstream's model and flexpack's lingbot-va, parameter for parameter
    assert all(np.isfinite(res[k]) and res[k] > 0 for k in ("packed_vs_recipe", "packed_vs_batch1", "batch1_vs_recipe"))
