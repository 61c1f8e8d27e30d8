"""The composition root (flexpack/run/root.py): one typed Run, one owner per quantity."""

import dataclasses
import json
import types
from pathlib import Path

import pytest
import torch

from flexpack.flow.noise import episode_seed, noise_seeds
from flexpack.packing.collate import PackCollate, PadCollate
from flexpack.packing.geometry import TokenGeometry
from flexpack.run.compose import run_for
from flexpack.run.config import load_config
from flexpack.run.memory_data import synthetic_run
from flexpack.run.resolve import model_config_of
from flexpack.run.root import ForwardOptions, Run, run_text_slots
from flexpack.training.observe.flops import batch_flops, useful_flops

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
CPU = torch.device("cpu")


def _cfg(tmp_path, *extra):
    return load_config(CONFIGS / "tiny_cpu.toml", [
        f'runtime.out_dir="{tmp_path / "run"}"', "log.progress=false", "log.tensorboard=false",
        "checkpoint.every=0", "data.max_tokens=60", *extra])


TEACHER_FORCING = ("objective.teacher_forcing=true", "model.mask='teacher_forcing'", "model.chunk_size=2")


def test_teacher_forcing_flops_agree_between_meter_profiler_and_benchmark(tmp_path, monkeypatch):
    """Under teacher forcing the model computes two copies of every frame: the step meter (metrics.jsonl's
    ``mfu``), the profiler and the benchmarks' count all take the copies from the run's geometry."""
    from flexpack.training.observe import metrics
    from flexpack.training.observe.profiling import StepProfiler

    monkeypatch.delenv("LINGBOT_PROFILE", raising=False)
    cfg = _cfg(tmp_path, *TEACHER_FORCING, "profile.peak_tflops=1")
    plan = synthetic_run(cfg, text_len=4)
    g = plan.geometry
    assert (g.video_tokens, g.action_tokens, g.copies) == (1, 4, 2)
    batches = [plan.collate([plan.dataset[i] for i in idx]) for idx, _ in zip(plan.sampler, range(3))]

    clock = [10.0]
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    meter = metrics.StepMeter(cfg.profile, CPU, seed=cfg.runtime.seed, model=plan.model_config, geometry=g,
                               objective=plan.objective)
    meter.add(batches, 0)
    clock[0] = 12.0  # the window took 2 s
    mfu = meter.read()["mfu"]

    prof = StepProfiler.for_training(cfg.runtime, cfg.profile, 0, steps_left=1, first_step=0, model=plan.model_config,
                                     geometry=plan.geometry, device=CPU, objective=plan.objective)
    profiled = sum(prof.flops(b.layout, 0) for b in batches)
    bench = sum(batch_flops(plan.model_config, g, b.layout) for b in batches)  # benchmarks/train_step.py's count
    two = sum(useful_flops(plan.model_config, b.layout, video_tokens=1, action_tokens=4, copies=2) for b in batches)
    one = sum(useful_flops(plan.model_config, b.layout, video_tokens=1, action_tokens=4, copies=1) for b in batches)
    assert profiled == bench == two > 1.5 * one
    assert mfu == pytest.approx(two / 2.0 / 1e12, rel=1e-12)
    assert prof.copies == 2 and prof.tpf == 5


def test_metrics_jsonl_mfu_counts_both_copies(tmp_path, monkeypatch):
    """The logged ``mfu`` times the window's seconds and the peak is the useful FLOPs of the step's
    micro-batches with two copies each."""
    from flexpack.training.loop import train

    monkeypatch.delenv("LINGBOT_PROFILE", raising=False)
    cfg = _cfg(tmp_path, *TEACHER_FORCING, "profile.peak_tflops=1", "schedule.steps=1", "schedule.warmup_steps=0")
    train(synthetic_run(cfg, text_len=4))
    rec = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    fresh = synthetic_run(cfg, text_len=4)  # the same epoch-0 order the run started from
    batches = [fresh.collate([fresh.dataset[i] for i in idx]) for idx, _ in zip(fresh.sampler, range(2))]
    want = sum(useful_flops(fresh.model_config, b.layout, video_tokens=1, action_tokens=4, copies=2) for b in batches)
    assert rec["mfu"] * rec["step_s"] * 1e12 == pytest.approx(want, rel=1e-6)


def test_run_of_a_lerobot_dataset(tiny_dataset, tmp_path):
    from flexpack.run.compose import build_run

    cfg = _cfg(tmp_path, f'data.root="{tiny_dataset}"')
    plan = build_run(cfg)
    assert isinstance(plan, Run) and plan.device == CPU and (plan.rank, plan.world_size) == (0, 1)
    assert plan.family.name == "wanva" and plan.autocast_dtype is None
    g = plan.geometry
    # 2x2 latents in 2x2 patches: one video token, plus data.action_steps action tokens
    assert (g.video_tokens, g.action_tokens, g.copies, g.tokens_per_frame, g.frame_budget) == (1, 4, 1, 5, 12)
    assert plan.sampler.budget_frames == plan.collate.collate.frame_budget == g.frame_budget
    assert plan.model_config == model_config_of(cfg)
    assert plan.forward == ForwardOptions(mask="document", chunk_size=None, text_slots=run_text_slots(plan.sampler))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.geometry = g  # type: ignore[misc]
    # the collate the run gives drops actions for a model without action channels
    video_only = run_for(plan.dataset, _cfg(tmp_path, f'data.root="{tiny_dataset}"',
                                             "model.overrides.action_channels=0"))
    assert video_only.geometry.action_tokens == 0 and video_only.geometry.frame_budget == 60
    batch = video_only.collate([video_only.dataset[0]])
    assert batch.action is None and plan.collate([plan.dataset[0]]).action is not None


