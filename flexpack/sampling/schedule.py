"""The σ grid and the ODE solvers of flow-matching sampling.

The model predicts the velocity ``v = ε − x`` of ``x_σ = (1 − σ)·x + σ·ε`` (:mod:`flexpack.flow.objective`),
so ``dx/dσ = v`` and sampling integrates from σ = 1 (pure noise) down to σ = 0 (data).

Grid: ``u_i = linspace(1, 0, N + 1)`` and ``σ_i = shift(u_i)`` with the objective's
:func:`~flexpack.flow.objective.shift_sigma` — ``objective.shift`` for video latents and
``objective.action_shift`` for actions (the two streams use the same ``u`` at every step, as in
training where one uniform draw is shifted twice). The model sees timestep ``σ · num_train_timesteps``.

Solvers, for one step from ``σ_i`` to ``σ_{i+1}`` (``Δ = σ_{i+1} − σ_i < 0``):

- ``euler``: ``x ← x + Δ·v(x, σ_i)`` — exactly diffusers' ``FlowMatchEulerDiscreteScheduler.step``;
- ``heun`` (2nd order): ``x' = x + Δ·v₁``, ``x ← x + Δ·(v₁ + v(x', σ_{i+1}))/2``; the last step
  (to σ = 0) is Euler, as the velocity at σ = 0 is not needed (2N − 1 model calls for N steps).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from flexpack.flow.objective import shift_sigma

SOLVERS = ("euler", "heun")


def sigma_grid(steps: int, shift: float) -> Tensor:
    """(steps + 1,) float64 σ from 1 down to 0 on the objective's shifted schedule."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1 (solver steps from noise to data), got {steps!r}")
    if not shift > 0:
        raise ValueError(f"shift must be positive, got {shift!r}")
    return shift_sigma(torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64), shift)


def model_calls(steps: int, solver: str) -> int:
    """Velocity evaluations of one solve."""
    check_solver(solver)
    return steps if solver == "euler" else 2 * steps - 1


def check_solver(solver: str) -> None:
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")


# a velocity field of several streams (video, actions): state tuple + step index -> velocities.
# ``at`` is a grid index; a float index i + 1 means "at σ_{i+1}" (Heun's corrector).
Velocity = Callable[[tuple[Tensor, ...], int], tuple[Tensor, ...]]


def solve(velocity: Velocity, x0: tuple[Tensor, ...], grids: tuple[Tensor, ...], solver: str = "euler",
          keep: tuple[Tensor | None, ...] | None = None) -> tuple[Tensor, ...]:
    """Integrate ``dx/dσ = velocity`` for every stream from ``grids[k][0]`` to ``grids[k][-1]``.

    ``grids[k]`` is stream k's σ grid (``(N + 1,)``, or ``(N + 1, ...)`` broadcasting against the
    stream for per-frame σ: 0 → 0 on frames that are conditioning, which then never change).
    ``keep[k]``: bool mask of stream k's entries that are held fixed (conditioning frames) —
    written back exactly after every step, so context stays bit-identical to its input.
    ``velocity(xs, i)`` evaluates the model with every stream at its ``grids[k][i]``.
    """
    check_solver(solver)
    n = grids[0].shape[0] - 1
    xs = tuple(x0)

    def hold(new: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        if keep is None:
            return new
        return tuple(x if m is None else torch.where(m, x_in, x) for x, x_in, m in zip(new, x0, keep))

    for i in range(n):
        deltas = [(g[i + 1] - g[i]).to(x.dtype) for g, x in zip(grids, xs)]
        v1 = velocity(xs, i)
        pred = hold(tuple(x + d * v for x, d, v in zip(xs, deltas, v1)))
        if solver == "euler" or i == n - 1:
            xs = pred
            continue
        v2 = velocity(pred, i + 1)
        xs = hold(tuple(x + d * (a + b) / 2 for x, d, a, b in zip(xs, deltas, v1, v2)))
    return xs
