"""Useful FLOPs: parameter matmuls equal torch's FLOP counter on a real forward, attention counts
only unmasked pairs, padding counts nothing, and the peak comes from the datasheet or the environment."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from flexpack.families.wan.config import wan_config
from flexpack.families.wan.model import WanVA
from flexpack.packing.layout import SequenceLayout
from flexpack.training.observe.flops import flops_breakdown, peak_flops, useful_flops


def test_linear_flops_equal_the_flop_counter_of_a_forward():
    torch.manual_seed(0)
    cfg = wan_config("tiny", attn_backend="dense")
    model = WanVA(cfg)
    F, H, W, L, A = 5, 4, 6, 3, 4  # 2x2 patches: 6 video tokens per latent frame
    lay = SequenceLayout.from_rows([[F]], F, text_len=[L], mode="pad")
    batch = SimpleNamespace(latent=torch.randn(1, cfg.in_channels, F, H, W),
                            action=torch.randn(1, cfg.action_channels, F, A),
                            text=torch.randn(1, L, cfg.text_dim), layout=lay)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(batch, timestep=torch.rand(1, F) * 1000)
    b = flops_breakdown(cfg, lay, video_tokens=6, action_tokens=A, backward=False)
    # the counter sees every addmm/mm of the forward (its CPU attention kernel it does not count)
    assert b.linear == counter.get_total_flops() == 9_100_288
    n = F * (6 + A)  # one episode of 50 tokens, 2 layers, dim 64
    assert b.self_attention == 2 * n * n * 4 * 64
    assert b.cross_attention == 2 * n * L * 4 * 64
    assert useful_flops(cfg, lay, video_tokens=6, action_tokens=A) == 3 * b.forward


def test_padding_and_layout_forms_agree():
    cfg = wan_config("wan2.2-5b", num_layers=4)
    frames = [103, 140, 57]
    packed = SequenceLayout.from_rows([frames], 400, text_len=[512] * 3)  # 100 pad frames at the end
    tl = packed.tokens(video_tokens=32, action_tokens=4, grid_hw=(4, 8))
    from_tokens = useful_flops(cfg, tl)
    assert from_tokens == useful_flops(cfg, packed, video_tokens=32, action_tokens=4)
    assert from_tokens == useful_flops(cfg, frames, 512, video_tokens=32, action_tokens=4)
    # each episode alone: the sum (no cross-episode pairs, pad counts nothing)
    assert from_tokens == pytest.approx(sum(useful_flops(cfg, [f], 512, video_tokens=32, action_tokens=4)
                                            for f in frames))
    # the block matmuls are 2 FLOPs per weight per token: 2 * N * (weights of q, k, v, o, FFN, cross q, o) per layer
    b = flops_breakdown(cfg, [100], 0, video_tokens=36)
    D, Fd, n = 3072, 14336, 3600
    per_layer_weights = 4 * D * D + 2 * D * Fd
    embed = n * 2 * 48 * 4 * D + 100 * (2 * 256 * D + 2 * D * D + 12 * D * D) + n * 2 * D * 48 * 4
    assert b.linear == 4 * 2 * n * per_layer_weights + embed
    assert b.self_attention == 4 * n * n * 4 * D and b.cross_attention == 0


def test_teacher_forcing_copies_double_the_tokens_heads_only_on_the_noisy_copy():
    cfg = wan_config("tiny")
    one = flops_breakdown(cfg, [10], 0, video_tokens=4, action_tokens=2, copies=1)
    two = flops_breakdown(cfg, [10], 0, video_tokens=4, action_tokens=2, copies=2)
    assert two.self_attention == 4 * one.self_attention  # n doubles: 4x the (document-mask) pairs
    D, pv = cfg.dim, cfg.patch_volume
    heads = 10 * 4 * 2 * D * cfg.out_dim * pv + 10 * 2 * 2 * D * cfg.action_channels
    assert two.linear == 2 * (one.linear - heads) + heads


def test_peak_flops_from_runtime_peak_tflops_alone(monkeypatch):
    assert peak_flops("cpu") is None  # no MFU on a CPU
    assert peak_flops("cpu", 795.0) == 795e12
    monkeypatch.setenv("LINGBOT_PEAK_TFLOPS", "100")  # a variable of earlier versions: no longer read
    assert peak_flops("cpu") is None and peak_flops("cpu", 795.0) == 795e12
    with pytest.raises(ValueError, match="needs video_tokens="):
        useful_flops(wan_config("tiny"), [3])
