"""benchmarks/train_step.py's per-set summary: with float8 variants the float8 step is `pack`, the
`float8` key names the mode and both throughputs, and loop variants are set against their bare step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
train_step = pytest.importorskip("train_step")


def test_float8_is_pack_and_loop_is_set_against_its_step():
    res = {"pack-compiled": {"tokens_per_s": 100.0, "mfu": 0.6, "peak_mem_gb": 60.0},
           "pack-float8-rowwise": {"tokens_per_s": 130.0, "mfu": 0.78, "peak_mem_gb": 61.0},
           "pack-float8-tensorwise": {"tokens_per_s": 140.0, "mfu": 0.84, "peak_mem_gb": 59.0},
           "diffusers-compiled": {"tokens_per_s": 90.0},
           "loop-float8-tensorwise": {"tokens_per_s": 133.0},
           "pack-eager": {"error": "RuntimeError: out of memory"}}
    train_step._summarize(res)
    assert res["pack_tokens_per_s"] == 140.0 and res["mfu_pack"] == 0.84
    assert res["pack_vs_diffusers_compiled"] == pytest.approx(140 / 90)
    f8 = res["float8"]
    assert f8["mode"] == "tensorwise" and f8["tokens_per_s"] == 140.0 and f8["bf16_tokens_per_s"] == 100.0
    assert f8["speedup_vs_bf16"] == pytest.approx(1.4) and f8["modes"] == {"rowwise": 130.0, "tensorwise": 140.0}
    assert res["loop-float8-tensorwise"]["loop_vs_step"] == pytest.approx(0.95)
    assert res["loop_vs_step"] == {"loop-float8-tensorwise": pytest.approx(0.95)}


def test_without_float8_pack_stays_the_bf16_step():
    res = {"pack-compiled": {"tokens_per_s": 100.0, "mfu": 0.6}, "diffusers-compiled": {"tokens_per_s": 80.0}}
    train_step._summarize(res)
    assert res["pack_tokens_per_s"] == 100.0 and "float8" not in res and res["pack_vs_diffusers_compiled"] == 1.25
    assert train_step.float8_of("pack-float8-rowwise") == "rowwise" and train_step.float8_of("pack-compiled") == "off"
    assert [train_step.parse_ac(x) for x in ("true", "False", "26", "selective")] == [True, False, 26, "selective"]
