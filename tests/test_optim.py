"""Optimizer details: parameter groups without weight decay, EMA (saved, resumed, FSDP-safe math)."""

from __future__ import annotations

import pytest
import torch

from flexpack.families.wan.config import wan_config
from flexpack.families.wan.model import WanVA
from flexpack.run.config import load_config
from flexpack.run.state import checkpoint
from flexpack.training.ema import EMA, make_ema
from flexpack.training.optim import build_optimizer, describe, param_groups
from helpers import tiny_config


def _model():
    torch.manual_seed(0)
    return WanVA(wan_config("tiny", attn_backend="dense"))


def test_no_weight_decay_on_norms_biases_modulation_and_embeddings():
    model = _model()
    groups = {g["name"]: set(g["names"]) for g in param_groups(model, 0.1)}
    decay, no_decay = groups["decay"], groups["no_decay"]
    assert decay | no_decay == {n for n, _ in model.named_parameters()} and not decay & no_decay
    for name in ("blocks.0.self_attn.q.weight", "blocks.1.cross_attn.o.weight", "blocks.0.ffn.fc1.weight",
                 "head_proj.weight", "action_head_proj.weight"):
        assert name in decay, name
    for name in ("blocks.0.self_attn.q.bias", "blocks.0.self_attn.norm_q.weight", "blocks.0.cross_norm_weight",
                 "blocks.0.cross_norm_bias", "blocks.1.modulation", "head_modulation", "action_head_modulation",
                 "patch_embed.weight", "action_embed.weight", "time_embed.fc1.weight", "time_embed.mod_proj.weight",
                 "text_embed.fc2.weight", "head_proj.bias"):
        assert name in no_decay, name


def test_decay_applies_only_to_the_decay_group(capsys):
    model = _model()
    cfg = load_config(overrides=["optim.lr=0.1", "optim.weight_decay=0.5"]).optim
    opt = build_optimizer(model, cfg, log=True)
    out = capsys.readouterr().out
    groups = param_groups(model, 0.5)
    n_decay, n_rest = (len(g["params"]) for g in groups)
    assert out.count("\n") == 1 and out.startswith(f"optim: AdamW, weight_decay=0.5 on {n_decay} tensors")
    assert f"none on {n_rest} (" in out and "blocks." not in out  # one line of counts, no names
    listed = describe(groups, names=True)
    assert "optim group no_decay (weight_decay=0.0)" in listed
    assert "blocks.*.modulation" in listed and "blocks.0." not in listed  # block indices folded
    build_optimizer(model, load_config(overrides=["optim.weight_decay=0"]).optim, log=True)
    total = sum(p.numel() for p in model.parameters())
    assert (capsys.readouterr().out
            == f"optim: AdamW, no weight decay ({n_decay + n_rest} tensors, {total:,} parameters)\n")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # Adam's step is 0: only decoupled weight decay moves weights
    opt.step()
    names = {g["name"]: g["names"] for g in param_groups(model, 0.5)}
    for n in names["decay"]:
        assert torch.allclose(model.get_parameter(n), before[n] * (1 - 0.1 * 0.5)), n
    for n in names["no_decay"]:
        assert torch.equal(model.get_parameter(n), before[n]), n


def test_ema_update_formula_and_state_roundtrip():
    model = _model()
    assert make_ema(model, 0.0) is None
    ema = EMA(model, 0.9)
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update()
    for n, s in ema.state_dict().items():
        assert torch.allclose(s, w0[n] + 0.1), n  # 0.9·w0 + 0.1·(w0 + 1)
    full = ema.full_state_dict()
    other = EMA(_model(), 0.9)
    other.load_state_dict(full)
    assert all(torch.equal(a, full[n]) for n, a in other.state_dict().items())
    other.load_state_dict(None)  # a checkpoint without EMA: restart at the weights
    assert all(torch.equal(a, w0[n]) for n, a in other.state_dict().items())
    with pytest.raises(ValueError, match="optim.ema_decay must be in"):
        load_config(overrides=["optim.ema_decay=1.0"])


@pytest.mark.usefixtures("one_thread")
def test_ema_is_checkpointed_and_resumes_exactly(tiny_dataset, tmp_path):
    from flexpack.commands.train import train

    def cfg(out):
        return tiny_config(tiny_dataset, tmp_path / out, "schedule.steps=4", "optim.ema_decay=0.5",
                           "optim.weight_decay=0.1", "schedule.rewarmup_steps=0")

    train(cfg("full"))
    train(cfg("split"), stop_after=2)
    train(cfg("split"))
    a, b = (checkpoint.read_ema(tmp_path / r / "checkpoints" / "step_00000004")
            for r in ("full", "split"))
    model = checkpoint.read_tensors(tmp_path / "full" / "checkpoints" / "step_00000004")
    assert set(a) == set(model)
    for n in a:
        assert torch.allclose(a[n], b[n], rtol=1e-5, atol=1e-7), n
    assert any(not torch.allclose(a[n], model[n]) for n in a)  # an average, not the weights
