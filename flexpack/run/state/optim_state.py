"""The optimizer's part of a checkpoint, keyed by parameter name whatever the optimizer.

- torch's AdamW and torchao's low-bit ``AdamW8bit`` / ``AdamW4bit`` (``optim.states``): DCP's own
  ``get_state_dict`` / ``set_state_dict``. torchao's moments are tensor subclasses (``OptimState8bit``,
  ``OptimState4bit``) that DCP saves and loads as they are; the 8-bit ones also re-shard (they can be
  sliced along dim 0 at block boundaries), so an 8-bit checkpoint of N ranks loads into M.
- torchao's ``CPUOffloadOptimizer`` (``optim.offload``) is no optimizer over the model's parameters: it
  holds one host optimizer per large parameter, over a pinned host copy of it, and one on-device
  optimizer for the small ones. :func:`offload_state` names each parameter's state by the model's
  parameter name (``{"state": {name: {"step", "exp_avg", "exp_avg_sq"}}}``, the live tensors, which
  DCP loads in place), and :func:`load_offload_state` first copies the loaded weights into the host
  copies (made when the optimizer was built, before the checkpoint's weights were loaded).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flexpack.parallel.parallelize import plain_name


def is_offloaded(optimizer: Any) -> bool:
    """Whether ``optimizer`` is torchao's ``CPUOffloadOptimizer`` (told by what it holds, torchao unimported)."""
    return hasattr(optimizer, "param_d2h_map") and hasattr(optimizer, "optim_dict")


def _owners(model: nn.Module, optimizer: Any) -> dict[str, tuple[torch.optim.Optimizer, torch.Tensor]]:
    """Parameter name → (the optimizer that updates it, the tensor its state is keyed by)."""
    groups = optimizer.d_opt.param_groups if optimizer.d_opt is not None else ()
    on_device = {id(p) for g in groups for p in g["params"]}
    out = {}
    for name, p in model.named_parameters():
        if p in optimizer.param_d2h_map:
            out[plain_name(name)] = (optimizer.optim_dict[p], optimizer.param_d2h_map[p])
        elif id(p) in on_device:
            out[plain_name(name)] = (optimizer.d_opt, p)
    return out


def _init_state(opt: torch.optim.Optimizer) -> None:
    """Create ``opt``'s states as its first step would, without changing a parameter: one step with
    zero gradients at learning rate 0 (what DCP's ``get_state_dict`` does for a torch optimizer)."""
    if opt.state:
        return
    params = [p for g in opt.param_groups for p in g["params"]]
    grads, lrs = [p.grad for p in params], [g["lr"] for g in opt.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in opt.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    for p, grad in zip(params, grads):
        p.grad = grad


def offload_state(model: nn.Module, optimizer: Any, names: set[str] | None = None) -> dict[str, Any]:
    """``{"state": {name: its state}}`` of a ``CPUOffloadOptimizer``: the parameters that have one
    (``names`` None, to save), or those of ``names`` (to load into: their states are created first)."""
    state = {}
    for name, (opt, key) in _owners(model, optimizer).items():
        if names is not None and name in names:
            _init_state(opt)
        if (names is None or name in names) and opt.state.get(key):
            state[name] = opt.state[key]
    return {"state": state}


def load_offload_state(model: nn.Module, optimizer: Any, loaded: dict[str, Any]) -> None:
    """After the model's weights are loaded: refresh the host copies of the parameters from them, and
    put ``loaded`` (from :func:`offload_state`, filled by DCP) into the optimizer's states."""
    with torch.no_grad():
        for p_device, p_host in optimizer.param_d2h_map.items():
            p_host.copy_(p_device.detach())
    owners = _owners(model, optimizer)
    for name, values in loaded["state"].items():
        opt, key = owners[name]
        live = opt.state[key]
        for k, v in values.items():
            if live[k] is not v:  # DCP loads in place; a value it replaced is copied in
                live[k].copy_(v)
