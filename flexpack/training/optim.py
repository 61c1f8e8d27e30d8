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
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flexpack.parallel.parallelize import plain_name

if TYPE_CHECKING:
    from flexpack.run.config import OptimConfig

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


def describe(groups: list[dict[str, Any]], *, names: bool = False) -> str:
    """One line of counts: tensors and parameters with and without weight decay (no decay at all
    when ``weight_decay`` is 0). ``names``: one more line per group listing its parameter names,
    block indices folded (``blocks.*``)."""
    parts = {g["name"]: (len(g["params"]), sum(p.numel() for p in g["params"]), g["weight_decay"]) for g in groups}
    total = sum(n for _, n, _ in parts.values()), sum(c for c, _, _ in parts.values())
    decay = parts.get("decay")
    if decay is None or decay[2] == 0:
        line = f"optim: AdamW, no weight decay ({total[1]} tensors, {total[0]:,} parameters)"
    else:
        rest = parts.get("no_decay", (0, 0, 0.0))
        line = (f"optim: AdamW, weight_decay={decay[2]} on {decay[0]} tensors ({decay[1]:,} parameters), "
                f"none on {rest[0]} (norms, biases, modulation, embeddings: {rest[1]:,} parameters)")
    if not names:
        return line
    lines = [line]
    for g in groups:
        folded = list(dict.fromkeys(re.sub(r"^blocks\.\d+\.", "blocks.*.", n) for n in g["names"]))
        lines.append(f"optim group {g['name']} (weight_decay={g['weight_decay']}): {', '.join(folded)}")
    return "\n".join(lines)


def build_optimizer(model: nn.Module, cfg: OptimConfig, *, log: bool = False,
                    fused: bool = False) -> torch.optim.Optimizer:
    """AdamW over :func:`param_groups` from an ``OptimConfig``; ``log`` prints the groups once;
    ``fused``: the fused CUDA kernel (one launch per step)."""
    groups = param_groups(model, cfg.weight_decay)
    if log:
        print(describe(groups), flush=True)
    for g in groups:  # AdamW's groups hold parameters and hyperparameters only
        del g["names"], g["name"]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                             fused=fused)
