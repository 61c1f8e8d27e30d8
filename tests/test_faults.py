"""Faults during training on the tiny model: signals, kill -9, a second train on the same folder,
non-finite steps, data errors, damaged checkpoints; exit codes, messages and the run folder after."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lerobot")

from flexpack.cli import main as cli_main  # noqa: E402
from flexpack.commands.train import train  # noqa: E402
from flexpack.run.config import load_config  # noqa: E402
from flexpack.run.state import checkpoint  # noqa: E402
from flexpack.run.state.faults import NonFiniteError  # noqa: E402
from flexpack.run.state.runfolder import LOCK, RunLock, cut_metrics  # noqa: E402
from flexpack.training import step as step_module  # noqa: E402
from helpers import logged_steps, tiny_sets, wait_for_steps  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_cpu.toml"
pytestmark = pytest.mark.usefixtures("one_thread")


def _sets(root: Path, out: Path, *extra: str) -> list[str]:
    return tiny_sets(root, out, "schedule.warmup_steps=2", *extra)


def config(root: Path, out: Path, *extra: str):
    return load_config(CONFIG, _sets(root, out, *extra))


def _train_cmd(root: Path, out: Path, *extra: str, ranks: int = 1) -> tuple[list[str], dict[str, str]]:
    """``flexpack train`` (under torchrun for ``ranks`` > 1) on the tiny config, and its environment."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)] if ranks > 1 else []
    cmd = [sys.executable, *launcher, "-m", "flexpack.cli", "train", str(CONFIG)]
    for s in _sets(root, out, *extra):
        cmd += ["--set", s]
    return cmd, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _spawn(root: Path, out: Path, *extra: str) -> subprocess.Popen:
    cmd, env = _train_cmd(root, out, *extra)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


@pytest.mark.slow  # 13-17 s on 2 cores
def test_sigterm_saves_the_step_exits_143_and_a_second_train_is_refused_meanwhile(train_dataset, tmp_path):
    out = tmp_path / "run"
    proc = _spawn(train_dataset, out, "schedule.steps=500")
    try:
        wait_for_steps(proc, out, 2)
        lock = json.loads((out / LOCK).read_text())
        assert lock["pid"] == proc.pid
        # a second train on the same folder: refused before any data or model work, naming the holder
        with pytest.raises(ValueError, match=rf"in use by train PID {proc.pid} on host {lock['host']}"):
            train(config(train_dataset, out, "schedule.steps=500"))
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    saved = checkpoint.latest(out / "checkpoints")
    done = logged_steps(out)
    assert saved is not None and json.loads((saved / "train_state.json").read_text())["step"] == done[-1]
    assert f"interrupted by SIGTERM after step {done[-1]}; checkpoint {saved}; run the same command again" in err
    assert not (out / LOCK).exists()  # released on the way out
    # resuming continues right after the saved step: every step logged once
    res = train(config(train_dataset, out, f"schedule.steps={done[-1] + 2}"))
    assert res.start_step == done[-1] and logged_steps(out) == list(range(1, done[-1] + 3))


def test_kill_9_before_any_checkpoint_then_resume_drops_its_metrics_and_takes_over_the_lock(train_dataset, tmp_path,
                                                                                            capfd):
    out = tmp_path / "run"
    proc = _spawn(train_dataset, out, "schedule.steps=500")  # checkpoint.every=0: none until the end
    try:
        wait_for_steps(proc, out, 4)
        proc.kill()
        proc.wait(timeout=30)
    finally:
        proc.kill()
    logged = logged_steps(out)
    assert checkpoint.latest(out / "checkpoints") is None and len(logged) >= 4
    assert json.loads((out / LOCK).read_text())["pid"] == proc.pid  # the dead process's lock is left behind
    (out / "checkpoints" / ".tmp-step_00000300" / "state").mkdir(parents=True)  # a save cut short
    res = train(config(train_dataset, out, "schedule.steps=2"))
    err = capfd.readouterr().err
    assert f"taking over the lock of PID {proc.pid}" in err
    assert ".tmp-step_00000300 (an interrupted save)" in err
    assert f"removed {len(logged)} line(s) after step 0" in err  # lines of weights that no longer exist
    assert res.start_step == 0 and logged_steps(out) == [1, 2]
    assert not list((out / "checkpoints").glob(".tmp-*")) and not (out / LOCK).exists()


