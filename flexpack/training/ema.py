"""Exponential moving average of the weights (``optim.ema_decay``; 0 = off).

``ema ← decay·ema + (1 − decay)·w`` after every optimizer step, in float32, starting from the
weights the run starts from (a fresh init, ``model.pretrained`` or a resumed checkpoint without
EMA). FSDP-safe: under FSDP2 the parameters are DTensors sharded on dim 0 and the average is kept
per rank on the local shards only (one fused ``_foreach_lerp_``, no communication); the shadow
tensors are DTensors with the parameters' placements, so they save and load like the model.

Checkpoints carry it in their sharded state next to the model (``ema.<name>``; each rank writes
its shards, :func:`flexpack.run.state.checkpoint.read_ema` reads full tensors back):
:meth:`state_dict` gives the local shards, :meth:`full_state_dict` gathers (collective),
:meth:`load_state_dict` takes full tensors (each rank keeps its slice) or DTensors.
"""

from __future__ import annotations

import torch
from torch import nn

from flexpack.parallel.parallelize import plain_name


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class EMA:
    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"optim.ema_decay must be in (0, 1) (0 = off), got {decay!r}")
        self.decay = decay
        named = [(plain_name(n), p) for n, p in model.named_parameters()]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shadow: list[torch.Tensor] = []
        self.reset()

    @torch.no_grad()
    def reset(self) -> None:
        """Restart the average at the current weights."""
        self.shadow = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        shadow, params = [_local(s) for s in self.shadow], [_local(p).float() for p in self.params]
        torch._foreach_lerp_(shadow, params, 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averages by parameter name (DTensors under FSDP2: this rank's shards)."""
        return dict(zip(self.names, self.shadow))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full CPU tensors by name; collective under FSDP2 (every rank must call it)."""
        return {n: (s.full_tensor() if hasattr(s, "full_tensor") else s).detach().cpu()
                for n, s in zip(self.names, self.shadow)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor] | None) -> None:
        """Load averages (full tensors or DTensors by name); None restarts at the current weights
        (a checkpoint written without EMA)."""
        if state is None:
            self.reset()
            return
        missing = sorted(set(self.names) - set(state))
        if missing:
            raise ValueError(f"EMA state lacks {missing[:8]}")
        from torch.distributed.tensor import DTensor, distribute_tensor

        for name, s in zip(self.names, self.shadow):
            value = state[name]
            if isinstance(s, DTensor) and not isinstance(value, DTensor):
                value = distribute_tensor(value.to(s.device, s.dtype), s.device_mesh, s.placements, src_data_rank=None)
            if tuple(value.shape) != tuple(s.shape):
                raise ValueError(f"EMA weight {name!r} has shape {tuple(value.shape)}, the model {tuple(s.shape)}")
            _local(s).copy_(_local(value))


def make_ema(model: nn.Module, decay: float) -> EMA | None:
    """An EMA of ``model``'s parameters, or None when ``decay`` is 0."""
    return EMA(model, decay) if decay else None
