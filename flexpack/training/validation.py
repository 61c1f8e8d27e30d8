"""Held-out episodes and the validation loss.

Split. ``data.val_episodes`` (episode indices) and ``data.val_fraction`` (a share of all
episodes) hold whole episodes, with all their segments, out of training. The fraction picks the
episodes with the smallest ``episode_seed(data.seed, VAL_TAG, episode)``: a pure function of the
dataset's episode list and the config, so every rank (and every rerun) holds out the same ones
without communicating, and adding episodes to a dataset moves few of them.

Loss. Every ``validation.every`` steps :class:`Validator` runs the model without gradients over
every held-out item once and logs ``val_loss`` and ``val_<part>`` for every loss part the objective gives
(``val_latent_loss``, ``val_action_loss``, any part it adds; the training objective, the run's: sums over all
items divided by all counts, so the result does not depend on batching or rank count; ``val_loss`` weights
the parts as the loss does) to ``metrics.jsonl``. σ and noise are drawn per item from
``(VAL_TAG, episode, segment)`` alone — not from the step or the run seed — so the numbers are
comparable across steps and across runs. The held-out episodes have their own plan, the ``"val"``
:class:`~flexpack.run.root.Run` composed from the training one (``compose(cfg, "val", parent=run)``: the held-out
split's items without text dropout; the training run's frame budget packs them, its forward options and autocast
rule run the model). Items are dealt to ranks round-robin and packed in order;
ranks with fewer micro-batches run a discarded one so FSDP's collectives stay matched.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from flexpack.flow.noise import noise_seeds
from flexpack.packing.geometry import TokenGeometry
from flexpack.run.compose import compose
from flexpack.run.holdout import VAL_TAG
from flexpack.run.hooks import HookContext, HookReport
from flexpack.run.root import Run

if TYPE_CHECKING:
    from flexpack.run.config import DataConfig


def _micro_batches(
    lengths: Sequence[int], indices: Sequence[int], data_cfg: DataConfig, geometry: TokenGeometry
) -> list[list[int]]:
    """This rank's items grouped like the training collate wants them: packed in order up to the
    plan's frame budget (pack mode) or ``batch_size`` at a time (pad mode)."""
    if data_cfg.mode == "pad":
        return [list(indices[i : i + data_cfg.batch_size]) for i in range(0, len(indices), data_cfg.batch_size)]
    budget, out, used = geometry.frame_budget, [], 0
    for i in indices:
        n = geometry.fitted(lengths[i])  # longer only with data.crop: the run's sampler rejects them otherwise
        if not out or used + n > budget:
            out.append([])
            used = 0
        out[-1].append(i)
        used += n
    return out


class Validator:
    """The validation loss of a run's held-out episodes (see the module docstring)."""

    def __init__(self, run: Run) -> None:
        rank, size = run.rank, run.world_size
        # the held-out episodes (the run's split) with the training run's geometry, model, device and autocast
        self.run = compose(run.config, "val", parent=run)
        held = self.run.dataset
        # the model's own text-slot count per call, as validation has always run
        self.forward = replace(self.run.forward, text_slots=None)
        lengths = held.lengths()
        mine = list(range(rank, len(held), size))
        self.batches = _micro_batches(lengths, mine, run.config.data, run.geometry)
        count = torch.tensor([len(self.batches)])
        if size > 1:
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
        self.rounds = int(count)
        self.filler = self.batches[0] if self.batches else [0]  # run and discarded: keeps ranks in lockstep

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        run = self.run
        ds = run.dataset
        names: list[str] = []  # the loss parts, by name, in the objective's order
        weights: dict[str, float | None] = {}
        sums = torch.zeros(0, 2, dtype=torch.float64)  # per part: sum, count
        for j in range(self.rounds):
            real = j < len(self.batches)
            batch = run.collate([ds[i] for i in (self.batches[j] if real else self.filler)])
            seeds = noise_seeds(batch.layout, VAL_TAG)
            batch = batch.to(run.device)
            sample = run.objective.sample(batch, seeds)
            with run.autocast():  # as in training
                pred = self.forward(model, sample)
            parts = run.objective.loss(pred, sample, batch).parts()
            if not names:
                names, weights = list(parts), {n: p.weight for n, p in parts.items()}
                sums = torch.zeros(len(names), 2, dtype=torch.float64)
            if real:
                sums += torch.stack([torch.stack([parts[n].sum, parts[n].count]) for n in names]).double().cpu()
        if run.world_size > 1:
            dist.all_reduce(sums)
        means = {n: float(sums[i, 0] / sums[i, 1].clamp(min=1)) for i, n in enumerate(names)}
        loss = 0.0
        for n, w in weights.items():
            if w is not None:
                loss += w * means[n]
        return {"val_loss": loss, **{f"val_{n}": m for n, m in means.items()}}

    def after_step(self, model: nn.Module, step: int, *, ema: Any = None) -> HookReport | None:
        """Every ``validation.every`` steps: evaluate (collective) and report the losses."""
        if step % self.run.config.validation.every:
            return None
        return HookReport(row={"step": step, **self.evaluate(model)})


def make_validator(ctx: HookContext) -> Validator | None:
    """A Validator when ``validation.every`` > 0 (the config then holds episodes out), else None
    (a :data:`~flexpack.run.hooks.HookFactory`)."""
    return Validator(ctx.run) if ctx.run.config.validation.every else None