def test_lock_refuses_a_live_holder_and_other_hosts_and_takes_over_a_dead_one(tmp_path, capfd):
    (tmp_path / LOCK).write_text(json.dumps({"pid": os.getppid(), "host": os.uname().nodename, "since": "t"}))
    with pytest.raises(ValueError, match=rf"in use by train PID {os.getppid()} on host"):
        RunLock(tmp_path).acquire()
    (tmp_path / LOCK).write_text(json.dumps({"pid": 999999999, "host": "elsewhere", "since": "t"}))
    with pytest.raises(ValueError, match="PID 999999999 on host elsewhere"):  # cannot tell if it lives there
        RunLock(tmp_path).acquire()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK).write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename, "since": "t"}))
    with RunLock(tmp_path):
        assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    assert "taking over the lock of PID" in capfd.readouterr().err and not (tmp_path / LOCK).exists()


def test_a_stale_lock_is_named_with_its_pid_and_the_kills_likely_cause(tmp_path, capfd, monkeypatch):
    """A lock left behind means its train had no orderly exit (each releases it): the warning names the PID, when
    it started, its last logged step and the likely cause; an out-of-memory kill where the kernel log shows one
    (after the lock was taken: an earlier process of the same PID is not blamed)."""
    import subprocess as sp

    from flexpack.run.state import runfolder

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = os.uname().nodename
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3))
                                            + '{"step": 4, "lo')  # the last line cut short by the kill
    since = "2026-12-05T10:00:00+00:00"
    monkeypatch.setattr(runfolder, "_oom_kill_line", lambda pid, since=None: None)  # a kernel log naming no kill
    (tmp_path / LOCK).write_text(json.dumps({"pid": dead.pid, "host": host, "since": since}))
    with RunLock(tmp_path):
        pass
    (line,) = [x for x in capfd.readouterr().err.splitlines() if "taking over" in x]
    assert line == (f"warning: {tmp_path / LOCK}: taking over the lock of PID {dead.pid} on {host}, which is no "
                    f"longer running (a killed train, started {since}): it ended without an exit line or releasing its "
                    "lock: killed by a signal, possibly the kernel's out-of-memory killer (see `dmesg`; the kernel log "
                    "is not readable here or names no kill of it) or a scheduler's hard limit, or a crash in native "
                    f"code; its last logged step was 3 ({tmp_path / 'metrics.jsonl'})")
    monkeypatch.undo()
    # the kernel log (dmesg, stamped in seconds since boot) with an out-of-memory kill of this PID after the start
    boot = next(int(x.split()[1]) for x in open("/proc/stat").read().splitlines() if x.startswith("btime "))
    import datetime

    start = datetime.datetime.fromtimestamp(boot + 1000, datetime.timezone.utc).isoformat(timespec="seconds")
    kill = f"[ 1500.250000] Out of memory: Killed process {dead.pid} (python) total-vm:9000kB, anon-rss:8000kB"
    log = f"[  900.000000] Out of memory: Killed process {dead.pid} (old) total-vm:1kB\n{kill}\n[ 1600.0] other\n"
    monkeypatch.setattr(sp, "run", lambda *a, **k: sp.CompletedProcess(a, 0, stdout=log, stderr=""))
    assert runfolder._oom_kill_line(dead.pid, start) == kill.strip()
    assert "the kernel's out-of-memory killer ended it (kernel log: " in runfolder.stale_cause(dead.pid, start)
    late = datetime.datetime.fromtimestamp(boot + 2000, datetime.timezone.utc).isoformat(timespec="seconds")
    assert runfolder._oom_kill_line(dead.pid, late) is None  # both kills happened before that start: another PID's
    assert runfolder._oom_kill_line(dead.pid + 1, start) is None


def test_cut_metrics_keeps_the_checkpoints_steps_and_drops_a_torn_line(tmp_path):
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3, 4, 2, 3)] + ['{"step": 5, "lo']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert cut_metrics(tmp_path, 2) == 4
    assert logged_steps(tmp_path) == [1, 2, 2]  # an older duplicate is not invented away, only later steps go
    assert cut_metrics(tmp_path, 2) == 0


def _poison_grads_at(monkeypatch, bad_step: int, seen: dict) -> None:
    real = step_module.accumulate

    def accumulate(model, batches, run, *, step, **kw):
        seen[step] = [p.detach().clone() for p in model.parameters()]
        out = real(model, batches, run, step=step, **kw)
        if step == bad_step:
            next(model.parameters()).grad[0] = float("nan")
        return out

    monkeypatch.setattr(step_module, "accumulate", accumulate)


