"""Useful FLOPs of a training step and the GPU's bf16 peak, for MFU.

Counted as the benchmarks count them (``benchmarks/train_step.py``): every weight matrix on the
tokens it acts on (2 FLOPs per multiply-add, ×3 for forward + backward), attention on unmasked
(query, key) pairs only — per episode of ``n`` tokens ``n²`` self-attention pairs and ``n · L``
text pairs, ``4 · dim`` FLOPs per pair forward (QKᵀ and PV over all heads) and 3.5× that for
forward + backward (the backward recomputes the scores: 2.5× the forward). Padding, empty text
slots and activation-checkpointing recompute are not useful work and are not counted.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

# Datasheet dense bf16 peak of Hopper SXM parts (H100 / H200): 989.5 TFLOP/s. A measured 8192³
# bf16 matmul reaches ~770-800 on the H200; `measured_bf16_peak()` measures it on the spot.
HOPPER_BF16_PEAK = 989.5e12


def episode_flops(cfg: Any, tokens: Sequence[int], text_tokens: Sequence[int], *, video_tokens: int | None = None) -> float:
    """Useful fwd+bwd FLOPs of one micro-batch of a :class:`~flexpack.models.wan_config.WanVAConfig`
    model: ``tokens[e]`` valid tokens and ``text_tokens[e]`` text tokens of each episode."""
    D, Fd, Lyr = cfg.dim, cfg.ffn_dim, cfg.num_layers
    n_tok = float(sum(tokens))
    n_text = float(sum(text_tokens))
    per_token = Lyr * (4 * D * D + 2 * D * D + 2 * D * Fd)  # self q,k,v,o; cross q,o; FFN
    per_token += cfg.in_channels * cfg.patch_volume * D + D * cfg.out_dim * cfg.patch_volume  # patch embed, head
    per_text = Lyr * 2 * D * D + cfg.text_dim * D + D * D  # cross k,v per layer; text MLP
    matmul = 2.0 * (per_token * n_tok + per_text * n_text)
    pairs = sum(float(n) * n for n in tokens)
    text_pairs = sum(float(n) * L for n, L in zip(tokens, text_tokens))
    attn_fwd = 4.0 * D * (pairs + text_pairs) * Lyr
    return 3.0 * matmul + 3.5 * attn_fwd


def batch_flops(cfg: Any, layout: Any, tokens_per_frame: int, text_tokens: int | Sequence[int]) -> float:
    """:func:`episode_flops` of a micro-batch from its (host-side) ``SequenceLayout``."""
    frames = [int(f) for f in layout.episode_frames.tolist()]
    L = [int(text_tokens)] * len(frames) if isinstance(text_tokens, int) else [int(x) for x in text_tokens]
    return episode_flops(cfg, [f * tokens_per_frame for f in frames], L)


def measured_bf16_peak(device: torch.device, n: int = 8192, reps: int = 10) -> float:
    """FLOP/s of an ``n³`` bf16 matmul on ``device`` (median of ``reps`` after a warm-up)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2.0 * n**3 / sorted(times)[len(times) // 2]
