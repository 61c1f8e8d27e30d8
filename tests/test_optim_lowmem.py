"""Low-memory optimizer options: torchao's 8-bit / 4-bit AdamW states (``optim.states``) and its host
offload (``optim.offload``): their bytes per parameter, their refusals, the groups they keep, checkpoints
that resume bit for bit (one process, FSDP2 under torchrun, 2 ranks -> 1) and the record a resume checks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexpack.errors import UserError
from flexpack.families.wan.config import wan_config
from flexpack.families.wan.model import WanVA
from flexpack.run.config import OptimConfig, load_config, save_config
from flexpack.run.state import checkpoint, resume
from flexpack.training import optim
from flexpack.training.optim import build_optimizer, optimizer_bytes_per_param, param_groups
from helpers import tiny_config

ao = pytest.importorskip("torchao.optim", reason="torchao (extra float8) is needed for low-bit states")
ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _cfg(root: Path, out: Path, *extra: str):
    """4 steps, no LR re-warmup after a resume (a resumed run then asks for what a straight one does)."""
    return tiny_config(root, out, "schedule.steps=4", "schedule.warmup_steps=2", "schedule.rewarmup_steps=0", *extra)


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return checkpoint.read_tensors(checkpoint.latest(run / "checkpoints"))


def test_bytes_per_param_of_each_choice():
    assert optimizer_bytes_per_param("float32", "none") == (16.0, 0.0)  # 4 param + 4 grad + 8 states
    assert optimizer_bytes_per_param("8bit", "none") == (8.0 + 2 * (1 + 4 / 256), 0.0)  # + a scale per 256 values
    assert optimizer_bytes_per_param("4bit", "none") == (8.0 + 2 * (0.5 + 4 / 128), 0.0)  # + a scale per 128
    assert optimizer_bytes_per_param("float32", "optimizer") == (8.0, 16.0)  # host: param copy, grad, states
    assert optimizer_bytes_per_param("8bit", "optimizer+gradients") == (4.0, 8.0 + 2 * (1 + 4 / 256))
    with pytest.raises(ValueError, match="optim.states must be one of"):
        optimizer_bytes_per_param("2bit", "none")
    with pytest.raises(ValueError, match="optim.offload must be one of"):
        optimizer_bytes_per_param("8bit", "disk")


@pytest.mark.parametrize("kw, needle", [
    ({"states": "fp16"}, "optim.states must be one of ('float32', '8bit', '4bit'), got 'fp16'"),
    ({"offload": "gpu"}, "optim.offload must be one of ('none', 'optimizer', 'optimizer+gradients'), got 'gpu'"),
    ({"offload": "optimizer+gradients", "accum_steps": 2, "grad_clip": 0.0},
     "cannot accumulate optim.accum_steps=2 micro-batches: set optim.accum_steps=1 or optim.offload='optimizer'"),
])
def test_config_refuses_in_one_line(kw, needle):
    with pytest.raises(ValueError) as err:
        OptimConfig(**kw)
    assert needle in str(err.value) and "\n" not in str(err.value)
    OptimConfig(offload="optimizer", grad_clip=0.0, accum_steps=4)  # states offloaded, gradients accumulate


def test_offload_needs_one_cuda_device_said_before_the_data(tmp_path):
    cfg = OptimConfig(offload="optimizer", grad_clip=0.0)
    with pytest.raises(UserError, match=r"optim.offload='optimizer' needs a CUDA device .* device is cpu: set "):
        optim.check(cfg, torch.device("cpu"), 1)
    with pytest.raises(UserError, match="single-GPU only .* this run has 2 ranks"):
        optim.check(cfg, torch.device("cuda"), 2)
    with pytest.raises(UserError, match=r"before clipping \(torchao's CPUOffloadOptimizer cannot clip\): set "
                                        r"optim.grad_clip=0 \(now 1.0\)"):
        optim.check(OptimConfig(offload="optimizer"), torch.device("cuda"), 1)
    optim.check(OptimConfig(states="8bit"), torch.device("cpu"), 2)  # low-bit states: any device, any ranks
    from flexpack.commands.train import train

    # the whole run: refused before any data is read (a dataset that does not exist) or anything is written
    run = tmp_path / "run"
    with pytest.raises(UserError, match="needs a CUDA device"):
        train(tiny_config(tmp_path / "no-data", run, 'optim.offload="optimizer+gradients"', "optim.grad_clip=0"))
    assert not (run / "checkpoints").exists()


@pytest.mark.parametrize("states, cls", [("8bit", "AdamW8bit"), ("4bit", "AdamW4bit")])
def test_low_bit_keeps_the_weight_decay_groups_and_says_which(states, cls, capsys):
    torch.manual_seed(0)
    model = WanVA(wan_config("tiny", attn_backend="dense"))
    opt = build_optimizer(model, OptimConfig(states=states, weight_decay=0.5, lr=0.1), log=True)
    assert type(opt) is getattr(ao, cls)
    out = capsys.readouterr().out
    assert out.startswith(f"optim: AdamW (torchao {cls}: {states[0]}-bit states), weight_decay=0.5 on ")
    groups = param_groups(model, 0.5)
    assert [[id(p) for p in g["params"]] for g in opt.param_groups] == [[id(p) for p in g["params"]] for g in groups]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0]
    optim.set_lr(opt, 0.25)  # held as a tensor by torchao: changed in place
    assert all(isinstance(g["lr"], torch.Tensor) and float(g["lr"]) == 0.25 for g in opt.param_groups)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_low_bit_states_resume_bit_exactly(train_dataset, tmp_path):
    """4 steps straight against 2 + a resume of 2, for 8-bit and 4-bit states: the same losses and weights."""
    from flexpack.commands.train import train

    for states in ("8bit", "4bit"):
        st = f'optim.states="{states}"'
        straight = train(_cfg(train_dataset, tmp_path / f"A{states}", st))
        first = train(_cfg(train_dataset, tmp_path / f"B{states}", st), stop_after=2)
        saved = checkpoint.tensor_shapes(first.checkpoint)
        assert any(k.startswith("optim.state.") and k.endswith(".exp_avg") for k in saved)
        assert json.loads((first.checkpoint / "train_state.json").read_text())["extra"]["optim"] == {
            "states": states, "offload": "none"}
        rest = train(_cfg(train_dataset, tmp_path / f"B{states}", st))
        assert rest.start_step == 2 and first.losses + rest.losses == straight.losses, states
        a, b = _weights(tmp_path / f"A{states}"), _weights(tmp_path / f"B{states}")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), states
        # the states really are low-bit: torchao's subclass after the resume
        kinds = {type(s["exp_avg"]).__name__ for s in _loaded_states(tmp_path / f"B{states}", rest.model, states)}
        assert f"OptimState{states[0]}bit" in kinds, kinds


def _loaded_states(run: Path, model: torch.nn.Module, states: str) -> list[dict]:
    """The optimizer states of ``run``'s newest checkpoint as loaded into a fresh optimizer over ``model``."""
    opt = build_optimizer(model, OptimConfig(states=states))
    checkpoint.load(checkpoint.latest(run / "checkpoints"), model, opt, restore_rng=False)
    return list(opt.state.values())


