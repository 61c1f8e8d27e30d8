"""What a person reads while a run trains: plain lines in a log file (no progress bar there), the bar plus a
line every 10 steps on a terminal, and the CPU thread count chosen and said."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexpack.run.cpu_threads import (
    CACHE_ENV,
    SMALL_MODEL,
    choose,
    cpu_threads,
    inductor_cache_for,
    set_cpu_threads,
)
from flexpack.training.observe.console import Console, format_line, line_every

ROOT = Path(__file__).resolve().parents[1]
REC = {"step": 30, "loss": 0.41234, "grad_norm": 1.2149, "lr": 2.95e-3, "tokens_per_s": 1234.0, "peak_mem_gb": 12.34,
       "mfu": 0.414}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_line_every():
    assert [line_every(n, False) for n in (1, 3, 10, 25)] == [1, 3, 10, 25]  # no bar: every logged step
    assert [line_every(n, True) for n in (1, 3, 10, 25)] == [10, 12, 10, 25]  # a bar: a multiple of log_every >= 10


def test_format_line_holds_every_number():
    line = format_line(REC, total=300, val=(20, 0.441), eta_s=185)
    assert line == ("step 30/300  loss 0.4123  val 0.4410 (step 20)  grad 1.21  lr 2.95e-03  tok/s 1.23k  mfu 0.41  "
                    "mem 12.3 GB  eta 3m05s")
    named = format_line({**REC, "latent_loss": 0.3, "action_loss": 0.11234, "smooth": 2.0}, total=300,
                        loss_parts=("latent_loss", "action_loss", "smooth"))
    assert named.startswith("step 30/300  loss 0.4123 (latent 0.3000, action 0.1123, smooth 2.0000)  grad 1.21"), named
    bare = format_line({k: v for k, v in REC.items() if k != "mfu"}, total=300, val=(30, 0.5))
    assert bare == "step 30/300  loss 0.4123  val 0.5000  grad 1.21  lr 2.95e-03  tok/s 1.23k  mem 12.3 GB"


def _feed(console: Console, steps: int, log_every: int, val_at: tuple[int, ...] = ()) -> None:
    for step in range(1, steps + 1):
        console.update()
        if step % log_every == 0 or step == steps:
            console.row({**REC, "step": step})
        if step in val_at:
            console.row({"step": step, "val_loss": 0.5, "val_latent_loss": 0.4})
        console.end_step(step)
    console.close()


def test_a_log_file_gets_a_line_every_log_every_steps_and_no_bar():
    out, err = io.StringIO(), io.StringIO()  # neither is a terminal
    _feed(Console(total=40, start=0, end=25, log_every=5, progress=True, out=out, err=err), 25, 5, val_at=(10,))
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["5/40", "10/40", "15/40", "20/40", "25/40"]
    assert "val" not in lines[0] and "val 0.5000  grad" in lines[1] and "val 0.5000 (step 10)" in lines[2]
    assert all("eta " in line for line in lines[:-1]) and lines[-1].endswith("eta 0s")
    assert err.getvalue() == ""  # no bar, not even its carriage returns


def test_a_terminal_gets_the_bar_and_a_line_every_ten_steps():
    out, err = _Terminal(), _Terminal()
    _feed(Console(total=25, start=0, end=25, log_every=1, progress=True, out=out, err=err), 25, 1)
    assert [line.split()[1] for line in out.getvalue().splitlines() if line.startswith("step")] == \
        ["10/25", "20/25", "25/25"]
    assert "\r" in err.getvalue() and "train" in err.getvalue()  # the bar


def test_progress_false_switches_only_the_bar_off():
    out, err = _Terminal(), _Terminal()
    _feed(Console(total=6, start=2, end=6, log_every=2, progress=False, out=out, err=err), 6, 2)
    assert [line.split()[1] for line in out.getvalue().splitlines()] == ["2/6", "4/6", "6/6"]
    assert err.getvalue() == ""


def test_other_ranks_print_nothing():
    out, err = io.StringIO(), _Terminal()
    _feed(Console(total=4, start=0, end=4, log_every=1, progress=True, rank=1, out=out, err=err), 4, 1)
    assert out.getvalue() == "" and err.getvalue() == ""


def test_cpu_thread_choice():
    assert choose("auto", 200_000, 8, None) == (1, 'runtime.cpu_threads = "auto", a model of 200k parameters')
    assert choose("auto", SMALL_MODEL, 8, None)[0] == 8  # a larger model: one thread per core
    assert choose("auto", 200_000, 8, "3") == (None, "OMP_NUM_THREADS=3")  # the environment decides
    assert choose(2, 200_000, 8, "3") == (2, "runtime.cpu_threads = 2")  # the config key wins


def test_cpu_threads_are_set_said_and_restored(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "inductor"))
    model, before = torch.nn.Linear(8, 8), torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with cpu_threads("auto", torch.device("cpu"), model) as n:
            assert n == 1 and torch.get_num_threads() == 1
            assert os.environ[CACHE_ENV] == str(tmp_path / "inductor" / "cpu-threads-1")  # compiles for 1 thread
        assert torch.get_num_threads() == 2 and os.environ[CACHE_ENV] == str(tmp_path / "inductor")
        err = capsys.readouterr().err
        assert err == ('cpu: 1 torch thread (runtime.cpu_threads = "auto", a model of 72 parameters); '
                       "set runtime.cpu_threads = N or OMP_NUM_THREADS=N to choose\n")
        assert set_cpu_threads("auto", torch.device("cuda"), model) is None  # a GPU run is left alone
        assert os.environ[CACHE_ENV] == str(tmp_path / "inductor")  # nor is its inductor cache
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert set_cpu_threads("auto", torch.device("cpu"), model) is None and capsys.readouterr().err == ""
        assert os.environ[CACHE_ENV] == str(tmp_path / "inductor" / "cpu-threads-2")  # torch's count: the cache's
    finally:
        torch.set_num_threads(before)


def test_inductor_cache_is_keyed_by_thread_count(monkeypatch, tmp_path):
    assert inductor_cache_for(3, str(tmp_path)) == str(tmp_path / "cpu-threads-3")
    assert inductor_cache_for(1, str(tmp_path / "cpu-threads-3")) == str(tmp_path / "cpu-threads-1")  # not nested
    assert inductor_cache_for(1, str(tmp_path / "cpu-threads-3") + "/") == str(tmp_path / "cpu-threads-1")
    monkeypatch.setattr("getpass.getuser", lambda: "someone")
    assert inductor_cache_for(2, None).endswith(os.path.join("torchinductor_someone", "cpu-threads-2"))


_COMPILE_FLEX = """
import sys, torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from flexpack.run.cpu_threads import set_cpu_threads
set_cpu_threads(int(sys.argv[1]), torch.device("cpu"), torch.nn.Linear(2, 2), say=False)
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 4, 512, 64, generator=g) for _ in range(3))
doc = torch.arange(512) // 100
mask = create_block_mask(lambda b, h, i, j: doc[i] == doc[j], None, None, 512, 512, device="cpu")
with torch.no_grad():
    out = torch.compile(flex_attention, dynamic=False)(q, k, v, block_mask=mask)
