"""A CPU training run whose step cannot fit the memory available is refused at start, in one line with the figure
and the largest data.max_tokens that fits (flexpack/run/cpu_memory.py), before any data, model or weights."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from flexpack.run import cpu_memory
from flexpack.run.checks import preflight
from flexpack.run.config import load_config
from flexpack.run.resolve import config_family, model_config_of
from helpers import TINY, run_cli

ROOT = Path(__file__).resolve().parents[1]
WAN5B = ROOT / "configs" / "wan5b_pack.toml"
GiB = 2**30
LINGBOT = ["model.family=lingbot-va", "model.preset=lingbot-va-tiny"]


def _memory(monkeypatch, gib: float) -> int:
    have = int(gib * GiB)
    monkeypatch.setattr(cpu_memory, "available_memory", lambda: (have, "available (test)"))
    return have


def test_wan5b_on_the_cpu_is_refused_at_once_with_the_figure(tmp_path, capsys, monkeypatch) -> None:
    """configs/wan5b_pack.toml with 32,768-token packs on the CPU: refused in one line (exit 2) within seconds, with
    each part of the figure; the weights alone exceed the memory, so no data.max_tokens fits."""
    _memory(monkeypatch, 16)
    with torch.device("meta"):
        cfg = load_config(WAN5B, ["data.max_tokens=32768", "runtime.device=cpu"])
        model = config_family(cfg).build(model_config_of(cfg))
    params = sum(p.numel() for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())
    t0 = time.monotonic()
    code, err = run_cli(capsys, "train", str(WAN5B), "--set", "data.max_tokens=32768", "--set", "runtime.device=cpu",
                        "--set", f"runtime.out_dir={tmp_path / 'run'}")
    took = time.monotonic() - t0
    assert code == 2 and err.count("\n") == 1, err
    pairs = 32768 * 32768
    layers = model_config_of(cfg).num_layers
    activations = 32768 * (4 * 3072 + 2 * 14336) * 2  # one kept layer (activation checkpointing), bfloat16
    total = pairs * (1 + 1 * 2) + activations + params * 16
    assert layers == 30 and err == (
        f"flexpack train: error: runtime.device = cpu: data.max_tokens = 32,768 needs at least {total / GiB:,.1f} GiB, "
        f"more than the 16.0 GiB available (test): dense attention {pairs * 3 / GiB:,.1f} GiB (a 32,768 x 32,768 "
        f"token-pair mask, 1 + 1 kept layer(s) x 2 bytes per pair), activations {activations / GiB:,.1f} GiB, weights, "
        f"gradients and AdamW moments {params * 16 / GiB:,.1f} GiB ({params / 1e9:,.2f}B parameters); no "
        "data.max_tokens fits (the weights alone do not): use a GPU (runtime.device) or a smaller model\n")
    assert took < 30, took  # before any data, model or weights (the kernel killed it after 139 s)
    assert not (tmp_path / "run").exists()


def test_the_largest_max_tokens_that_fits(tmp_path, monkeypatch) -> None:
    """The tiny lingbot-va model (two copies of every frame) with too large packs: the message's data.max_tokens
    fits and one more token does not; the run with it passes the check."""
    have = _memory(monkeypatch, 2)
    sets = [*LINGBOT, "data.max_tokens=100000", f"runtime.out_dir={tmp_path / 'run'}"]
    cfg = load_config(TINY, sets)
    with pytest.raises(Exception) as info:
        preflight(cfg)
    text = str(info.value)
    fits = int(text.split("that fits this lower bound is ")[1].split(" ")[0].replace(",", ""))
    params = cpu_memory.parameter_counts(cfg)
    assert cpu_memory.cpu_need(cfg, fits, params).total <= have < cpu_memory.cpu_need(cfg, fits + 1, params).total
    assert "data.max_tokens = 100,000 (x 2 copies) needs at least" in text and "\n" not in text
    assert "(more with parallel.activation_checkpointing = true)" in text
    assert preflight(load_config(TINY, [*sets, f"data.max_tokens={fits}"])) == torch.device("cpu")


def test_the_count_of_each_part(monkeypatch) -> None:
    """The lower bound, part by part, for the tiny lingbot-va model: T = 2 x max_tokens tokens, a 1-byte mask plus
    one compute-dtype copy per kept layer, 4 dim + 2 ffn_dim values per token and kept layer, 16 bytes per trainable
    parameter and 4 per frozen one (+ 4 per parameter with an EMA); other backends have no T x T mask."""
    cfg = load_config(TINY, [*LINGBOT, "data.max_tokens=1000"])
    m = model_config_of(cfg)
    trainable, frozen = cpu_memory.parameter_counts(cfg)
    model = config_family(cfg).build(m)
    assert (trainable, frozen) == (sum(p.numel() for p in model.parameters() if p.requires_grad),
                                   sum(p.numel() for p in model.parameters() if not p.requires_grad))
    need = cpu_memory.cpu_need(cfg, 1000, (trainable, frozen))
    assert need.attention == 2000**2 * (1 + 2 * 4)
    assert need.activations == 2 * 2000 * (4 * 64 + 2 * 128) * 4
    assert need.weights == 16 * trainable + 4 * frozen
    ema = load_config(TINY, [*LINGBOT, "optim.ema_decay=0.9", "runtime.dtype=bfloat16",
                             "parallel.activation_checkpointing=1"])
    need = cpu_memory.cpu_need(ema, 1000, (trainable, frozen))
    assert need.attention == 2000**2 * (1 + 2 * 2) and need.weights == 20 * trainable + 8 * frozen
    loop = load_config(TINY, [*LINGBOT, "model.overrides.attn_backend='sdpa-loop'"])
    assert cpu_memory.cpu_need(loop, 1000, (trainable, frozen)).attention == 0
    assert cpu_memory.cpu_need(cfg, 1000, (trainable, frozen), world_size=2).attention == 2 * 2000**2 * 9
    assert [cpu_memory.kept_layers(30, c) for c in (False, True, 24, 30, 40, "selective")] == [30, 1, 7, 1, 1, 30]
    # only CPU pack-mode runs are checked
    _memory(monkeypatch, 0)
    cpu_memory.check_cpu_memory(cfg, torch.device("meta"))
    cpu_memory.check_cpu_memory(load_config(TINY, ["data.mode=pad"]), torch.device("cpu"))
    with pytest.raises(Exception, match="the weights alone do not"):
        cpu_memory.check_cpu_memory(cfg, torch.device("cpu"))


def test_available_memory_without_psutil(monkeypatch) -> None:
    with_psutil, source = cpu_memory.available_memory()
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil raises ImportError
    have, where = cpu_memory.available_memory()
    assert where == "MemAvailable (/proc/meminfo)" and source == "available (psutil)"
    assert abs(have - with_psutil) < 0.25 * with_psutil  # the same figure, read at another moment
