"""LINGBOT_PROFILE: whole-step windows, micro-step lines, time categories (CPU ops here, CUDA kernels on
synthetic profiler events), MFU by construction, named ranges in the trace, quiet on a CPU-only machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from flexpack.run.resolve import model_config_of  # noqa: E402
from flexpack.training.observe import profile_summary as ps
from flexpack.training.observe.profiling import StepProfiler, plan
from helpers import tiny_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
KEYS = {"step", "micro_step", "phase", "tokens", "valid_tokens", "episodes", "fwd_s", "bwd_s", "fwd_bwd_s",
        "peak_mem_bytes", "useful_flops"}


def test_plan_fits_whole_steps_into_short_runs():
    assert plan(3, 2, None) == (2, 1, 3, None)
    assert plan(3, 2, 6) == (2, 1, 3, None)  # exactly enough
    warm, pw, active, note = plan(5, 2, 3)  # the case: fewer steps than warm-up + n
    assert (warm, pw, active) == (1, 1, 1)
    assert note == ("LINGBOT_PROFILE=5: the run has 3 step(s) left, fewer than 2 warm-up + 1 profiler warm-up + 5; "
                    "profiling 1 step(s) after 1 + 1 warm-up")
    assert plan(5, 2, 3, "profile.steps")[3].startswith("profile.steps=5: the run has 3 step(s) left")
    assert plan(2, 2, 5)[:3] == (2, 1, 2)
    assert plan(4, 0, 2)[:3] == (0, 1, 1)
    assert plan(4, 3, 1)[:3] == (0, 0, 1)  # one step left: profile it, no warm-up
    assert plan(4, 3, 0)[:3] == (0, 0, 0)


# ---------------------------------------------------------------------------- the train loop (CPU)
@pytest.fixture
def dataset(tiny_dataset) -> Path:
    return tiny_dataset  # the session's dataset (only read here)


def _train(root: Path, out: Path, *overrides: str):
    from flexpack.commands.train import train  # the command layer reads LINGBOT_PROFILE / _WARMUP

    return train(tiny_config(root, out, "log.tensorboard=false", *overrides))  # every call sets accum_steps


@pytest.mark.usefixtures("one_thread")
def test_profile_files_lines_categories_and_ranges(dataset, tmp_path, monkeypatch):
    monkeypatch.setenv("LINGBOT_PROFILE", "2")
    monkeypatch.setenv("LINGBOT_PROFILE_WARMUP", "1")
    _train(dataset, tmp_path / "run", "schedule.steps=5", "optim.accum_steps=2")
    prof = tmp_path / "run" / "profile"
    lines = [json.loads(x) for x in (prof / "steps_rank0.jsonl").read_text().splitlines()]
    # warm-up step 1, profiler warm-up step 2, profiled steps 3 and 4; two micro-steps each; step 5 not
    assert [(x["step"], x["micro_step"]) for x in lines] == [(s, m) for s in (1, 2, 3, 4) for m in (0, 1)]
    assert [x["phase"] for x in lines] == ["warmup"] * 4 + ["profiled"] * 4
    for x in lines:
        assert set(x) == KEYS
        assert x["tokens"] == 60 and 0 < x["valid_tokens"] <= 60 and x["valid_tokens"] % 5 == 0  # 5 tokens per frame
        assert x["episodes"] >= 1 and x["fwd_s"] > 0 and x["bwd_s"] > 0 and x["peak_mem_bytes"] > 2**20
        assert x["fwd_bwd_s"] == pytest.approx(x["fwd_s"] + x["bwd_s"])
        assert x["useful_flops"] > 0
    s = json.loads((prof / "summary_rank0.json").read_text())
    assert s["time_base"] == "cpu ops" and s["profiled_steps"] == [3, 4] and s["note"] is None
    assert set(s["categories"]) == set(ps.CATEGORIES)
    assert sum(s["categories"].values()) == pytest.approx(1.0)
    for cat in ("attention", "gemm", "elementwise", "optimizer"):
        assert s["categories"][cat] > 0.02, (cat, s["categories"])
    assert s["categories"]["communication"] == 0.0  # one process
    assert s["mfu"] is None and s["peak_flops"] is None  # no MFU without a GPU
    profiled = [x for x in lines if x["phase"] == "profiled"]
    wall = sum(s["step_seconds"])
    assert len(s["step_seconds"]) == 2
    assert s["tokens_per_s"] == pytest.approx(sum(x["tokens"] for x in profiled) / wall)
    assert s["useful_flops"] == pytest.approx(sum(x["useful_flops"] for x in profiled))
    # ranges: two micro-steps x two profiled steps of forward and backward, one optimizer per step
    assert s["ranges"]["forward"]["count"] == 4 and s["ranges"]["backward"]["count"] == 4
    assert s["ranges"]["optimizer"]["count"] == 2 and s["ranges"]["block_mask"]["count"] > 0
    assert s["ranges"]["attention"]["count"] == 4 * 2 * 2  # 2 layers x (self + text) per micro-step
    kernels = s["kernels"]
    assert kernels and [k["ms"] for k in kernels] == sorted((k["ms"] for k in kernels), reverse=True)
    assert {k["category"] for k in kernels} <= set(ps.CATEGORIES)
    assert any(k["name"] == "aten::addmm" and k["category"] == "gemm" for k in kernels)
    events = json.loads((prof / "trace_rank0.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"forward", "backward", "optimizer", "block_mask", "data", "attention"} <= names
    assert sum(str(e.get("name", "")).startswith("ProfilerStep#") for e in events) == 2
    top = (prof / "top_ops_rank0.txt").read_text()
    assert top.startswith("2 profiled step(s) after 1 + 1 warm-up") and "aten::addmm" in top


@pytest.mark.usefixtures("one_thread")
def test_short_run_says_so_and_profiles_what_there_is(dataset, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LINGBOT_PROFILE", "2")
    monkeypatch.delenv("LINGBOT_PROFILE_WARMUP", raising=False)  # default 2 warm-up steps
    _train(dataset, tmp_path / "run", "schedule.steps=3", "optim.accum_steps=1")
    err = capsys.readouterr().err
    assert "LINGBOT_PROFILE=2: the run has 3 step(s) left" in err and "profiling 1 step(s) after 1 + 1 warm-up" in err
    prof = tmp_path / "run" / "profile"
    s = json.loads((prof / "summary_rank0.json").read_text())
    assert s["profiled_steps"] == [3] and s["note"].startswith("LINGBOT_PROFILE=2")
    assert s["kernels"] and any(k["category"] == "gemm" for k in s["kernels"])  # never an empty table
    assert s["ranges"]["forward"]["count"] == 1 and s["ranges"]["optimizer"]["count"] == 1
    lines = [json.loads(x) for x in (prof / "steps_rank0.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]


@pytest.mark.usefixtures("one_thread")
def test_runtime_profile_steps_profiles_without_the_variable(dataset, tmp_path, monkeypatch):
    monkeypatch.delenv("LINGBOT_PROFILE", raising=False)
    monkeypatch.delenv("LINGBOT_PROFILE_WARMUP", raising=False)
    _train(dataset, tmp_path / "run", "schedule.steps=2", "optim.accum_steps=1", "profile.steps=1",
           "profile.warmup=0")
    prof = tmp_path / "run" / "profile"
    s = json.loads((prof / "summary_rank0.json").read_text())
    assert s["profiled_steps"] == [2] and s["warmup_steps"] == 1 and s["note"] is None  # 0 + the profiler's own
    lines = [json.loads(x) for x in (prof / "steps_rank0.jsonl").read_text().splitlines()]
    assert [(x["step"], x["phase"]) for x in lines] == [(1, "warmup"), (2, "profiled")]


def test_the_variable_wins_over_runtime_profile_steps_with_a_line(monkeypatch, capsys):
    """flexpack train reads the variables (profile_env) into profile.env_steps / env_warmup, which win over the
    keys; the profiler reads the config alone."""
    import dataclasses

    from flexpack.commands.train import profile_env
    from flexpack.run.config import load_config

    cfg = load_config(CONFIGS / "tiny_cpu.toml", ["profile.steps=3", "profile.warmup=1",
                                                  "profile.peak_tflops=50"])
    from flexpack.flow.objectives import as_objective
    from flexpack.packing.geometry import TokenGeometry

    kw = {"steps_left": 100, "first_step": 0, "model": model_config_of(cfg),
          "geometry": TokenGeometry(video_tokens=1, action_tokens=4), "device": torch.device("cpu"),
          "objective": as_objective(cfg.objective)}
    monkeypatch.delenv("LINGBOT_PROFILE", raising=False)
    monkeypatch.delenv("LINGBOT_PROFILE_WARMUP", raising=False)
    assert profile_env(cfg) is cfg
    p = StepProfiler.for_training(cfg.runtime, profile_env(cfg).profile, 0, **kw)
    assert (p.enabled, p.steps, p.warmup, p.peak_tflops) == (True, 3, 1, 50.0)
    assert capsys.readouterr().err == ""  # the config alone: nothing to say
    short = StepProfiler.for_training(cfg.runtime, cfg.profile, 0, **{**kw, "steps_left": 2})
    assert short.note.startswith("profile.steps=3: the run has 2 step(s) left")  # names where n came from
    monkeypatch.setenv("LINGBOT_PROFILE", "5")
    monkeypatch.setenv("LINGBOT_PROFILE_WARMUP", "1")  # the same as the key: no line for it
    env = profile_env(cfg)
    assert (env.profile.env_steps, env.profile.env_warmup) == (5, 1)  # recorded in the config the run saves
    assert dataclasses.asdict(env)["profile"]["env_steps"] == 5
    monkeypatch.delenv("LINGBOT_PROFILE")  # the profiler reads the config, never the environment
    p = StepProfiler.for_training(env.runtime, env.profile, 0, **kw)
    assert (p.steps, p.warmup) == (5, 1)
    assert capsys.readouterr().err == "LINGBOT_PROFILE=5 overrides profile.steps = 3\n"
    monkeypatch.setenv("LINGBOT_PROFILE", "5")
    assert profile_env(cfg, 1).profile.env_steps == 5 and capsys.readouterr().err == ""  # rank 0 speaks
    left_2 = StepProfiler.for_training(env.runtime, env.profile, 0, **{**kw, "steps_left": 2})
    assert left_2.note.startswith("LINGBOT_PROFILE=5:")
    monkeypatch.setenv("LINGBOT_PROFILE", "0")  # the variable switches a configured profile off
    off = profile_env(cfg)
    assert not StepProfiler.for_training(off.runtime, off.profile, 0, **kw).enabled and off.profile.env_warmup is None
    assert "LINGBOT_PROFILE=0 overrides profile.steps = 3" in capsys.readouterr().err
    monkeypatch.delenv("LINGBOT_PROFILE")  # a restart without the variables: the config's keys again
    assert profile_env(env).profile.window() == (3, 1, "profile.steps")
    with pytest.raises(ValueError, match="profile.steps must be >= 0, got -1"):
        load_config(CONFIGS / "tiny_cpu.toml", ["profile.steps=-1"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
def test_no_gpu_probe_error_on_a_cpu_only_machine(tmp_path):
    code = ("from flexpack.training.observe.profiling import StepProfiler\n"
            "import torch\n"
            f"with StepProfiler({str(tmp_path)!r}, steps=1, warmup=0, steps_left=2) as p:\n"
            "    for _ in range(2):\n"
            "        p.step(); torch.randn(8, 8) @ torch.randn(8, 8)\n"
            "print(sorted(f.name for f in p.written))\n")
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "gpuGetDeviceCount" not in out.stderr and "ERROR" not in out.stderr
    assert "summary_rank0.json" in out.stdout


def test_profiler_off_writes_nothing_and_hooks_are_noops(tmp_path, monkeypatch):
    monkeypatch.setenv("LINGBOT_PROFILE", "3")  # the profiler never reads the environment: off by default
    p = StepProfiler(tmp_path)
    with p:
        p.step()
        p.phase("forward", None)
        p.phase(None)
    assert not p.enabled and p.written == [] and not (tmp_path / "profile").exists()


def test_an_error_inside_the_window_is_the_error_seen(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with StepProfiler(tmp_path, steps=1, warmup=0, steps_left=4) as p:
            for _ in range(3):
                p.step()
                p.phase("forward", SimpleNamespace(layout=SimpleNamespace(frame_doc=torch.zeros(1, 4),
                                                                          episode_frames=torch.tensor([3]))))
            raise RuntimeError("boom")
    s = json.loads((tmp_path / "profile" / "summary_rank0.json").read_text())  # step 2 was profiled before it
    assert s["profiled_steps"] == [2]


# ---------------------------------------------------------------------------- CUDA events, synthetic
def _ev(name, start, end, *, parent=None, device=DeviceType.CPU, seq=-1, thread=1, fwd_thread=None, annotation=False):
    e = FunctionEvent(id=0, name=name, thread=thread, start_us=start, end_us=end, fwd_thread=fwd_thread,
                      sequence_nr=seq, device_type=device, is_user_annotation=annotation)
    if parent is not None:
        e.set_cpu_parent(parent)
        parent.append_cpu_child(e)
    return e


def _cuda_window():
    """One step as kineto would report it on a GPU: ops with kernels, ranges, a backward thread."""
    step = _ev("ProfilerStep#3", 0, 1000, annotation=True)
    fwd = _ev("forward", 10, 400, parent=step, annotation=True)
    mm = _ev("aten::mm", 20, 30, parent=fwd)
    mm.append_kernel("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", 0, 100.0)
    add = _ev("aten::add", 40, 45, parent=fwd)
    add.append_kernel("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", 0, 20.0)
    attn = _ev("attention", 50, 90, parent=fwd, annotation=True)
    flex = _ev("CompiledFunction", 55, 85, parent=attn, seq=7, thread=1)
    flex.append_kernel("triton_tem_fused_0", 0, 300.0)  # a template kernel with no telling name
    bm = _ev("block_mask", 95, 99, parent=fwd, annotation=True)
    sort = _ev("aten::sort", 96, 98, parent=bm)
    sort.append_kernel("void at::native::bitonicSortKVInPlace", 0, 5.0)
    fwd.append_kernel("forward", 0, 390.0)  # the range's GPU-side mirror: not work
    # backward on the autograd thread (2): the node of CompiledFunction, linked by its sequence number
    node = _ev("autograd::engine::evaluate_function: CompiledFunctionBackward", 420, 600, seq=7, thread=2, fwd_thread=1)
    inner = _ev("CompiledFunctionBackward", 421, 599, parent=node, thread=2)
    inner.append_kernel("triton_tem_fused_1", 0, 600.0)
    rs = _ev("c10d::reduce_scatter_tensor_coalesced_", 610, 620, parent=node, thread=2)
    rs.append_kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 0, 50.0)
    opt = _ev("optimizer", 700, 900, parent=step, annotation=True)
    adam = _ev("Optimizer.step#AdamW.step", 710, 890, parent=opt, annotation=True)
    fe = _ev("aten::_foreach_mul_", 720, 730, parent=adam)
    fe.append_kernel("void at::native::multi_tensor_apply_kernel<...>", 0, 40.0)
    cpu = [step, fwd, mm, add, attn, flex, bm, sort, node, inner, rs, opt, adam, fe]
    device = [_ev(k.name, 0, k.duration, device=DeviceType.CUDA) for e in cpu for k in e.kernels if k.name != e.name]
    device.append(_ev("triton_poi_fused_mul_0", 950, 960, device=DeviceType.CUDA))  # replayed graph: no launching op
    device.append(_ev("triton_tem_fused_2", 960, 970, device=DeviceType.CUDA))  # a template that is no matmul
    device.append(_ev("triton_tem_fused_addmm_3", 970, 980, device=DeviceType.CUDA))
    device.append(_ev("forward", 10, 400, device=DeviceType.CUDA, annotation=True))  # GPU-side range mirror
    return cpu + device


def test_cuda_kernels_are_classified_by_name_launching_op_and_forward_link():
    units = ps.extract_units(_cuda_window(), device_time=True)
    got = {u.name: ps.classify(u) for u in units}
    assert got == {
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT": "gemm",
        "void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>": "elementwise",
        "triton_tem_fused_0": "attention",  # inside the attention range
        "void at::native::bitonicSortKVInPlace": "other",  # block-mask build
        "triton_tem_fused_1": "attention",  # backward of an op created in the attention range
        "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL": "communication",
        "void at::native::multi_tensor_apply_kernel<...>": "optimizer",
        "triton_poi_fused_mul_0": "elementwise",  # unattributed: by name
        "triton_tem_fused_2": "attention",
        "triton_tem_fused_addmm_3": "gemm",
    }
    seconds = ps.categories(units)
    assert seconds == pytest.approx({"attention": 910e-6, "gemm": 110e-6, "elementwise": 30e-6,
                                     "communication": 50e-6, "optimizer": 40e-6, "other": 5e-6})
    assert sum(ps.shares(seconds).values()) == pytest.approx(1.0)


def test_cuda_summary_mfu_from_useful_flops_over_the_peak():
    fake = SimpleNamespace(cuda=True, device=torch.device("cuda", 0), warmup=1, prof_warmup=1, active=1, first_step=10,
                           note=None, _step_times=[9.0, 9.0, 2.0], flops=lambda b: 0.0, peak_tflops=100.0)
    lines = [{"phase": "profiled", "tokens": 1000, "valid_tokens": 800, "useful_flops": 5e13}]
    s = StepProfiler.summarize(fake, _cuda_window(), lines)
    assert s["time_base"] == "cuda kernels" and s["profiled_steps"] == [13]
    assert s["mfu"] == pytest.approx(5e13 / (2.0 * 100e12)) and s["peak_flops"] == 100e12
    assert s["tokens_per_s"] == pytest.approx(500.0) and s["valid_tokens_per_s"] == pytest.approx(400.0)
    assert s["categories"]["attention"] == pytest.approx(910 / 1145)
    assert s["kernels"][0] == {"name": "triton_tem_fused_1", "category": "attention", "calls": 1, "ms": 0.6,
                               "share": pytest.approx(600 / 1145)}


def test_profile_step_benchmark_smoke(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_step.py"), "--smoke",
                          "--out", str(tmp_path / "ps")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| attention | gemm | elementwise | communication | optimizer | other | MFU |" in out.stdout
    result = json.loads((tmp_path / "ps" / "profile_step.json").read_text())
    assert result["summary"]["profiled_steps"] == [3, 4] and result["summary"]["time_base"] == "cpu ops"
    assert sum(result["summary"]["categories"].values()) == pytest.approx(1.0)
    assert not (tmp_path / "ps" / "checkpoints").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (profiles CUDA kernels)")
@pytest.mark.usefixtures("one_thread")
def test_profile_on_cuda_counts_kernel_time_and_mfu(tmp_path, monkeypatch):
    """In-memory episodes (no LeRobot dataset), so that it runs on a GPU machine without lerobot."""
    from flexpack.run.config import load_config
    from flexpack.run.memory_data import synthetic_run
    from flexpack.training.loop import train

    monkeypatch.setenv("LINGBOT_PROFILE", "2")
    monkeypatch.setenv("LINGBOT_PROFILE_WARMUP", "1")
    cfg = load_config(CONFIGS / "tiny_cpu.toml", [
        f'runtime.out_dir="{tmp_path / "run"}"', "log.progress=false", "data.max_tokens=60", "checkpoint.every=0",
        "log.tensorboard=false", "schedule.steps=4", "runtime.device='auto'", "optim.accum_steps=1",
        "profile.peak_tflops=100",  # an MFU on any GPU
        "model.overrides={in_channels=48, text_dim=64, action_channels=6, attn_backend='auto'}"])
    train(synthetic_run(cfg, text_len=4))
    prof = tmp_path / "run" / "profile"
    s = json.loads((prof / "summary_rank0.json").read_text())
    assert s["time_base"] == "cuda kernels" and s["profiled_steps"] == [3, 4]
    assert sum(s["categories"].values()) == pytest.approx(1.0)
    for cat in ("attention", "gemm", "elementwise", "optimizer"):
        assert s["categories"][cat] > 0, (cat, s["categories"], s["kernels"])
    assert 0 < s["mfu"] < 1 and s["peak_flops"] == 100e12
    assert s["kernels"] and not any(k["name"].startswith("aten::") for k in s["kernels"])  # kernels, not ops
    for x in map(json.loads, (prof / "steps_rank0.jsonl").read_text().splitlines()):
        assert x["fwd_s"] > 0 and x["bwd_s"] > 0 and x["peak_mem_bytes"] > 0
