"""The train loop on a synthetic LeRobot dataset: learning, exact accumulation, resume, checkpoints, profiling."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("lerobot")

from flexpack.cli import main as cli_main  # noqa: E402
from flexpack.commands.train import train  # noqa: E402
from flexpack.families.wan.config import wan_config
from flexpack.families.wan.model import WanVA  # noqa: E402
from flexpack.packing.collate import PackCollate, PadCollate  # noqa: E402
from flexpack.run.config import ScheduleConfig, load_config  # noqa: E402
from flexpack.run.state import checkpoint  # noqa: E402
from flexpack.training.loop import accumulate, lr_at  # noqa: E402
from helpers import tiny_config  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
VIDEO_FRAMES = [37, 29, 21, 17, 13, 9]  # latent frames 10, 8, 6, 5, 4, 3


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def dataset(tiny_dataset) -> Path:
    return tiny_dataset  # the session's dataset: VIDEO_FRAMES, seed 1 (tests that change it copy it)


config = tiny_config


def test_lr_schedule_warmup_cosine_constant_and_rewarmup():
    s = ScheduleConfig(steps=10, warmup_steps=4, decay="cosine", min_lr_ratio=0.1, rewarmup_steps=2, rewarmup_from=0.2)
    assert [lr_at(i, 1.0, s) for i in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lr_at(4, 1.0, s) == pytest.approx(1.0)  # cosine starts at the peak
    assert lr_at(7, 1.0, s) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(torch.pi / 2)).item()))
    assert lr_at(10, 1.0, s) == pytest.approx(0.1)
    const = replace(s, decay="constant")
    assert lr_at(9, 2.0, const) == 2.0
    # resumed at step 6: 0.2x, then 0.6x of the schedule, then the schedule itself
    assert lr_at(6, 1.0, s, resumed_at=6) == pytest.approx(0.2 * lr_at(6, 1.0, s))
    assert lr_at(7, 1.0, s, resumed_at=6) == pytest.approx(0.6 * lr_at(7, 1.0, s))
    assert lr_at(8, 1.0, s, resumed_at=6) == lr_at(8, 1.0, s)


def test_cli_train_loss_decreases_and_logs(dataset, tmp_path):
    out = tmp_path / "run"
    args = ["train", str(CONFIGS / "tiny_cpu.toml"), "--set", f'data.root="{dataset}"',
            "--set", f'runtime.out_dir="{out}"',
            "--set", "schedule.steps=30", "--set", "optim.accum_steps=1", "--set", "log.progress=false",
            "--set", "checkpoint.every=10"]
    assert cli_main(args) == 0
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"loss {first:.3f} -> {last:.3f}")
    assert len(recs) == 30 and [r["step"] for r in recs] == list(range(1, 31))
    assert last < 0.8 * first
    for r in recs:
        assert r["loss"] == pytest.approx(r["latent_loss"] + r["action_loss"], rel=1e-5)  # weights 1, 1
        assert 0.0 <= r["waste"] < 1.0 and r["tokens_per_s"] > 0 and r["grad_norm"] > 0
    assert recs[0]["lr"] == pytest.approx(3e-3 / 4)  # warmup step 1 of 4
    # checkpoints every 10 steps, the newest 2 kept; the resolved config is saved
    assert [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")] == ["step_00000020", "step_00000030"]
    assert load_config(out / "config.json").schedule.steps == 30
    assert not (out / "profile").exists()  # LINGBOT_PROFILE unset: no profiler


def _items(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [dict(latent=torch.randn(4, n, 4, 4, generator=g), action=torch.randn(7, n, 2, generator=g),
                 action_mask=torch.rand(7, n, 2, generator=g) > 0.3, text=torch.randn(3, 32, generator=g),
                 text_len=3 - i % 2, episode_index=10 + i) for i, n in enumerate(lengths)]


class _Listed(list):
    """Items in memory as a run reads them (``lengths()`` in latent frames)."""

    def lengths(self):
        return [it["latent"].shape[1] for it in self]


def _run(cfg, items):
    """The run of ``cfg`` over ``items`` (on the CPU): what ``accumulate`` takes its options from."""
    from flexpack.run.compose import run_for

    return run_for(_Listed(items), cfg, device=torch.device("cpu"))


def _tiny_model():
    torch.manual_seed(0)
    return WanVA(wan_config("tiny", attn_backend="dense"))


@pytest.mark.parametrize("collate", [PackCollate(16), PadCollate(4)], ids=["pack", "pad"])
def test_accumulating_four_micro_batches_of_one_equals_one_batch_of_four(collate):
    cfg = load_config(overrides=["objective.action_weight=0.5", "objective.weighting='bell'"])
    lengths = [3, 5, 2, 4]
    items = _items(lengths, seed=3)
    grads = []
    for batches in ([PackCollate(n)([it]) for n, it in zip(lengths, items)], [collate(items)]):
        model = _tiny_model()
        sums = accumulate(model, batches, _run(cfg, items), step=7)
        grads.append((sums, torch.cat([p.grad.flatten() for p in model.parameters()])))
    (s4, g4), (s1, g1) = grads
    err = float((g4 - g1).abs().max() / g1.abs().max())
    print(f"loss {s4[0]:.6f} vs {s1[0]:.6f}; grad rel err {err:.1e}")
    assert torch.allclose(s4, s1, rtol=1e-6)  # loss, latent part, action part
    assert float(s4[0]) == pytest.approx(float(s4[1] + 0.5 * s4[2]), rel=1e-6)
    assert err < 1e-5


def test_resume_mid_epoch_gives_the_same_batches_losses_and_rewarmed_lr(dataset, tmp_path):
    full = train(config(dataset, tmp_path / "a", "schedule.steps=6", "schedule.rewarmup_steps=0"))
    cfg = config(dataset, tmp_path / "b", "schedule.steps=6", "schedule.rewarmup_steps=0")
    first = train(cfg, stop_after=3)
    state = json.loads((tmp_path / "b" / "checkpoints" / "step_00000003" / "train_state.json").read_text())
    per_epoch = len({tuple(e) for e in full.episodes})  # distinct bins of epoch 0 (and 1)
    assert state["step"] == 3 and state["sampler"]["epoch"] == 0 and 0 < state["sampler"]["position"] < per_epoch
    second = train(cfg)
    assert (first.step, second.start_step, second.step) == (3, 3, 6)
    assert first.episodes + second.episodes == full.episodes
    state = json.loads((tmp_path / "b" / "checkpoints" / "step_00000006" / "train_state.json").read_text())
    assert state["sampler"]["epoch"] >= 1
    # model, optimizer and noise resume exactly: the same losses as the uninterrupted run
    assert first.losses + second.losses == pytest.approx(full.losses, rel=1e-5)
    # with re-warmup the LR restarts at 0.25x the schedule and reaches it after 2 steps
    cfg = config(dataset, tmp_path / "c", "schedule.steps=6", "schedule.rewarmup_steps=2",
                 "schedule.rewarmup_from=0.25")
    train(cfg, stop_after=3)
    third = train(cfg)
    sched = [lr_at(s, cfg.optim.lr, cfg.schedule) for s in (3, 4, 5)]
    assert third.lrs == pytest.approx([0.25 * sched[0], 0.625 * sched[1], sched[2]])
    assert third.episodes == second.episodes  # re-warmup changes the LR, never the data order
    # a finished run does nothing more; refusing to overwrite a run without resume
    assert train(cfg).step == 6
    with pytest.raises(ValueError, match="checkpoint.resume is false"):
        train(config(dataset, tmp_path / "c", "checkpoint.resume=false"))


def test_pad_mode_batches_and_waste(dataset, tmp_path):
    res = train(config(dataset, tmp_path / "pad", "data.mode='pad'", "data.batch_size=2", "data.pad_multiple=4",
                       "schedule.steps=3", "optim.accum_steps=2"))
    assert len(res.episodes) == 6 and all(len(e) <= 2 for e in res.episodes)
    assert all(0.0 <= m["waste"] < 1.0 for m in res.metrics) and res.step == 3


def test_checkpoint_roundtrip_is_atomic_and_pruned(tmp_path):
    model = _tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    items = _items([4, 5])
    sums = accumulate(model, [PackCollate(9)(items)], _run(load_config(), items), step=0)
    assert sums[0] > 0
    opt.step()
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, model, opt, sampler_state={"position": step}, keep=2)
    (tmp_path / ".tmp-step_00000009-123").mkdir()  # a crashed save: never picked up
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    assert checkpoint.latest(tmp_path).name == "step_00000003"
    fresh = WanVA(wan_config("tiny", attn_backend="dense"))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    state = checkpoint.load(checkpoint.latest(tmp_path), fresh, fresh_opt)
    assert state["step"] == 3 and state["sampler"] == {"position": 3}
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], fresh_opt.state_dict()["state"][0]["exp_avg"])
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        checkpoint.load(tmp_path / ".tmp-step_00000009-123", fresh)


def test_profiling_writes_trace_and_table_when_LINGBOT_PROFILE_2(dataset, tmp_path, monkeypatch):
    monkeypatch.setenv("LINGBOT_PROFILE", "2")
    monkeypatch.setenv("LINGBOT_PROFILE_WARMUP", "1")
    from flexpack.commands.train import profile_env
    from flexpack.commands.train import train as train_command  # the command layer reads the variables

    train_command(config(dataset, tmp_path / "prof", "schedule.steps=5"))
    trace, table = (tmp_path / "prof" / "profile" / "trace_rank0.json",
                    tmp_path / "prof" / "profile" / "top_ops_rank0.txt")
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e.get("name", "").startswith("ProfilerStep#") for e in events) == 2  # exactly the n active steps
    assert "aten::" in table.read_text() and table.read_text().startswith("2 profiled step(s)")
    monkeypatch.setenv("LINGBOT_PROFILE", "two")
    with pytest.raises(ValueError, match="LINGBOT_PROFILE must be a non-negative integer, got 'two'"):
        profile_env(config(dataset, tmp_path / "prof"))
    saved = json.loads((tmp_path / "prof" / "config.json").read_text())["profile"]
    assert (saved["env_steps"], saved["env_warmup"]) == (2, 1)  # the run folder says where the profile came from


def test_activation_checkpointing_from_outside_changes_nothing_but_memory(dataset, tmp_path):
    plain = train(config(dataset, tmp_path / "plain", "schedule.steps=3"))
    ac = train(config(dataset, tmp_path / "ac", "schedule.steps=3", "parallel.activation_checkpointing=true"))
    assert type(ac.model.blocks[0]).__name__ == "CheckpointWrapper"
    assert ac.losses == pytest.approx(plain.losses, rel=1e-5) and ac.episodes == plain.episodes
    saved = {k.removeprefix("model.") for k in checkpoint.tensor_shapes(ac.checkpoint) if k.startswith("model.")}
    assert not any("_checkpoint_wrapped_module" in k for k in saved)  # loads into an unwrapped model
    assert saved == set(plain.model.state_dict())
    bf16 = train(config(dataset, tmp_path / "bf16", "schedule.steps=3", "runtime.dtype='bfloat16'"))
    assert bf16.losses != plain.losses  # autocast engaged: bf16 matmuls
    assert all(abs(a - b) < 0.05 * b for a, b in zip(bf16.losses, plain.losses))
