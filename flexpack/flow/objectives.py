"""The objectives model families train with: ``ModelFamily.objective`` holds one's class (None: flow matching).

An objective turns a collated batch into model inputs and targets (:meth:`Objective.sample`, noise keyed
per episode by ``seeds`` from :func:`flexpack.flow.noise.noise_seeds`), scores the model's prediction
(:meth:`Objective.loss`, a :class:`~flexpack.flow.objective.FlowLoss` with its parts by name) and says, before
any forward, how much of a batch counts in each part (:meth:`Objective.counts`, by the same names, summed over
micro-batches for exact accumulation). The
step, validation and ``flexpack verify`` call these three and nothing else, whatever the family. An
objective class is built by ``Class.from_config(objective section, the family's resolved model config)``;
:class:`FlowObjective` is flexpack's flow matching (:mod:`flexpack.flow.objective`) over the ``objective``
config section, the default of every family; a family with an objective of its own gives its class
(:func:`objective_for` builds it).

A sample's ``model_kwargs()`` and its ``chunk_size`` / ``window`` (None, or one per episode) are what the
model call takes besides the run's forward options (:class:`~flexpack.run.root.ForwardOptions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from torch import Tensor

from flexpack.flow.noise import episode_flow_sample
from flexpack.flow.objective import BASE_PARTS, FlowLoss, FlowMatchingConfig, flow_loss, loss_counts


class Objective(Protocol):
    """What the step, validation and verify ask of an objective (see the module docstring)."""

    latent_weight: float
    action_weight: float

    def sample(self, batch: Any, seeds: Sequence[int]) -> Any: ...

    def loss(self, pred: Any, sample: Any, batch: Any) -> FlowLoss: ...

    def counts(self, batch: Any) -> dict[str, Tensor]:
        """Elements of ``batch`` that count in each part of its loss, by the part's name (``FlowLoss.parts``)."""
        ...

    def attention_pairs(self, layout: Any, geometry: Any, seeds: Sequence[int]) -> list[int] | None:
        """Self-attention (query, key) pairs per episode of a host ``layout`` that the training mask keeps
        under the draws of ``seeds`` (all copies; useful FLOPs), or None: the document mask's n²."""
        ...


@dataclass(frozen=True)
class FlowObjective:
    """flexpack's flow matching over the ``objective`` config section."""

    cfg: FlowMatchingConfig

    @classmethod
    def from_config(cls, objective: FlowMatchingConfig, model: Any) -> "FlowObjective":
        return cls(objective)

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

    def counts(self, batch: Any) -> dict[str, Tensor]:
        return dict(zip(BASE_PARTS, loss_counts(batch)))

    def attention_pairs(self, layout: Any, geometry: Any, seeds: Sequence[int]) -> None:
        return None  # the document mask's count (an upper bound for the chunk masks: observe/flops.py)


def objective_for(cls: Any, objective: FlowMatchingConfig, model: Any) -> Objective:
    """The objective of class ``cls`` (a family's ``objective``; None: :class:`FlowObjective`) over the config's
    ``objective`` section and the resolved model config."""
    return (FlowObjective if cls is None else cls).from_config(objective, model)


def as_objective(cfg: FlowMatchingConfig | Objective) -> Objective:
    """``cfg`` as an objective: a :class:`FlowMatchingConfig` becomes its :class:`FlowObjective`."""
    return FlowObjective(cfg) if isinstance(cfg, FlowMatchingConfig) else cfg