@pytest.mark.usefixtures("one_thread")
def test_resume_with_other_states_or_offload_is_refused_before_loading(train_dataset, tmp_path):
    from flexpack.commands.train import train

    run = tmp_path / "run"
    train(_cfg(train_dataset, run, "schedule.steps=1"))
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    with pytest.raises(ValueError) as err:
        train(_cfg(train_dataset, run, 'optim.states="8bit"'))
    msg = str(err.value)
    assert "\n" not in msg and "optim.states is 'float32' there and '8bit' now" in msg
    assert '--set optim.states="float32"' in msg and "new runtime.out_dir" in msg
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before  # nothing written


def test_a_checkpoint_without_the_record_is_float32_without_offload(tmp_path):
    (tmp_path / "train_state.json").write_text(json.dumps({"step": 3, "extra": {}}))
    cfg = load_config(overrides=['optim.states="4bit"'])
    with pytest.raises(ValueError, match="optim.states is 'float32' there and '4bit' now"):
        resume.check_optim(tmp_path, cfg)
    resume.check_optim(tmp_path, load_config())  # the defaults: accepted
    cfg = load_config(overrides=['optim.offload="optimizer"', "optim.grad_clip=0"])
    with pytest.raises(ValueError, match="optim.offload is 'none' there and 'optimizer' now"):
        resume.check_optim(tmp_path, cfg)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_fsdp2_low_bit_states_train_checkpoint_and_reshard_2_to_1(train_dataset, tmp_path):
    """2 gloo ranks with 8-bit states on FSDP2 shards: 4 steps straight, 2 + a resume of 2 on 2 ranks (the
    same losses), and the step-2 checkpoint resumed on 1 rank (DCP re-shards torchao's 8-bit states)."""
    from flexpack.commands.train import train

    if not TORCHRUN.exists() and shutil.which("torchrun") is None:
        pytest.skip("torchrun not found next to the interpreter or on PATH")
    st = 'optim.states="8bit"'
    for name in "AB":
        save_config(_cfg(train_dataset, tmp_path / name, st), tmp_path / f"{name}.json")
    jobs = [{"name": "A", "config": str(tmp_path / "A.json")},
            {"name": "B1", "config": str(tmp_path / "B.json"), "stop_after": 2},
            {"copy": [str(tmp_path / "B"), str(tmp_path / "C")]},
            {"name": "B2", "config": str(tmp_path / "B.json")}]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    cmd = [str(TORCHRUN if TORCHRUN.exists() else shutil.which("torchrun")), "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "resume_worker.py"), str(tmp_path / "jobs.json"), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    got = {f.name.removesuffix(".json"): json.loads(f.read_text()) for f in tmp_path.glob("*.rank*.json")}
    for r in "01":
        assert got[f"B1.rank{r}"]["losses"] + got[f"B2.rank{r}"]["losses"] == got[f"A.rank{r}"]["losses"]
    a, b = _weights(tmp_path / "A"), _weights(tmp_path / "B")
    assert all(torch.equal(a[k], b[k]) for k in a)
    ckpt = checkpoint.latest(tmp_path / "C" / "checkpoints")
    assert json.loads((ckpt / "train_state.json").read_text())["world_size"] == 2
    one = train(_cfg(train_dataset, tmp_path / "C", st))  # 2 ranks -> 1
    assert one.start_step == 2 and one.step == 4 and all(map(torch.isfinite, map(torch.tensor, one.losses)))
    kinds = {type(s["exp_avg"]).__name__ for s in _loaded_states(tmp_path / "C", one.model, "8bit")}
    assert "OptimState8bit" in kinds


@pytest.mark.skipif(not torch.cuda.is_available(), reason="optim.offload needs CUDA")
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("states, offload", [("float32", "optimizer"), ("8bit", "optimizer+gradients")])
def test_offloaded_optimizer_resumes_bit_exactly_on_cuda(train_dataset, tmp_path, states, offload):
    from flexpack.commands.train import train

    sets = (f'optim.states="{states}"', f'optim.offload="{offload}"', "optim.grad_clip=0", 'runtime.device="cuda"')
    straight = train(_cfg(train_dataset, tmp_path / "A", *sets))
    first = train(_cfg(train_dataset, tmp_path / "B", *sets), stop_after=2)
    saved = checkpoint.tensor_shapes(first.checkpoint)
    assert any(k.startswith("optim.state.") and k.endswith(".exp_avg") for k in saved)
    rest = train(_cfg(train_dataset, tmp_path / "B", *sets))
    assert rest.start_step == 2 and first.losses + rest.losses == straight.losses
    a, b = _weights(tmp_path / "A"), _weights(tmp_path / "B")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_fsdp2_host_offload_trains_as_without_and_resumes(train_dataset, tmp_path):
    """2 gloo ranks with ``optim.offload = "optimizer+gradients"``: FSDP2's CPUOffloadPolicy holds the shards
    (clipping on), the losses equal a run without offload, and 2 steps + a resume of 2 equal 4 straight."""
    if not TORCHRUN.exists() and shutil.which("torchrun") is None:
        pytest.skip("torchrun not found next to the interpreter or on PATH")
    off = 'optim.offload="optimizer+gradients"'
    for name, extra in (("A", (off,)), ("N", ()), ("B", (off,))):
        save_config(_cfg(train_dataset, tmp_path / name, "optim.grad_clip=1.0", *extra), tmp_path / f"{name}.json")
    jobs = [{"name": "A", "config": str(tmp_path / "A.json")}, {"name": "N", "config": str(tmp_path / "N.json")},
            {"name": "B1", "config": str(tmp_path / "B.json"), "stop_after": 2},
            {"name": "B2", "config": str(tmp_path / "B.json")}]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    cmd = [str(TORCHRUN if TORCHRUN.exists() else shutil.which("torchrun")), "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "resume_worker.py"), str(tmp_path / "jobs.json"), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    got = {f.name.removesuffix(".json"): json.loads(f.read_text()) for f in tmp_path.glob("*.rank*.json")}
    for r in "01":
        a, n = got[f"A.rank{r}"], got[f"N.rank{r}"]
        assert a["host_offload"] is True and n["host_offload"] is False
        assert torch.allclose(torch.tensor(a["losses"]), torch.tensor(n["losses"]), rtol=1e-5, atol=0)
        assert got[f"B1.rank{r}"]["losses"] + got[f"B2.rank{r}"]["losses"] == a["losses"]
    assert "optimizer+gradients" in json.loads((tmp_path / "A" / "config.json").read_text())["optim"]["offload"]


def test_fsdp2_refuses_optimizer_only_offload_in_one_line():
    """Under several ranks the host keeps shards, gradients and the step together: 'optimizer' alone is refused."""
    with pytest.raises(UserError, match="set optim.offload='optimizer\\+gradients'") as err:
        optim.check(OptimConfig(offload="optimizer", grad_clip=0.0), torch.device("cpu"), 2)
    assert "\n" not in str(err.value)
    optim.check(OptimConfig(offload="optimizer+gradients", grad_clip=1.0), torch.device("cpu"), 2)  # FSDP2's own