def test_nonfinite_gradient_stops_naming_step_and_episodes_without_a_checkpoint(train_dataset, tmp_path, monkeypatch):
    _poison_grads_at(monkeypatch, 2, {})
    out = tmp_path / "run"
    with pytest.raises(NonFiniteError) as info:
        train(config(train_dataset, out, "schedule.steps=6", "checkpoint.every=0"))
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("step 3: non-finite loss") and "gradient norm nan" in msg
    assert "on micro-batches with episodes [[" in msg and "optim.skip_nonfinite=true" in msg
    assert not (out / "checkpoints").exists()  # nothing saved
    assert logged_steps(out) == [1, 2]


def test_skip_nonfinite_skips_the_update_logs_it_and_trains_on(train_dataset, tmp_path, monkeypatch):
    seen: dict = {}
    _poison_grads_at(monkeypatch, 2, seen)
    res = train(config(train_dataset, tmp_path / "run", "schedule.steps=5", "optim.skip_nonfinite=true"))
    assert res.step == 5 and [m.get("skipped", False) for m in res.metrics] == [False, False, True, False, False]
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[2])["skipped"] is True
    assert all(torch.equal(a, b) for a, b in zip(seen[2], seen[3]))  # step 3 changed no weight
    assert not all(torch.equal(a, b) for a, b in zip(seen[3], seen[4]))  # step 4 did
    assert all(torch.isfinite(p).all() for p in res.model.parameters())
    state = torch.optim.AdamW(res.model.parameters(), lr=1.0)
    checkpoint.load(res.checkpoint, res.model, state)
    assert {int(s["step"]) for s in state.state.values()} == {4}  # four updates in five steps


def test_data_error_mid_run_saves_the_steps_done_before_raising(train_dataset, tmp_path, capfd):
    from flexpack.data import LatentEpisodeDataset

    clean = train(config(train_dataset, tmp_path / "clean", "schedule.steps=4"))
    first_at = {}
    for k, eps in enumerate(clean.episodes):
        for e in eps:
            first_at.setdefault(e, k)
    # met late (at micro-batch = step k), and not item 0, which building the data reads to check shapes
    episode, k = max(((e, i) for e, i in first_at.items() if e != 0), key=lambda kv: kv[1])
    assert k >= 2
    root = tmp_path / "ds"
    shutil.copytree(train_dataset, root)
    ds = LatentEpisodeDataset(root)
    latent = ds.latent_file(next(i for i, (e, _) in enumerate(ds.items) if e == episode))
    latent.write_bytes(latent.read_bytes()[:100])  # a truncated cache file
    out = tmp_path / "run"
    with pytest.raises(Exception, match=f"episode {episode}"):
        train(config(root, out, "schedule.steps=4"))
    saved = checkpoint.latest(out / "checkpoints")
    assert saved is not None and saved.name == f"step_{k:08d}" and logged_steps(out) == list(range(1, k + 1))
    assert f"saved step {k} in {saved} before the error below" in capfd.readouterr().err


def test_damaged_newest_checkpoint_is_reported_and_the_one_before_used(train_dataset, tmp_path, capfd):
    out = tmp_path / "run"
    train(config(train_dataset, out, "schedule.steps=4", "checkpoint.every=2"))
    shard = out / "checkpoints" / "step_00000004" / "state" / "__0_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    res = train(config(train_dataset, out, "schedule.steps=5", "checkpoint.every=2"))
    err = capfd.readouterr().err
    assert f"step_00000004: state/__0_0.distcp has {size // 2} bytes, the manifest says {size} (truncated?); " \
           "using the checkpoint before it" in err
    assert res.start_step == 2 and logged_steps(out) == [1, 2, 3, 4, 5]
    assert checkpoint.problem(out / "checkpoints" / "step_00000005") is None
    # nothing usable left: refused (never a silent restart from scratch over the run's checkpoints)
    for p in (out / "checkpoints").glob("step_*/manifest.json"):
        p.unlink()
    damaged = (r"checkpoints: no usable checkpoint, all 2 are damaged \(newest: "
               r".*step_00000005: not a complete checkpoint")
    with pytest.raises(ValueError, match=damaged):
        train(config(train_dataset, out, "schedule.steps=6"))
    assert logged_steps(out) == [1, 2, 3, 4, 5]