print(float(out.double().abs().sum()))
"""


@pytest.mark.slow  # 2-3 min on 2 cores: two processes each compile a CPU FlexAttention kernel
def test_cpu_runs_of_two_thread_counts_share_no_compiled_kernel(tmp_path):
    # torch 2.11 alone aborts the second process (heap corruption: "corrupted double-linked list", "malloc():
    # unaligned tcache chunk detected"): it loads the kernel the first compiled for one thread, whose per-thread
    # scratch buffers are too few for two
    env = {**os.environ, CACHE_ENV: str(tmp_path / "inductor"), "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)
    outs = []
    for threads in (1, 2):
        r = subprocess.run([sys.executable, "-c", _COMPILE_FLEX, str(threads)], env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(float(r.stdout.split()[-1]))
    assert outs[0] == pytest.approx(outs[1], rel=1e-5)
    assert sorted(p.name for p in (tmp_path / "inductor").iterdir()) == ["cpu-threads-1", "cpu-threads-2"]


@pytest.mark.slow  # 14 s on 2 cores (a training process)
def test_train_into_a_log_file_writes_plain_lines(tiny_dataset, tmp_path):
    """``flexpack train ... > log`` as a cluster job runs it: a line every log.every steps with the
    validation loss, no carriage return, short lines; OMP_NUM_THREADS unset: the thread count is said."""
    from helpers import TINY, set_args, tiny_sets

    sets = tiny_sets(tiny_dataset, tmp_path / "run", "log.progress=true", "schedule.steps=6", "log.every=2",
                     "validation.every=4", "data.val_episodes=[1]", "log.tensorboard=false")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    log = tmp_path / "train.log"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "flexpack.cli", "train", str(TINY), *set_args(sets)], cwd=ROOT,
                              env=env, stdout=f, stderr=subprocess.STDOUT, timeout=600)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "\r" not in text and max(len(line) for line in text.splitlines()) < 300
    steps = [line for line in text.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["2/6", "4/6", "6/6"]
    for key in ("loss ", "grad ", "lr ", "tok/s ", "mem "):
        assert all(key in line for line in steps), steps
    assert "val " not in steps[0] and "  val " in steps[1] and "val " in steps[2] and "(step 4)" in steps[2]
    params = int(re.search(r"no weight decay \(\d+ tensors, ([\d,]+) parameters\)", text)[1].replace(",", ""))
    assert f'cpu: 1 torch thread (runtime.cpu_threads = "auto", a model of {params / 1e6:.3g}M parameters)' in text
    assert "trained steps 0 -> 6" in text
