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
    assert res["pack_vs_diffusers_compiled"] == pytest.approx(100 / 90)  # bf16 against bf16
    f8 = res["float8"]
    assert f8["mode"] == "tensorwise" and f8["tokens_per_s"] == 140.0 and f8["bf16_tokens_per_s"] == 100.0
    assert f8["speedup_vs_bf16"] == pytest.approx(1.4) and f8["modes"] == {"rowwise": 130.0, "tensorwise": 140.0}
    assert res["loop-float8-tensorwise"]["loop_vs_step"] == pytest.approx(131.1 / 138.0)
    # different packs: no ratio rather than a misleading one
    assert res["loop_vs_step"] == {"loop-float8-tensorwise": pytest.approx(0.95), "loop-float8-rowwise": None}


def test_like_for_like_keys_put_bf16_against_bf16_and_float8_against_float8():
    """Fabricated timings: the headline ratio is bf16 over bf16, the float8 ratio the fastest float8 packed step
    over diffusers' fastest compiled float8 step, and a set without a float8 diffusers run has no float8 ratio."""
    res = {"pack-compiled": {"tokens_per_s": 110.0, "recompiles_after_warmup": 0},
           "pack-float8-tensorwise": {"tokens_per_s": 150.0, "recompiles_after_warmup": 2},
           "pack-float8-rowwise": {"tokens_per_s": 140.0},
           "diffusers-compiled": {"tokens_per_s": 88.0}, "diffusers-regional": {"tokens_per_s": 80.0},
           "diffusers-float8-compiled": {"tokens_per_s": 100.0}, "diffusers-float8-regional": {"tokens_per_s": 120.0},
           "diffusers-eager": {"tokens_per_s": 60.0}}
    train_step._summarize(res)
    assert res["pack_vs_diffusers_compiled"] == pytest.approx(110 / 88)
    assert res["pack_float8_vs_diffusers_float8"] == pytest.approx(150 / 120)
    assert res["comparisons"]["float8"] == {"pack_variant": "pack-float8-tensorwise", "pack_tokens_per_s": 150.0,
                                            "diffusers_variant": "diffusers-float8-regional",
                                            "diffusers_tokens_per_s": 120.0, "ratio": pytest.approx(1.25)}
    assert res["comparisons"]["bf16"]["diffusers_variant"] == "diffusers-compiled"
    assert (res["pack_variant"], res["pack_tokens_per_s"], res["pack_bf16_tokens_per_s"]) == (
        "pack-float8-tensorwise", 150.0, 110.0)
    assert res["diffusers_float8_tokens_per_s"] == 120.0 and res["diffusers_compiled_tokens_per_s"] == 88.0
    assert res["recompiles_after_warmup"] == 2  # any packed variant's recompiles show in the set's key
    only_bf16 = {"pack-compiled": {"tokens_per_s": 100.0}, "pack-float8-tensorwise": {"tokens_per_s": 130.0},
                 "diffusers-compiled": {"tokens_per_s": 80.0}}
    train_step._summarize(only_bf16)
    assert only_bf16["pack_vs_diffusers_compiled"] == 1.25 and only_bf16["pack_float8_vs_diffusers_float8"] is None
    eager_pack = {"pack-eager": {"tokens_per_s": 90.0}, "diffusers-compiled": {"tokens_per_s": 80.0}}
    train_step._summarize(eager_pack)  # an eager packed step is not set against a compiled diffusers one
    assert eager_pack["pack_vs_diffusers_compiled"] is None and eager_pack["pack_tokens_per_s"] == 90.0


