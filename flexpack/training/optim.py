"""The optimizer: AdamW with weight decay only where it regularizes.

No decay (the usual practice for transformers, cf. nanoGPT's ``configure_optimizers``) on:

- norm gains and every other 1-D tensor (norm gains, biases): decaying a gain pulls it to 0, not
  towards its neutral value 1;
- AdaLN modulation tables (``*modulation``): shifts, scales and gates added to the timestep's
  modulation, whose neutral value is 0 only by accident of parametrization;
- input embeddings (``patch_embed``, ``action_embed``, ``time_embed``, ``text_embed``): they map
  the inputs into the model and are not the capacity decay is meant to limit.

The grouping is by parameter name and shape, so it is the same for a plain and an FSDP2 model
(DTensor parameters keep the global shape); one line of counts is printed once per run on rank 0.

Low-memory variants (``optim.states``, ``optim.offload``; torchao, the optional extra ``float8``), same
groups: torchao's ``AdamW8bit`` / ``AdamW4bit`` keep both moments block-quantized (tensors of at least
4096 values whose size the block divides; smaller ones stay float32), and ``CPUOffloadOptimizer`` keeps
states, a float32 copy of the parameters and the update on the host (one GPU only; tensors under 4096
values stay on the GPU), copying each gradient to the host as backward produces it — before any
clipping, so offload runs without ``optim.grad_clip``. Under FSDP2 (several ranks) ``optim.offload =
"optimizer+gradients"`` is FSDP2's own ``CPUOffloadPolicy`` instead (:mod:`flexpack.parallel.parallelize`): each
rank's parameter shards and their gradients live on the host, the optimizer (AdamW or a low-bit one) steps there,
and clipping works as usual. :func:`optimizer_bytes_per_param` counts the bytes per parameter of each choice.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flexpack.errors import UserError
from flexpack.parallel.parallelize import is_sharded, plain_name

if TYPE_CHECKING:
    from flexpack.run.config import OptimConfig

# bytes per parameter of AdamW's two moments: float32; torchao's 8-bit (1 B each plus a float32 scale per
# 256-value block) and 4-bit (0.5 B each plus a float32 scale per 128-value block)
STATE_BYTES = {"float32": 8.0, "8bit": 2 * (1 + 4 / 256), "4bit": 2 * (0.5 + 4 / 128)}
TORCHAO_CLASS = {"8bit": "AdamW8bit", "4bit": "AdamW4bit"}

NO_DECAY_PREFIXES = ("patch_embed.", "action_embed.", "time_embed.", "text_embed.")


def decays(name: str, param: torch.Tensor) -> bool:
    """Whether weight decay applies to parameter ``name`` (see the module docstring)."""
    name = plain_name(name)
    return param.ndim >= 2 and not name.endswith("modulation") and not name.startswith(NO_DECAY_PREFIXES)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW groups: ``decay`` (weight_decay) and ``no_decay`` (0); each names its parameters."""
    groups = {True: {"name": "decay", "params": [], "names": [], "weight_decay": weight_decay},
              False: {"name": "no_decay", "params": [], "names": [], "weight_decay": 0.0}}
    for name, p in model.named_parameters():
        if p.requires_grad:
            g = groups[decays(name, p)]
            g["params"].append(p)
            g["names"].append(plain_name(name))
    return [g for g in groups.values() if g["params"]]


def optimizer_bytes_per_param(states: str, offload: str) -> tuple[float, float]:
    """(GPU bytes, host bytes) per trained parameter of float32 parameters, their gradients and AdamW's
    states under ``optim.states`` / ``optim.offload`` (large tensors; small ones stay on the GPU in
    float32). Float32 AdamW: 4 parameter + 4 gradient + 8 states on the GPU. Offload keeps the
    parameter and its gradient on the GPU (the gradient only while backward makes it, with
    ``"optimizer+gradients"``) and a float32 parameter copy, a gradient buffer and the states on the host."""
    if states not in STATE_BYTES:
        raise ValueError(f"optim.states must be one of {tuple(STATE_BYTES)}, got {states!r}")
    state = STATE_BYTES[states]
    if offload == "none":
        return 4.0 + 4.0 + state, 0.0
    if offload == "optimizer":
        return 4.0 + 4.0, 4.0 + 4.0 + state
    if offload == "optimizer+gradients":
        return 4.0, 4.0 + 4.0 + state
    raise ValueError(f"optim.offload must be one of ('none', 'optimizer', 'optimizer+gradients'), got {offload!r}")


def _kind(states: str, offload: str) -> str:
    """``AdamW`` or e.g. ``AdamW (torchao AdamW8bit: 8-bit states; offload: optimizer)``."""
    parts = [f"torchao {TORCHAO_CLASS[states]}: {states[:-3]}-bit states"] if states in TORCHAO_CLASS else []
    if offload != "none":
        where = "states, update and gradients" if offload == "optimizer+gradients" else "states and update"
        parts.append(f"offload {offload}: {where} on the host")
    return "AdamW" + (f" ({'; '.join(parts)})" if parts else "")