def test_the_model_config_is_resolved_once_per_run(tmp_path, monkeypatch):
    """Loading a config checks it (the family resolves the preset once, so a bad key is blamed on its file or
    --set); composing the run resolves it once more (a pretrained config.json is read there); the model, the meter,
    the profiler and the loop then read Run.model_config and resolve nothing."""
    from flexpack.models.registry import ModelFamily
    from flexpack.training.loop import train

    monkeypatch.delenv("LINGBOT_PROFILE", raising=False)
    calls = []
    real = ModelFamily.config
    monkeypatch.setattr(ModelFamily, "config", lambda self, *a, **k: calls.append(a) or real(self, *a, **k))
    cfg = _cfg(tmp_path, "schedule.steps=1", "schedule.warmup_steps=0")
    assert len(calls) == 1  # load_config's check
    run = synthetic_run(cfg, text_len=4)
    assert len(calls) == 2  # compose
    train(run)
    assert len(calls) == 2 and run.model_config == model_config_of(cfg)


def test_token_geometry_owns_budget_and_too_long():
    g = TokenGeometry(video_tokens=32, action_tokens=4, copies=2, max_tokens=1000)
    assert (g.tokens_per_frame, g.frame_budget, g.computed_tokens(3)) == (36, 27, 216)
    assert g.too_long([27, 28, 5, 40]) == [1, 3] and g.fitted(40) == 27 and g.fitted(5) == 5
    with pytest.raises(ValueError, match="copies must be 1 or 2"):
        TokenGeometry(video_tokens=1, copies=3)
    with pytest.raises(ValueError, match="no max_tokens"):
        TokenGeometry(video_tokens=1).frame_budget  # noqa: B018
    with pytest.raises(ValueError, match="max_tokens=20 is less than one frame"):
        TokenGeometry(video_tokens=32, max_tokens=20).frame_budget  # noqa: B018


def _items(segments):
    return [{"latent": torch.randn(2, 3, 1, 1), "episode_index": 7, "segment": s} for s in segments]


@pytest.mark.parametrize("collate", [PackCollate(10), PadCollate(4)])
def test_segment_index_rides_on_the_layout_and_keys_the_noise(collate):
    lay = collate(_items([0, 2, -1])).layout
    assert lay.episode_index.tolist() == [7, 7, 7] and lay.episode_segment.tolist() == [0, 2, -1]
    seeds = noise_seeds(lay, 5, 11)
    assert seeds == [episode_seed(5, 11, 7, 1), episode_seed(5, 11, 7, 3), episode_seed(5, 11, 7, 0)]
    assert len(set(seeds)) == 3  # two segments of one episode draw different noise
    assert collate([{"latent": torch.randn(2, 3, 1, 1)}]).layout.episode_segment.tolist() == [-1]


def test_unmasked_pairs_counts_the_dense_mask():
    from flexpack.attention.blockmask_check import unmasked_pairs
    from flexpack.attention.masks import make_mask
    from flexpack.packing.layout import SequenceLayout

    lay = SequenceLayout.from_rows([[3, 2]], 7).tokens(video_tokens=2, action_tokens=1, copies=2)
    for kind, kw in (("document", {}), ("valid", {}), ("teacher_forcing", {"chunk_size": 1})):
        mod = make_mask(lay, kind, **kw)
        t = torch.arange(lay.num_tokens)
        z = torch.zeros((), dtype=torch.long)
        dense = int(mod(z, z, t[:, None], t[None, :]).sum())
        assert unmasked_pairs(mod) == dense, kind


def test_train_refuses_a_run_composed_from_another_config(tmp_path):
    """``train(cfg, run=...)`` (deprecated) claims ``cfg``'s run folder and steps with the run's config: a run
    composed from another config (here another out_dir) is refused in one line, and neither folder is touched."""
    from flexpack.training.loop import train

    cfg = _cfg(tmp_path, "schedule.steps=1")
    other = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, out_dir=str(tmp_path / "other")))
    with pytest.raises(ValueError, match="composed from another config"), pytest.warns(DeprecationWarning):
        train(other, run=synthetic_run(cfg, text_len=4))
    assert not (tmp_path / "run").exists() and not (tmp_path / "other").exists()


def test_train_refuses_a_run_composed_from_another_config_than_the_one_started(tmp_path):
    """``train(run, started=...)``: the folder claimed and locked at start-up is the started config's, so a run
    composed from another config is refused in one line, before any step or write into that folder."""
    from flexpack.run.start import start_up
    from flexpack.training.loop import START_CHECKS, train

    cfg = _cfg(tmp_path, "schedule.steps=1")
    other = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, out_dir=str(tmp_path / "other")))
    run = synthetic_run(cfg, text_len=4)
    with start_up(other, checks=START_CHECKS) as started:
        with pytest.raises(ValueError, match="composed from another config than the one started"):
            train(run, started=started)
    assert not (tmp_path / "run").exists() and not (tmp_path / "other" / "checkpoints").exists()
