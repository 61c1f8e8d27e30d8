"""The count of the pairs LingBot-VA's mask keeps (behind every lingbot-va MFU) is the mask's own; of
benchmarks/lingbot_va.py: its CPU smoke run writes every key of the results JSON, and full_5b comes from a
run's metrics.jsonl."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexpack.attention.masks import dense_mask, make_mask
from flexpack.families.lingbot.objective import lingbot_pairs
from flexpack.packing.layout import SequenceLayout

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from lingbot_va import full_5b, search_batches  # noqa: E402

SET_KEYS = {"flexpack_tokens_per_s", "lerobot_tokens_per_s", "flexpack_vs_lerobot", "mfu", "peak_mem_gb",
            "recompiles_after_warmup", "command"}


def test_pairs_are_the_masks_own() -> None:
    """Per episode, lingbot_pairs counts exactly the (query, key) pairs of the dense lingbot mask."""
    rng = random.Random(0)
    for _ in range(12):
        frames, nv, na = rng.randint(1, 9), rng.randint(1, 3), rng.randint(1, 4)
        chunk, window = rng.randint(1, 4), rng.randint(0, 9)
        tl = SequenceLayout.from_rows([[frames]], frames + 2).tokens(nv, na, copies=2)
        T = tl.num_tokens
        want = int(dense_mask(make_mask(tl, "lingbot", chunk_size=chunk, window=window), T, T).sum())
        assert lingbot_pairs(frames, nv, na, chunk, window) == want, (frames, nv, na, chunk, window)


def test_lerobot_batch_search() -> None:
    """The probe, four times it, then the batch that fills 90 % by the probe's memory per clip, 0.75x on OOM."""
    tried = []

    def attempt(B):  # 1 GB static, 0.1 GB per clip, fits up to 500 clips
        tried.append(B)
        return {"peak_mem_gb": 1.0 + 0.1 * B} if B <= 500 else None

    search_batches(attempt, 16, 1e9, 100e9, 4096)
    assert tried == [16, 64, 888, 664, 496]  # (90 - 1) / 0.1 = 890 -> 888, then 0.75x twice
    tried.clear()
    search_batches(attempt, 16, 1e9, 100e9, 100)  # capped: no point between
    assert tried == [16, 96]


def test_full_5b_from_metrics(tmp_path) -> None:
    rows = [{"step": 10, "loss": 2.0, "tokens_per_s": 100.0, "mfu": 0.1, "peak_mem_gb": 90.0},
            {"step": 20, "loss": 1.5, "tokens_per_s": 7000.0, "mfu": 0.5, "peak_mem_gb": 95.0},
            {"step": 30, "loss": 1.2, "tokens_per_s": 7200.0, "mfu": 0.52, "peak_mem_gb": 94.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = full_5b(tmp_path / "metrics.jsonl", "cmd", "tensorwise", "true")
    assert got["tokens_per_s"] == 7100.0 and got["computed_tokens_per_s"] == 14200.0  # windows 2+, both copies
    assert (got["peak_mem_gb"], got["float8"], got["activation_checkpointing"], got["command"]) == (
        95.0, "tensorwise", "true", "cmd")


@pytest.mark.slow  # lerobot and diffusers imports plus both models on the CPU: ~40 s
def test_smoke_run_writes_every_key(tmp_path) -> None:
    pytest.importorskip("lerobot.policies.lingbot_va", reason="the installed lerobot has no lingbot_va policy")
    out = tmp_path / "lingbot_va.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lingbot_va.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    for name in ("ref", "short"):
        got = res[name]
        assert SET_KEYS <= set(got), sorted(SET_KEYS - set(got))
        assert got["flexpack_tokens_per_s"] > 0 and got["lerobot_tokens_per_s"] > 0 and got["mfu"] > 0
        assert got["lerobot_mfu"] > 0
        assert got["recompiles_after_warmup"] == 0 and got["flexpack"]["bf16"]["finite"]
        assert got["lerobot"]["finite"] and got["lerobot"]["batch"] == 2
    assert torch.isfinite(torch.tensor(res["ref"]["flexpack_vs_lerobot"]))
