"""``sample.every``: sample fixed held-out episodes during training.

Every ``sample.every`` optimizer steps the model (the weights being trained, or with
``sample.ema`` their EMA) forecasts the first ``sample.episodes`` held-out episodes
at ``sample.cuts`` cut points each with ``sample.steps`` Euler steps, from noise
fixed per (episode, cut) pair (:mod:`flexpack.sampling.pairs`), ``sample.draws`` samples
each, cut points with at least ``sample.min_context`` latent frames of context: the numbers
are comparable across steps, across runs of the same config and across a resume. Files go to
``RUN/samples/step_NNNNNNNN/`` (the same as ``flexpack sample``); ``sample/action_mse``,
``sample/action_mse_kmean``, ``sample/action_crps``, ``sample/latent_mse``, the baselines'
``sample/last/action_mse`` ... form the hook's report, which the train loop writes to
``metrics.jsonl`` and logs to TensorBoard / W&B with the plots (:mod:`flexpack.run.hooks`). Under
several ranks every rank samples its share of the packs (collective, like validation) and rank 0
writes the files.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from flexpack.data.normalization import ActionStats
from flexpack.run.compose import compose
from flexpack.run.hooks import HookContext, HookReport
from flexpack.run.root import Run
from flexpack.sampling.evaluate import PairPlan, build_pairs, evaluate

KEYS = ("action_mse", "action_mse_kmean", "action_crps", "action_l1", "action_mse_raw", "action_l1_raw", "latent_mse",
        "latent_mse_kmean", "latent_crps")


class SampleHook:
    """Samples the training run's first ``sample.episodes`` held-out episodes (``run``: the training
    :class:`~flexpack.run.root.Run`; its sampling run is composed from it, sharing its model config, device, ranks,
    split and autocast rule)."""

    def __init__(self, run: Run, *, action_stats: ActionStats | None = None) -> None:
        r = run.config.sample
        self.every, self.ema, self.plots, self.out = r.every, r.ema, r.plots, Path(run.config.runtime.out_dir)
        self.rank, self.action_stats = run.rank, action_stats
        # the run's own held-out episodes, whole, as a "sample" run of the training run
        self.run = compose(run.config, "sample", episodes=run.split.held_out[: r.episodes], parent=run)
        if action_stats is not None:  # the statistics the weights are trained with (kept on resume)
            self.run.dataset.normalizer = action_stats.normalizer()
        self.plan = PairPlan(mode="forecast", cuts=r.cuts, horizon=r.horizon or None,
                             samples=r.draws, min_context=r.min_context)
        try:  # before the first step: held-out episodes too short for the horizon fail now, not mid-run
            build_pairs(self.run, self.plan, note=self.rank == 0)
        except ValueError as exc:
            raise ValueError(f"sample.every={r.every}: {exc} (sample.horizon, "
                             "sample.min_context, data.val_episodes)") from None
        from flexpack.sampling.solver import SampleOptions, solver_steps

        # sample.steps, or a family's own step counts where its sampler takes them from the model config
        self.options = SampleOptions(steps=solver_steps(self.run, None, default=r.steps), solver="euler")

    def after_step(self, model: nn.Module, step: int, *, ema: Any = None) -> HookReport | None:
        """Every ``sample.every`` steps: sample (collective), write the files on rank 0 and report
        the metrics; with ``sample.ema`` the EMA weights stand in for the trained ones meanwhile."""
        if not self.every or step % self.every:
            return None
        out = self.out / "samples" / f"step_{step:08d}"
        with _ema_weights(model, ema if self.ema else None):  # autocast: the run's rule (bf16 on one rank)
            metrics, files = evaluate(model, self.run, self.plan, self.options, action_stats=self.action_stats,
                                      out=out, plots=self.plots, write=self.rank == 0,
                                      note=False)  # the note was said once, at start
        rec: dict[str, Any] = {"step": step, **{f"sample/{k}": metrics[k] for k in KEYS}}
        for name, b in metrics["baselines"].items():
            rec.update({f"sample/{name}/{k}": b[k] for k in KEYS})
        if "psnr" in metrics:
            rec["sample/psnr"] = metrics["psnr"]
        return HookReport(row=rec, images={k: Path(v) for k, v in files.items() if str(v).endswith(".png")})


@contextlib.contextmanager
def _ema_weights(model: nn.Module, ema: Any) -> Iterator[None]:
    """The EMA averages in the model's parameters (each rank its local shards), restored after."""
    if ema is None:
        yield
        return
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    with torch.no_grad():
        saved = [local(p).detach().clone() for p in ema.params]
        for p, s in zip(ema.params, ema.shadow):
            local(p).copy_(local(s))
    try:
        yield
    finally:
        with torch.no_grad():
            for p, w in zip(ema.params, saved):
                local(p).copy_(w)


def make_sample_hook(ctx: HookContext) -> SampleHook | None:
    """A SampleHook when ``sample.every`` > 0, else None (a :data:`~flexpack.run.hooks.HookFactory`)."""
    run = ctx.run
    if not run.config.sample.every:
        return None
    return SampleHook(run, action_stats=ctx.action_stats)
