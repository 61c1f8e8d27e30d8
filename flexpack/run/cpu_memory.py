"""A CPU run that cannot fit the machine's memory is refused at start, before data, weights or the model
(:func:`check_cpu_memory`, called by :func:`flexpack.run.checks.preflight`), instead of being killed by the
kernel's out-of-memory killer minutes later with no message.

The figure is a lower bound of what one training step holds (pack mode, ``data.max_tokens`` per micro-batch,
``T = data.max_tokens x copies`` tokens in attention), so only a run that certainly cannot fit is refused:

- dense attention (the CPU backend, ``attn_backend`` "auto" or "dense": FlexAttention has no CPU backward): the
  layout's ``T x T`` boolean mask (1 byte per token pair), and, for every layer whose activations the backward
  keeps, that mask in the compute dtype (``runtime.dtype``: 4 or 2 bytes per pair). torch 2.11 runs a masked
  SDPA on the CPU with its flash kernel, so the heads add nothing quadratic; measured on a 2-core machine,
  training steps of 2-4 layers at T = 16,000 took 6.3 (float32) and 3.8-4.3 (bfloat16) bytes per pair and
  layer, above the 4 and 2 counted here;
- activations: per kept layer at least ``4 x dim + 2 x ffn_dim`` values per token (a Wan block keeps its input,
  q, k, v, attention output and both feed-forward activations);
- weights, gradients and AdamW moments: 16 bytes per trainable parameter (fp32 master weights, gradient, two
  moments), 4 per frozen one, 4 more per parameter with an EMA.

Kept layers: every layer, ``parallel.activation_checkpointing = true``: one at a time, ``= n``: the other
``num_layers - n`` and one. Several ranks on one host (``torchrun`` on CPU) shard the weights' part (FSDP2)
and each hold their own attention and activations. Memory: what the kernel says is available now
(``psutil`` where installed, else ``/proc/meminfo``'s MemAvailable, else the machine's total).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flexpack.errors import UserError
from flexpack.run.resolve import config_family, model_config_of

if TYPE_CHECKING:
    import torch

    from flexpack.run.config import TrainConfig

GiB = 2**30
DENSE = ("auto", "dense")  # attn_backend values that train on the CPU's dense-mask SDPA


@dataclass(frozen=True)
class CpuNeed:
    """Bytes a training step needs at least, by part (see the module docstring)."""

    attention: int
    activations: int
    weights: int

    @property
    def total(self) -> int:
        return self.attention + self.activations + self.weights


def available_memory() -> tuple[int, str]:
    """(bytes available now, where the figure comes from)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available), "available (psutil)"
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable (/proc/meminfo)"
    except (OSError, ValueError, IndexError):
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "the machine's total"


def kept_layers(layers: int, checkpointing: bool | int | str) -> int:
    """Layers whose activations the backward keeps at once (``parallel.activation_checkpointing``)."""
    if checkpointing is True:
        return 1
    if checkpointing is False or isinstance(checkpointing, str):  # "selective" keeps the attention's inputs
        return layers
    return max(1, layers - min(int(checkpointing), layers) + 1)


def parameter_counts(cfg: TrainConfig, model_cfg: Any = None) -> tuple[int, int]:
    """(trainable, frozen) parameters of the config's model, built on the meta device (no memory, no weights)."""
    import torch

    with torch.device("meta"):
        model = config_family(cfg).build(model_config_of(cfg) if model_cfg is None else model_cfg)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters()) - trainable


def cpu_need(cfg: TrainConfig, max_tokens: int, params: tuple[int, int], world_size: int = 1,
             model_cfg: Any = None) -> CpuNeed:
    """The lower bound of one training step on the CPU with ``max_tokens`` per pack (the module docstring);
    ``params``: (trainable, frozen) parameters."""
    m = model_config_of(cfg) if model_cfg is None else model_cfg
    per_value = 2 if cfg.runtime.dtype == "bfloat16" else 4
    tokens = max_tokens * config_family(cfg).copies_of(cfg.objective.teacher_forcing)
    kept = kept_layers(m.num_layers, cfg.parallel.activation_checkpointing)
    attention = tokens * tokens * (1 + kept * per_value) if m.attn_backend in DENSE else 0
    activations = kept * tokens * (4 * m.dim + 2 * m.ffn_dim) * per_value
    trainable, frozen = params
    weights = trainable * 16 + frozen * 4 + (trainable + frozen) * 4 * (cfg.optim.ema_decay > 0)
    return CpuNeed(attention=attention * world_size, activations=activations * world_size, weights=weights)


def largest_fitting(cfg: TrainConfig, params: tuple[int, int], have: int, world_size: int = 1,
                    model_cfg: Any = None) -> int:
    """The largest ``data.max_tokens`` whose step fits ``have`` bytes (0: none, the weights alone do not)."""
    lo, hi = 0, cfg.data.max_tokens
    while lo < hi:  # need() grows with max_tokens
        mid = (lo + hi + 1) // 2
        if cpu_need(cfg, mid, params, world_size, model_cfg).total <= have:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _count(n: int) -> str:
    return f"{n / 1e9:,.2f}B" if n >= 1e9 else f"{n / 1e6:,.2f}M"


def check_cpu_memory(cfg: TrainConfig, device: torch.device, world_size: int = 1, model_cfg: Any = None) -> None:
    """Refuse, in one line with the figure and the largest ``data.max_tokens`` that fits, a CPU training run in
    pack mode whose step cannot fit the memory available (the module docstring)."""
    if device.type != "cpu" or cfg.data.mode != "pack":
        return
    model_cfg = model_config_of(cfg) if model_cfg is None else model_cfg
    params = parameter_counts(cfg, model_cfg)
    need, (have, source) = cpu_need(cfg, cfg.data.max_tokens, params, world_size, model_cfg), available_memory()
    if need.total <= have:
        return
    m, per_value = model_cfg, 2 if cfg.runtime.dtype == "bfloat16" else 4
    copies = config_family(cfg).copies_of(cfg.objective.teacher_forcing)
    tokens = cfg.data.max_tokens * copies
    kept = kept_layers(m.num_layers, cfg.parallel.activation_checkpointing)
    parts = []
    if need.attention:
        parts.append(f"dense attention {need.attention / GiB:,.1f} GiB (a {tokens:,} x {tokens:,} token-pair mask, "
                     f"1 + {kept} kept layer(s) x {per_value} bytes per pair)")
    parts.append(f"activations {need.activations / GiB:,.1f} GiB")
    parts.append(f"weights, gradients and AdamW moments {need.weights / GiB:,.1f} GiB "
                 f"({_count(sum(params))} parameters)")
    fits = largest_fitting(cfg, params, have, world_size, model_cfg)
    if fits == 0:
        advice = "no data.max_tokens fits (the weights alone do not): use a GPU (runtime.device) or a smaller model"
    else:
        advice = f"the largest data.max_tokens that fits this lower bound is {fits:,}" + (
            "" if cfg.parallel.activation_checkpointing is True else " (more with parallel.activation_checkpointing "
                                                                      "= true)")
    what = f"data.max_tokens = {cfg.data.max_tokens:,}" + (f" (x {copies} copies)" if copies > 1 else "") + (
        f" on {world_size} ranks" if world_size > 1 else "")
    raise UserError(f"runtime.device = cpu: {what} needs at least {need.total / GiB:,.1f} GiB, more than the "
                    f"{have / GiB:,.1f} GiB {source}: {', '.join(parts)}; {advice}")
