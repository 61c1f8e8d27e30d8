"""benchmarks/action_attention.py on the CPU: the layouts it compares hold the same episodes, block counts match
the episode boundaries, and the fitted partial-block cost reproduces the recorded FA4 time ratios."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
aa = pytest.importorskip("action_attention")


def test_layouts_hold_the_same_episodes_and_aligned_starts_on_blocks():
    lens = [33, 7, 64, 20]
    for name in ("video", "actions", "actions128", "aligned"):
        tl, pad = aa.layout(lens, name, 200)
        sizes = [n for d, n in tl.runs if d >= 0]
        tpf = 32 if name == "video" else 36
        unit = 4 if name == "aligned" else tpf  # aligned runs count 4-token units
        assert [n * unit for n in sizes] == [n * tpf for n in lens], name
        if name == "aligned":
            at, starts = 0, []
            for d, n in tl.runs:  # runs of 4-token units in token order
                starts += [at * 4] if d >= 0 else []
                at += n
            assert all(s % 128 == 0 for s in starts) and len(starts) == len(lens)
            assert pad == 96  # 33 frames = 1,188 tokens: 92 to the next block; 7 more frames: 4 more
        else:
            assert pad == 0
    assert aa.layout(lens, "actions128", 200)[0].num_tokens == 204 * 36


def test_block_counts_follow_the_boundaries():
    # 32 frames x 36 tokens = 9 blocks: both episodes block-aligned, every visited block full
    s = aa.block_stats(aa.layout([32, 32], "actions", 64)[0])
    assert (s["full"], s["partial"]) == (2 * 81, 0) and s["useful_pairs"] == s["computed_pairs"]
    # one frame more: the boundary cuts a block, which is partial against both episodes' blocks
    s = aa.block_stats(aa.layout([33, 31], "actions", 64)[0])
    assert s["partial"] > 0 and s["useful_pairs"] < s["computed_pairs"]
    v = aa.varlen_stats([33, 31])
    assert v["computed_pairs"] == (10 * 10 + 9 * 9) * 128 * 128 and v["useful_pairs"] == (33 * 36) ** 2 + (31 * 36) ** 2


def test_fitted_partial_cost_reproduces_the_recorded_time_ratios():
    from train_step import length_sets

    fit = aa.fit_partial_cost(length_sets(False)["wan5b"])
    a0, a30 = fit["a0"], fit["a30"]
    assert len(a0["episodes"]) == 7 and len(a30["episodes"]) == 6  # the packs the two profiles timed
    for kind in ("fwd", "bwd"):
        c = fit[kind]["partial_cost_in_full_blocks"]
        model = (a30["full"] + c * a30["partial"]) / (a0["full"] + c * a0["partial"])
        assert model == pytest.approx(a30[kind] / a0[kind], rel=1e-9) and c > 1
    assert fit["bwd"]["useful_rate_ratio"] < fit["fwd"]["useful_rate_ratio"] < 1