def test_finished_run_says_so_exits_0_and_touches_nothing(train_dataset, tmp_path, capfd, monkeypatch):
    from flexpack.run import compose

    out = tmp_path / "run"
    train(config(train_dataset, out, "schedule.steps=3"))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    monkeypatch.setattr(compose, "compose", lambda *a, **k: pytest.fail("composed (data opened) with nothing to train"))
    args = ["train", str(CONFIG)] + [a for s in _sets(train_dataset, out, "schedule.steps=2") for a in ("--set", s)]
    assert cli_main(args) == 0
    captured = capfd.readouterr()
    assert "already at step 3 of schedule.steps=2; nothing to train" in captured.err
    assert "loss nan" not in captured.out and "trained steps" not in captured.out
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_config_json_stays_the_first_and_each_start_is_appended_to_the_history(train_dataset, tmp_path, capfd):
    out = tmp_path / "run"
    train(config(train_dataset, out, "schedule.steps=2"))
    train(config(train_dataset, out, "schedule.steps=3", "optim.lr=1e-3"))
    assert load_config(out / "config.json").schedule.steps == 2  # never rewritten
    history = [json.loads(line) for line in (out / "config_history.jsonl").read_text().splitlines()]
    assert [h["start_step"] for h in history] == [0, 2] and history[0]["changed"] == {}
    assert history[1]["changed"] == {"optim.lr": [3e-3, 1e-3], "schedule.steps": [2, 3]}
    assert history[1]["config"]["schedule"]["steps"] == 3 and history[1]["world_size"] == 1
    assert ("resuming at step 2 with changed config: optim.lr 0.003 -> 0.001, schedule.steps 2 -> 3"
            in capfd.readouterr().err)


def test_resume_with_another_epoch_order_or_model_shape_is_one_line_naming_the_values(train_dataset, tmp_path):
    out = tmp_path / "run"
    train(config(train_dataset, out, "schedule.steps=2"))
    with pytest.raises(ValueError) as info:
        train(config(train_dataset, out, "schedule.steps=4", "data.max_tokens=80", "data.seed=3"))
    assert str(info.value) == (
        f"cannot resume from {out / 'checkpoints' / 'step_00000002'}: data.max_tokens is 60 there and 80 now, "
        "data.seed is 0 there and 3 now (the epoch's order depends on it); resume with --set data.max_tokens=60 "
        "--set data.seed=0, or train into a new runtime.out_dir")
    with pytest.raises(ValueError) as info:
        train(config(train_dataset, out, "schedule.steps=4", "model.overrides.ffn_dim=96"))
    assert str(info.value) == (  # refused before the model is built: the key, both values, what sets it now
        f"cannot resume from {out / 'checkpoints' / 'step_00000002'}: its model has another shape or family "
        "(model.ffn_dim is 512 there and 96 now (model.overrides.ffn_dim)); its weights are of its own model: resume "
        "with the checkpoint's model values, or train into another runtime.out_dir")
    assert logged_steps(out) == [1, 2] and not (out / LOCK).exists()


def test_graceful_stop_records_the_first_signal_and_a_second_ctrl_c_interrupts_at_once():
    from flexpack.run.state.faults import GracefulStop, Interrupted

    previous = signal.getsignal(signal.SIGTERM)
    with GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM  # recorded, the process lives on
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is previous  # handlers restored
    exc = Interrupted(signal.SIGINT, 7, Path("RUN/checkpoints/step_00000007"))
    assert exc.exit_code == 130 and str(exc) == ("interrupted by SIGINT after step 7; checkpoint "
                                                 "RUN/checkpoints/step_00000007; run the same command again to resume")