def test_diffusers_float8_converts_the_layers_flexpack_converts():
    """The diffusers variant's conversion judges each diffusers module by its WanVA name with flexpack's own
    filter: on tiny models (the width floor lowered to 16) the same layers of the same blocks, cross-attention
    key and value left out; emulated float8 runs on the CPU."""
    diffusers = pytest.importorskip("diffusers")
    pytest.importorskip("torchao")
    import torch

    diffusers_step = pytest.importorskip("diffusers_step")
    from flexpack.families.wan.config import wan_config
    from flexpack.families.wan.model import WanVA
    from flexpack.parallel import float8

    ref = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                          num_layers=2, freq_dim=16, in_channels=4, out_channels=4, text_dim=32,
                                          ffn_dim=64)
    got = diffusers_step.convert_float8(ref, "tensorwise", emulate=True, min_dim=16)
    ours = WanVA(wan_config("tiny", dim=32, num_heads=2, ffn_dim=64, num_layers=2, action_channels=0))
    want = float8.convert(ours, "tensorwise", emulate=True, min_dim=16)
    assert sorted(diffusers_step.flexpack_name(n) for n in got) == sorted(want)
    assert len(want) == 2 * 8 and not [n for n in got if "attn2.to_k" in n or "attn2.to_v" in n]
    assert all(type(m).__name__ == "Float8Linear" for n, m in ref.named_modules() if n in got)
    x = torch.randn(1, 4, 2, 4, 4)
    out = ref(hidden_states=x, timestep=torch.tensor([500.0]), encoder_hidden_states=torch.randn(1, 5, 32),
              return_dict=False)[0]
    out.square().mean().backward()
    assert torch.isfinite(out).all() and all(p.grad is not None for p in ref.blocks[0].attn1.to_q.parameters())
    assert diffusers_step.variant("diffusers-float8-compiled") == ("tensorwise", "whole")
    assert diffusers_step.variant("diffusers-eager") == ("off", False)
    with pytest.raises(ValueError, match="not a diffusers variant"):
        diffusers_step.variant("diffusers-float8-fast")


def test_without_float8_pack_stays_the_bf16_step():
    res = {"pack-compiled": {"tokens_per_s": 100.0, "mfu": 0.6}, "diffusers-compiled": {"tokens_per_s": 80.0}}
    train_step._summarize(res)
    assert res["pack_tokens_per_s"] == 100.0 and "float8" not in res and res["pack_vs_diffusers_compiled"] == 1.25
    assert train_step.float8_of("pack-float8-rowwise") == "rowwise" and train_step.float8_of("pack-compiled") == "off"
    assert [train_step.parse_ac(x) for x in ("true", "False", "26", "selective")] == [True, False, 26, "selective"]


@pytest.mark.slow  # a benchmark subprocess that compiles its steps: over a minute on 2 cores
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


def test_float8_variants_are_refused_in_one_line_without_a_float8_gpu(tmp_path):
    import subprocess

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal is for machines without an sm89+ one")
    script = Path(train_step.__file__)
    bad = subprocess.run([sys.executable, str(script), "--sets", "long", "--variants",
                          "pack-compiled,diffusers-float8-compiled", "--out", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and not (tmp_path / "r.json").exists()
    line = bad.stderr.strip().splitlines()[-1]
    assert "diffusers-float8-compiled: float8 matmuls need an NVIDIA GPU of compute capability 8.9" in line
    assert "this run is on cpu" in line
    unknown = subprocess.run([sys.executable, str(script), "--variants", "diffusers-float8-fast", "--out",
                              str(tmp_path / "r.json")], capture_output=True, text=True, timeout=300)
    assert unknown.returncode == 2 and "unknown variant(s) ['diffusers-float8-fast']" in unknown.stderr


@pytest.mark.slow
def test_smoke_of_very_short_episodes_compiles_nothing_after_warmup(tmp_path):
    """``--smoke`` on the tiny veryshort set (packs of ~60-70 one-to-four-frame episodes, across 64): the compiled
    packed step compiles nothing after its warm-up, the text slots are the sampler's bound, and the set records
    the like-for-like keys and the packing waste (the float8 diffusers variant runs emulated)."""
    import json
    import subprocess

    from flexpack.packing.batch_sampler import TokenBudgetBatchSampler

    out = tmp_path / "r.json"
    subprocess.run([sys.executable, str(Path(train_step.__file__)), "--smoke", "--sets", "veryshort", "--variants",
                    "pack-compiled,diffusers-float8-eager", "--out", str(out)], check=True, capture_output=True,
                   timeout=900)
    res = json.loads(out.read_text())["veryshort"]
    assert res["pack-compiled"]["recompiles_after_warmup"] == 0 and res["recompiles_after_warmup"] == 0
    lengths = train_step.length_sets(True)["veryshort"]
    sampler = TokenBudgetBatchSampler(lengths, 512, tokens_per_frame=4)
    counts = [len(b) for b in sampler]
    assert min(counts) <= 64 < max(counts)  # the packs' episode counts cross a power of two
    assert res["text_slots"] == sampler.most_per_batch() > 64
    assert res["diffusers-float8-eager"]["float8"] == "tensorwise" and res["pack_float8_vs_diffusers_float8"] is None
    assert 0 <= res["packing_waste"] <= res["packing_waste_incl_repeats"] < 0.2
    assert {"comparisons", "pack_vs_diffusers_compiled", "diffusers_float8_tokens_per_s"} <= set(res)
