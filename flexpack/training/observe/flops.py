"""Useful FLOPs of a model step (any family: its ModelShape) and the bf16 peak they are measured against (MFU).

"Useful" counts only the work a step needs for its valid tokens: every parameter matmul on the
tokens it acts on (2·in·out per token), self-attention on the unmasked (query, key) pairs of a
document mask (each episode of ``n`` tokens attends ``n²`` pairs, 4·head_dim·heads FLOPs per
pair: QKᵀ and PV), text cross-attention on ``n · text_len`` pairs per episode. Padding tokens,
padded text slots, norms, modulation and RoPE count nothing. Forward + backward is 3× the
forward (the backward's two matmuls per forward matmul); recomputation in the backward
(FlashAttention's, activation checkpointing) is not useful work and is not counted.

Self-attention under a chunk-causal or teacher-forcing mask attends fewer pairs than ``n²``;
the count here is the document mask's, so MFU for those masks is an upper bound. An objective that
counts its mask's pairs (``Objective.attention_pairs``: lingbot-va's, whose chunk size and window are
drawn per episode and step) gets them counted as the step drew them (:class:`UsefulFlops`).

MFU = useful FLOPs / (seconds × peak). The peak is what an 8192³ bf16 matmul reaches on the GPU
itself, measured once per process (:func:`measured_bf16_peak`; 755–795 TFLOP/s on the H200, whose
datasheet gives 989 dense), unless ``profile.peak_tflops`` sets it: that key is the only override, so
metrics.jsonl's ``mfu`` and the profile summary divide by the same figure.
``benchmarks/train_step.py``, metrics.jsonl's ``mfu`` and the profile summary all count useful FLOPs
through :class:`UsefulFlops` (:func:`batch_flops`), fed by the run's token geometry (:mod:`flexpack.run.root`:
copies, video and action tokens per frame).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flexpack.models.registry import ModelShape
from flexpack.packing.geometry import TokenGeometry
from flexpack.packing.grids import episode_video_tokens
from flexpack.packing.layout import SequenceLayout, TokenLayout


@dataclass(frozen=True, kw_only=True)
class StepFlops:
    """Forward FLOPs of one micro-batch by kind; :attr:`total` is forward + backward."""

    linear: float  # parameter matmuls (blocks, embeddings, heads, time embedding)
    self_attention: float
    cross_attention: float
    backward: bool = True

    @property
    def forward(self) -> float:
        return self.linear + self.self_attention + self.cross_attention

    @property
    def total(self) -> float:
        return self.forward * (3.0 if self.backward else 1.0)


def _episodes(layout_or_counts, text_len, video_tokens, action_tokens, copies):
    """(frames per episode, text tokens per episode, video tokens/frame per episode (its own grid's, where the
    layout pads smaller grids spatially), action tokens/frame, copies)."""
    if isinstance(layout_or_counts, TokenLayout):
        tl = layout_or_counts
        frames = tl.frames.episode_frames.tolist()
        nv, na, c = episode_video_tokens(tl.frames.on_host(), tl.video_tokens), tl.action_tokens, tl.copies
        default_text = tl.text_len.tolist()
    else:
        if video_tokens is None:
            raise ValueError("useful_flops needs video_tokens= (tokens per latent frame) unless given a TokenLayout")
        na, c = action_tokens or 0, copies or 1
        if isinstance(layout_or_counts, SequenceLayout):
            frames, default_text = layout_or_counts.episode_frames.tolist(), layout_or_counts.text_len.tolist()
            nv = episode_video_tokens(layout_or_counts.on_host(), video_tokens)
        else:
            frames, default_text = [int(f) for f in layout_or_counts], [0] * len(layout_or_counts)
            nv = [video_tokens] * len(frames)
    if text_len is None:
        texts = [int(t) for t in default_text]
    elif isinstance(text_len, int):
        texts = [text_len] * len(frames)
    else:
        texts = [int(t) for t in text_len]
    if len(texts) != len(frames):
        raise ValueError(f"text_len has {len(texts)} entries for {len(frames)} episodes")
    return frames, texts, nv, na, c


def flops_breakdown(
    config: ModelShape,
    layout_or_counts: TokenLayout | SequenceLayout | Sequence[int],
    text_len: int | Sequence[int] | None = None,
    *,
    video_tokens: int | None = None,
    action_tokens: int = 0,
    copies: int = 1,
    backward: bool = True,
    pairs: Sequence[int] | None = None,
) -> StepFlops:
    """Useful forward FLOPs of one micro-batch of a model (a Wan-style DiT) of shape ``config``, by kind.

    ``layout_or_counts``: a :class:`TokenLayout` (token counts and copies from it), or a
    :class:`SequenceLayout` / a list of latent frames per episode together with ``video_tokens``
    (and ``action_tokens``) per latent frame and ``copies`` (2 with teacher forcing).
    ``text_len``: valid text tokens per episode (an int for all); default the layout's, or none.
    ``pairs``: self-attention (query, key) pairs per episode, all copies; default ``n²`` (document mask).
    """
    frames, texts, nv, na, c = _episodes(layout_or_counts, text_len, video_tokens, action_tokens, copies)
    if pairs is not None and len(pairs) != len(frames):
        raise ValueError(f"pairs has {len(pairs)} entries for {len(frames)} episodes")
    D, Fd, Ly = config.dim, config.ffn_dim, config.num_layers
    Ca = config.action_channels if na else 0
    S = 2 if na else 1  # timestep streams per unit
    per_token_block = 4 * 2 * D * D + 2 * D * Fd * 2  # self q, k, v, o + FFN
    linear = self_attn = cross_attn = 0.0
    for e, (f, t, v) in enumerate(zip(frames, texts, nv)):
        video, action = f * v * c, f * na * c
        n = video + action
        per_token = per_token_block + (2 * 2 * D * D if t else 0)  # cross-attention q, o
        linear += Ly * n * per_token
        linear += video * 2 * config.in_channels * config.patch_volume * D + action * 2 * Ca * D
        linear += f * c * S * (2 * config.freq_dim * D + 2 * D * D + 2 * D * 6 * D)  # timestep MLP, modulation
        linear += f * v * 2 * D * config.out_dim * config.patch_volume + f * na * 2 * D * Ca  # heads: noisy copy
        linear += t * (Ly * 2 * 2 * D * D + 2 * config.text_dim * D + 2 * D * D)  # cross k, v; text MLP
        self_attn += Ly * (n * n if pairs is None else pairs[e]) * 4 * D  # 4 · head_dim · heads per pair
        cross_attn += Ly * n * t * 4 * D
    return StepFlops(linear=float(linear), self_attention=float(self_attn), cross_attention=float(cross_attn),
                     backward=backward)


def useful_flops(
    config: ModelShape,
    layout_or_counts: TokenLayout | SequenceLayout | Sequence[int],
    text_len: int | Sequence[int] | None = None,
    **kw,
) -> float:
    """Useful forward + backward FLOPs of one micro-batch (see :func:`flops_breakdown` for the arguments;
    ``backward=False`` gives the forward alone)."""
    return flops_breakdown(config, layout_or_counts, text_len, **kw).total


def batch_flops(
    config: ModelShape, geometry: TokenGeometry, layout: SequenceLayout, *, backward: bool = True,
    pairs: Sequence[int] | None = None,
) -> float:
    """Useful FLOPs of one collated micro-batch: its layout's episodes and text lengths, with the
    video and action tokens per frame and the copies of the run's ``geometry``. A layout on the GPU is
    read through its host copy (no wait for the GPU). ``pairs``: as :func:`flops_breakdown`."""
    return useful_flops(config, layout.on_host(), None, video_tokens=geometry.video_tokens,
                        action_tokens=geometry.action_tokens, copies=geometry.copies, backward=backward, pairs=pairs)


class UsefulFlops:
    """Useful FLOPs of a run's training micro-batches, the one count metrics.jsonl's ``mfu``, the profile
    summary and ``benchmarks/`` share: :func:`batch_flops` with the run's model config and geometry, and
    self-attention on the pairs the run's objective says its mask kept in that step."""

    def __init__(self, config: Any, geometry: TokenGeometry, *, objective: Any, seed: int) -> None:
        self.config, self.geometry, self.objective, self.seed = config, geometry, objective, seed

    def __call__(self, layout: SequenceLayout, step: int, *, backward: bool = True) -> float:
        """FLOPs of the micro-batch with ``layout`` trained at optimizer step ``step`` (0-based, as
        :func:`flexpack.training.step.train_step` keys its draws)."""
        from flexpack.flow.noise import noise_seeds

        host = layout.on_host()
        pairs = self.objective.attention_pairs(host, self.geometry, noise_seeds(host, self.seed, step))
        return batch_flops(self.config, self.geometry, layout, backward=backward, pairs=pairs)


_MEASURED: dict[str, float] = {}


def measured_bf16_peak(device: torch.device | str, n: int = 8192, reps: int = 10) -> float:
    """FLOP/s of an ``n³`` bf16 matmul on a CUDA ``device`` (median of ``reps`` after a warm-up),
    measured once per process and device."""
    device = torch.device(device)
    key = f"{device}:{n}"
    if key not in _MEASURED:
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
        _MEASURED[key] = 2.0 * n**3 / sorted(times)[len(times) // 2]
    return _MEASURED[key]


def peak_flops(device: torch.device | str | None = None, tflops: float | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of ``device``: ``tflops`` (``profile.peak_tflops``) if set, else
    :func:`measured_bf16_peak` on CUDA; ``None`` on CPU (no MFU)."""
    if tflops:
        return float(tflops) * 1e12
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    return measured_bf16_peak(device)