def test_checkpoint_carries_the_action_statistics_and_loads_into_a_plain_model_for_verify(train_dataset, tmp_path,
                                                                                          capfd):
    from flexpack.data import LatentEpisodeDataset
    from flexpack.run.compose import compose
    from flexpack.run.state import resume
    from flexpack.tools.verify import verify_config

    out = tmp_path / "run"
    res = train(config(train_dataset, out, "schedule.steps=2"))
    state = json.loads((res.checkpoint / "train_state.json").read_text())
    ds = LatentEpisodeDataset(train_dataset, action_dim=6)
    saved = state["extra"]["action_normalizer"]
    assert saved == resume.normalizer_state(ds).to_json() and saved["mode"] in ("quantile", "meanstd")
    # a dataset whose statistics changed since: the checkpoint's are kept, with a warning
    changed = {**saved, "low": [v - 1.0 for v in saved["low"]]}
    resume._restore_normalizer(res.checkpoint, ds, changed, rank=0)
    assert resume.normalizer_state(ds).to_json() == changed
    assert "keeping the checkpoint's" in capfd.readouterr().err
    # verify loads the sharded checkpoint into a single-process model (no process group)
    report = verify_config(compose(config(train_dataset, out), "verify"), checkpoint_dir=str(out), micro_batches=1)
    assert report.ok
    from flexpack.run.model import build_model

    model = build_model(config(train_dataset, out))
    checkpoint.load(res.checkpoint, model, restore_rng=False)
    for (name, a), b in zip(res.model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_sigterm_under_torchrun_stops_both_ranks_at_one_step_and_saves_it(train_dataset, tmp_path):
    out = tmp_path / "run"
    cmd, env = _train_cmd(train_dataset, out, "schedule.steps=500", ranks=2)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        wait_for_steps(proc, out, 3, timeout=240)
        proc.send_signal(signal.SIGTERM)  # torchrun passes it on to both ranks
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    done = logged_steps(out)
    saved = checkpoint.latest(out / "checkpoints")
    state = json.loads((saved / "train_state.json").read_text())
    assert state["step"] == done[-1] and state["world_size"] == 2  # the ranks agreed on the step
    crcs = json.loads((saved / "manifest.json").read_text())["crc32"]  # each rank checksummed its own shard
    assert {"state/__0_0.distcp", "state/__1_0.distcp"} <= set(crcs) and checkpoint.problem(saved) is None
    assert f"interrupted by SIGTERM after step {done[-1]}; checkpoint {saved}" in err
    assert err.count("SIGTERM: finishing this step") == 1 and not (out / LOCK).exists()
    res = train(config(train_dataset, out, f"schedule.steps={done[-1] + 1}"))  # and one rank goes on
    assert res.start_step == done[-1] and logged_steps(out) == list(range(1, done[-1] + 2))


@pytest.mark.slow
def test_data_error_on_one_torchrun_rank_saves_the_steps_done_on_both(train_dataset, tmp_path):
    from flexpack.data import LatentEpisodeDataset
    from flexpack.packing.batch_sampler import TokenBudgetBatchSampler

    ds = LatentEpisodeDataset(train_dataset)
    plan = TokenBudgetBatchSampler(ds.lengths(), 60, tokens_per_frame=5, world_size=2)._plan(0)
    first_step = {}
    for rank in plan:
        for k, batch in enumerate(rank):
            for e in batch:
                first_step[e] = min(first_step.get(e, k), k)
    episode = next(e for e, k in sorted(first_step.items()) if k == 1 and e != 0)  # met at step 2 by one rank
    root = tmp_path / "ds"
    shutil.copytree(train_dataset, root)
    latent = LatentEpisodeDataset(root).latent_file(episode)
    latent.write_bytes(latent.read_bytes()[:100])
    out = tmp_path / "run"
    cmd, env = _train_cmd(root, out, "schedule.steps=5", ranks=2)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode != 0
    saved = checkpoint.latest(out / "checkpoints")
    assert saved is not None and saved.name == "step_00000001", proc.stderr[-3000:]
    assert json.loads((saved / "train_state.json").read_text())["world_size"] == 2
    assert f"saved step 1 in {saved} before the error below" in proc.stderr
    assert f"episode {episode}" in proc.stderr and "stopped for a data error on another rank" in proc.stderr
    assert logged_steps(out) == [1] and not (out / LOCK).exists()


def test_nonfinite_found_at_a_later_logged_step_names_its_step_and_saves_nothing(train_dataset, tmp_path, monkeypatch):
    """Without skip_nonfinite (one process) the check reads the device only at logged steps and saves:
    a NaN at step 3 is reported at the step-4 log with step 3 named, and no checkpoint is written."""
    _poison_grads_at(monkeypatch, 2, {})
    out = tmp_path / "run"
    with pytest.raises(NonFiniteError) as info:
        train(config(train_dataset, out, "schedule.steps=8", "checkpoint.every=0", "log.every=4"))
    msg = str(info.value)
    assert msg.startswith("step 3: non-finite loss") and "found at the check after step 4" in msg
    assert not (out / "checkpoints").exists() and logged_steps(out) == []


def test_metrics_carry_step_time_and_peak_memory_and_no_mfu_without_a_gpu(train_dataset, tmp_path):
    res = train(config(train_dataset, tmp_path / "run", "schedule.steps=3", "log.every=1"))
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3] and res.step == 3
    for x in lines:
        assert x["step_s"] > 0 and x["peak_mem_gb"] > 0.01 and "mfu" not in x
        assert x["tokens_per_s"] > 0  # valid tokens of the window over its wall time