def describe(groups: list[dict[str, Any]], *, names: bool = False, states: str = "float32",
             offload: str = "none") -> str:
    """One line of counts: tensors and parameters with and without weight decay (no decay at all
    when ``weight_decay`` is 0), naming the optimizer, its ``states`` and ``offload`` where not the
    defaults. ``names``: one more line per group listing its parameter names, block indices folded
    (``blocks.*``)."""
    parts = {g["name"]: (len(g["params"]), sum(p.numel() for p in g["params"]), g["weight_decay"]) for g in groups}
    total = sum(n for _, n, _ in parts.values()), sum(c for c, _, _ in parts.values())
    decay = parts.get("decay")
    if decay is None or decay[2] == 0:
        line = f"optim: {_kind(states, offload)}, no weight decay ({total[1]} tensors, {total[0]:,} parameters)"
    else:
        rest = parts.get("no_decay", (0, 0, 0.0))
        line = (f"optim: {_kind(states, offload)}, weight_decay={decay[2]} on {decay[0]} tensors "
                f"({decay[1]:,} parameters), "
                f"none on {rest[0]} (norms, biases, modulation, embeddings: {rest[1]:,} parameters)")
    if not names:
        return line
    lines = [line]
    for g in groups:
        folded = list(dict.fromkeys(re.sub(r"^blocks\.\d+\.", "blocks.*.", n) for n in g["names"]))
        lines.append(f"optim group {g['name']} (weight_decay={g['weight_decay']}): {', '.join(folded)}")
    return "\n".join(lines)


def check(cfg: OptimConfig, device: torch.device, world_size: int) -> None:
    """At the start of a run, before data and model: torchao importable where ``optim.states`` or
    ``optim.offload`` need it, and offload on one CUDA device without clipping (torchao's
    ``CPUOffloadOptimizer`` asserts a CUDA or XPU device, is written for single-GPU training and copies
    gradients before they could be clipped). Called on the config as given and again as planned
    (``memory.budget_gb`` may choose states and offload)."""
    if cfg.states == "float32" and cfg.offload == "none":
        return
    if cfg.states == "float32" and world_size > 1 and cfg.offload == "optimizer+gradients":
        return  # FSDP2's own host offload: no torchao
    if world_size > 1 and cfg.offload == "optimizer":
        raise UserError(f"optim.offload='optimizer' is single-GPU only (torchao's CPUOffloadOptimizer); this run has "
                        f"{world_size} ranks, where FSDP2 keeps the shards, their gradients and the optimizer step "
                        "on the host together: set optim.offload='optimizer+gradients' (or 'none')")
    _torchao_optim(cfg)
    if world_size > 1:  # FSDP2's CPUOffloadPolicy: any device, clipping as usual
        return
    if cfg.offload != "none" and device.type != "cuda":
        raise UserError(f"optim.offload={cfg.offload!r} needs a CUDA device (torchao's CPUOffloadOptimizer moves "
                        f"states and updates between a GPU and the host); this run's device is {device.type}: "
                        "set optim.offload='none'")
    if cfg.offload != "none" and cfg.grad_clip > 0:
        raise UserError(f"optim.offload={cfg.offload!r} copies gradients to the host during backward, before "
                        f"clipping (torchao's CPUOffloadOptimizer cannot clip): set optim.grad_clip=0 (now "
                        f"{cfg.grad_clip}) or optim.offload='none'")


def _torchao_optim(cfg: OptimConfig) -> Any:
    try:
        import torchao.optim as ao
    except ImportError:
        what = f"optim.states={cfg.states!r}" if cfg.states != "float32" else f"optim.offload={cfg.offload!r}"
        raise UserError(f"{what} needs torchao: pip install 'flexpack[float8]' (or torchao matching your "
                        "torch)") from None
    return ao


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's learning rate; torchao's low-bit AdamW holds it as a tensor, changed in place."""
    for group in opt.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def build_optimizer(model: nn.Module, cfg: OptimConfig, *, log: bool = False,
                    fused: bool = False) -> torch.optim.Optimizer:
    """AdamW over :func:`param_groups` from an ``OptimConfig`` (``optim.states``: torch's or torchao's
    low-bit one; ``optim.offload``: wrapped in torchao's ``CPUOffloadOptimizer``); ``log`` prints the
    groups once; ``fused``: the fused CUDA kernel of torch's AdamW (one launch per step)."""
    groups = param_groups(model, cfg.weight_decay)
    if log:
        print(describe(groups, states=cfg.states, offload=cfg.offload), flush=True)
    for g in groups:  # AdamW's groups hold parameters and hyperparameters only
        del g["names"], g["name"]
    kw: dict[str, Any] = {"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    if cfg.states == "float32" and (cfg.offload == "none" or is_sharded(model)):
        return torch.optim.AdamW(groups, fused=fused and cfg.offload == "none", **kw)
    ao = _torchao_optim(cfg)
    cls = getattr(ao, TORCHAO_CLASS[cfg.states]) if cfg.states in TORCHAO_CLASS else torch.optim.AdamW
    if cfg.offload == "none" or is_sharded(model):  # under FSDP2 the shards are on the host already
        return cls(groups, **kw)
    return ao.CPUOffloadOptimizer(groups, cls, offload_gradients=cfg.offload == "optimizer+gradients", **kw)
