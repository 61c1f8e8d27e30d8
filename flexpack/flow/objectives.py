"""The objectives model families train with, by name (``ModelFamily.objective``).

An objective turns a collated batch into model inputs and targets (:meth:`Objective.sample`, noise keyed
per episode by ``seeds`` from :func:`flexpack.flow.noise.noise_seeds`), scores the model's prediction
(:meth:`Objective.loss`, a :class:`~flexpack.flow.objective.FlowLoss`) and says, before any forward, how
much of a batch counts (:meth:`Objective.counts`, summed over micro-batches for exact accumulation). The
step, validation and ``flexpack verify`` call these three and nothing else, whatever the family:

- ``"flow"`` (:class:`FlowObjective`): flexpack's flow matching (:mod:`flexpack.flow.objective`), from
  the ``objective`` config section;
- ``"lingbot"`` (:class:`LingbotObjective`): LeRobot ``lingbot_va``'s (:mod:`flexpack.flow.lingbot`), from
  the family's config, the two loss parts weighted by ``objective.latent_weight`` / ``action_weight``.

A sample's ``model_kwargs()`` and its ``chunk_size`` / ``window`` (None, or one per episode) are what the
model call takes besides the run's forward options (:class:`~flexpack.run.root.ForwardOptions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from torch import Tensor

from flexpack.flow.lingbot import (
    LingbotObjectiveConfig,
    lingbot_draws,
    lingbot_loss,
    lingbot_loss_counts,
    lingbot_sample,
)
from flexpack.flow.noise import episode_flow_sample
from flexpack.flow.objective import FlowLoss, FlowMatchingConfig, flow_loss, loss_counts


class Objective(Protocol):
    """What the step, validation and verify ask of an objective (see the module docstring)."""

    latent_weight: float
    action_weight: float

    def sample(self, batch: Any, seeds: Sequence[int]) -> Any: ...

    def loss(self, pred: Any, sample: Any, batch: Any) -> FlowLoss: ...

    def counts(self, batch: Any) -> tuple[Tensor, Tensor]: ...


@dataclass(frozen=True)
class FlowObjective:
    """flexpack's flow matching over the ``objective`` config section."""

    cfg: FlowMatchingConfig

    @property
    def latent_weight(self) -> float:
        return self.cfg.latent_weight

    @property
    def action_weight(self) -> float:
        return self.cfg.action_weight

    def sample(self, batch: Any, seeds: Sequence[int]) -> Any:
        return episode_flow_sample(batch, self.cfg, seeds)

    def loss(self, pred: Any, sample: Any, batch: Any) -> FlowLoss:
        return flow_loss(pred, sample, batch, self.cfg)

    def counts(self, batch: Any) -> tuple[Tensor, Tensor]:
        return loss_counts(batch)


@dataclass(frozen=True)
class LingbotObjective:
    """LeRobot ``lingbot_va``'s objective per episode, its fields from the family's config."""

    cfg: LingbotObjectiveConfig
    latent_weight: float = 1.0
    action_weight: float = 1.0

    def sample(self, batch: Any, seeds: Sequence[int]) -> Any:
        return lingbot_sample(batch, self.cfg, lingbot_draws(batch, self.cfg, seeds))

    def loss(self, pred: Any, sample: Any, batch: Any) -> FlowLoss:
        return lingbot_loss(pred, sample, batch, latent_weight=self.latent_weight, action_weight=self.action_weight)

    def counts(self, batch: Any) -> tuple[Tensor, Tensor]:
        return lingbot_loss_counts(batch)


# objective name -> (objective config section, the family's resolved model config) -> Objective
OBJECTIVES: dict[str, Callable[[FlowMatchingConfig, Any], Objective]] = {
    "flow": lambda objective, model: FlowObjective(objective),
    "lingbot": lambda objective, model: LingbotObjective(model, objective.latent_weight, objective.action_weight),
}


def objective_for(name: str, objective: FlowMatchingConfig, model: Any) -> Objective:
    """The objective ``name`` (a family's ``objective``) over the config's ``objective`` section and the
    resolved model config."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; known: {sorted(OBJECTIVES)}")
    return OBJECTIVES[name](objective, model)


def as_objective(cfg: FlowMatchingConfig | Objective) -> Objective:
    """``cfg`` as an objective: a :class:`FlowMatchingConfig` becomes its :class:`FlowObjective`."""
    return FlowObjective(cfg) if isinstance(cfg, FlowMatchingConfig) else cfg
