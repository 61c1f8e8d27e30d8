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
           "pack-float8-tensorwise": {"tokens_per_s": 140.0, "tokens_per_s_total": 138.0, "mfu": 0.84,
                                      "peak_mem_gb": 59.0},
           "diffusers-compiled": {"tokens_per_s": 90.0},
           # the loop's window over the bare step's packs, against those packs' total (not the median per step)
           "loop-float8-tensorwise": {"tokens_per_s": 133.0, "same_window_tokens_per_s": 131.1, "same_packs": True},
           "loop-float8-rowwise": {"tokens_per_s": 120.0, "same_window_tokens_per_s": None, "same_packs": False},
           "pack-eager": {"error": "RuntimeError: out of memory"}}
    train_step._summarize(res)
    assert res["pack_tokens_per_s"] == 140.0 and res["mfu_pack"] == 0.84
    assert res["pack_vs_diffusers_compiled"] == pytest.approx(140 / 90)
    f8 = res["float8"]
    assert f8["mode"] == "tensorwise" and f8["tokens_per_s"] == 140.0 and f8["bf16_tokens_per_s"] == 100.0
    assert f8["speedup_vs_bf16"] == pytest.approx(1.4) and f8["modes"] == {"rowwise": 130.0, "tensorwise": 140.0}
    assert res["loop-float8-tensorwise"]["loop_vs_step"] == pytest.approx(131.1 / 138.0)
    # different packs: no ratio rather than a misleading one
    assert res["loop_vs_step"] == {"loop-float8-tensorwise": pytest.approx(0.95), "loop-float8-rowwise": None}


def test_without_float8_pack_stays_the_bf16_step():
    res = {"pack-compiled": {"tokens_per_s": 100.0, "mfu": 0.6}, "diffusers-compiled": {"tokens_per_s": 80.0}}
    train_step._summarize(res)
    assert res["pack_tokens_per_s"] == 100.0 and "float8" not in res and res["pack_vs_diffusers_compiled"] == 1.25
    assert train_step.float8_of("pack-float8-rowwise") == "rowwise" and train_step.float8_of("pack-compiled") == "off"
    assert [train_step.parse_ac(x) for x in ("true", "False", "26", "selective")] == [True, False, 26, "selective"]


def test_loop_is_timed_on_the_bare_steps_packs(tmp_path):
    """``--smoke`` end to end (tiny model, CPU): the loop's first measured window covers exactly the packs the
    bare step timed, and ``loop_vs_step`` is set from that window; a --steps that differs is refused."""
    import json
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "train_step.py"
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, str(script), "--smoke", "--sets", "ref", "--variants",
                    "pack-compiled,loop-compiled", "--host-steps", "1", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    ref = json.loads(out.read_text())["ref"]
    loop = ref["loop-compiled"]
    assert loop["same_packs"] is True and loop["same_window_tokens_per_s"] == loop["windows"][1]
    assert ref["loop_vs_step"]["loop-compiled"] == pytest.approx(
        loop["windows"][1] / ref["pack-compiled"]["tokens_per_s_total"])
    bad = subprocess.run([sys.executable, str(script), "--sets", "ref", "--variants", "pack-compiled,loop-compiled",
                          "--steps", "6", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--steps (6) must equal --loop-log-every (10)" in bad.stderr


def test_pick_checkpointing_takes_the_fastest_setting_under_the_limit(tmp_path):
    import json

    pick = pytest.importorskip("pick_checkpointing")
    runs = {"true": {"tokens_per_s": 14.1, "peak_mem_gb": 94.4}, "24": {"tokens_per_s": 14.8, "peak_mem_gb": 126.4},
            "selective": {"error": "OutOfMemoryError"}}
    assert pick.pick(runs, 130) == "24" and pick.pick(runs, 125) == "true"
    assert pick.pick({"selective": {"error": "OutOfMemoryError"}}, 130) == "true"  # none fits: every block
    for k, r in runs.items():  # as the ac stage leaves them: one train_step.py JSON per setting
        (tmp_path / f"ac_{k}.json").write_text(json.dumps({"device": "x", "ref": {"pack-float8-tensorwise": r}}))
    import subprocess

    out = tmp_path / "all.json"
    done = subprocess.run([sys.executable, str(Path(pick.__file__)), str(tmp_path), "--limit-gb", "130",
                           "--out", str(out)], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "24"
    d = json.loads(out.read_text())
    assert d["chosen"] == "24" and set(d["settings"]) == {"true", "24", "selective"} and d["limit_gb"] == 130


def test_action_channels_reach_the_items_and_the_model_and_refuse_diffusers(tmp_path):
    """``--action-channels``: the items carry actions of that width (4 steps a frame), the model config
    gets them, and the ``wan5b`` set is train_wan5b.sh's episode lengths; diffusers variants are refused."""
    import argparse
    import subprocess

    from flexpack.packing.lengths import read_frames_file

    items = train_step.Items([5, 3], 4, 4, 4, 6, 32, Ca=6, A=4)
    it = items[1]
    assert it["action"].shape == (6, 3, 4) and it["action_mask"].all() and it["action"].abs().max() <= 1
    assert "action" not in train_step.Items([5], 4, 4, 4, 6, 32)[0]
    args = argparse.Namespace(smoke=True, layers=2, action_channels=6, max_tokens=512, activation_checkpointing=False,
                              memory_budget=1.0)
    assert train_step.config(args, "pack", False).model.overrides["action_channels"] == 6
    wan5b = train_step.length_sets(False)["wan5b"]
    assert wan5b[:13] == read_frames_file(train_step.WAN5B) and len(wan5b) == 13 * 40 and max(wan5b) == 350
    bad = subprocess.run([sys.executable, str(Path(train_step.__file__)), "--action-channels", "30", "--variants",
                          "pack-compiled,diffusers-compiled", "--out", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "diffusers' Wan has no actions" in bad.stderr
