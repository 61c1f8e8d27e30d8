"""``flexpack verify CONFIG``: packed ≡ per-episode, for outputs, loss and gradients.

For each micro-batch checked, the model (same weights) runs twice:

- **batched**: the micro-batch as the config's collate builds it (pack: episodes back to back in
  one row; pad: one padded row per episode);
- **alone**: every episode as its own unpadded micro-batch.

Both paths see identical x_t: σ and noise are drawn per episode from a generator seeded by the
episode alone (:func:`flexpack.training.noise.episode_flow_sample`). Compared, per episode: the model's
video and action predictions, and the episode's loss; for the micro-batch: the total loss
(batched ``FlowLoss.loss`` vs Σ ``accumulation_loss`` of the episodes alone) and every parameter
gradient. Errors are ``max |a − b| / max |b|``; anything above ``tol`` fails (exit status 1).

``drop_packing=True`` reproduces the bug this guards against (DeepSeek-V3's post-mortem: packing
metadata silently dropped at the model boundary): the model gets a layout whose doc ids are all
0, so attention crosses episodes and padding; the check must then fail.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from flexpack.packing.collate import Batch, PackCollate
from flexpack.training.noise import episode_flow_sample, episode_seed
from flexpack.training.objective import FlowMatchingConfig, flow_loss, loss_counts

TOL = 1e-4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12))


@dataclass
class EpisodeRow:
    episode: int
    frames: int
    video_err: float
    action_err: float
    loss_batched: float
    loss_alone: float

    @property
    def loss_err(self) -> float:
        return abs(self.loss_batched - self.loss_alone) / max(abs(self.loss_alone), 1e-12)


@dataclass
class VerifyReport:
    rows: list[EpisodeRow] = field(default_factory=list)
    loss_batched: list[float] = field(default_factory=list)  # per micro-batch
    loss_alone: list[float] = field(default_factory=list)
    grad_err: list[float] = field(default_factory=list)
    tol: float = TOL

    @property
    def max_err(self) -> float:
        errs = [max(r.video_err, r.action_err, r.loss_err) for r in self.rows] + self.grad_err
        errs += [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(self.loss_batched, self.loss_alone)]
        return max(errs, default=0.0)

    @property
    def ok(self) -> bool:
        return self.max_err <= self.tol

    def table(self) -> str:
        lines = [f"{'episode':>8} {'frames':>6} {'video err':>10} {'action err':>10} {'loss batched':>13} {'loss alone':>11} {'loss err':>9}"]
        for r in self.rows:
            lines.append(f"{r.episode:>8} {r.frames:>6} {r.video_err:>10.2e} {r.action_err:>10.2e} "
                         f"{r.loss_batched:>13.6f} {r.loss_alone:>11.6f} {r.loss_err:>9.2e}")
        for i, (a, b, g) in enumerate(zip(self.loss_batched, self.loss_alone, self.grad_err)):
            lines.append(f"micro-batch {i}: loss batched {a:.6f} vs accumulated alone {b:.6f}; max grad rel err {g:.2e}")
        verdict = "OK" if self.ok else "MISMATCH"
        lines.append(f"{verdict}: max rel err {self.max_err:.2e} (tolerance {self.tol:.0e})")
        return "\n".join(lines)


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])


def verify_batch(
    model: nn.Module,
    items: Sequence[dict],
    collate: Any,
    cfg: FlowMatchingConfig,
    *,
    seed: int = 0,
    model_kwargs: dict[str, Any] | None = None,
    drop_packing: bool = False,
    report: VerifyReport | None = None,
) -> VerifyReport:
    """Check one micro-batch of ``items`` (dataset items) collated by ``collate``; appends to ``report``."""
    report = report or VerifyReport()
    kw = model_kwargs or {}
    keys = [(int(it.get("episode_index", i)), int(it.get("segment", -1))) for i, it in enumerate(items)]
    seeds = [episode_seed(seed, e, s + 1) for e, s in keys]

    # batched path
    model.zero_grad(set_to_none=True)
    batch: Batch = collate(items)
    sample = episode_flow_sample(batch, cfg, seeds)
    layout = batch.layout
    if drop_packing:  # the bug: every frame in episode 0, padding included
        layout = replace(layout, frame_doc=torch.zeros_like(layout.frame_doc))
    pred = model(sample.inputs, layout, **sample.model_kwargs(), **kw)
    full = flow_loss(pred, sample, batch, cfg)
    full.loss.backward()
    g_batched = _grads(model)

    # alone: each episode its own micro-batch, accumulated with the exact weighting
    model.zero_grad(set_to_none=True)
    singles = [PackCollate(int(it["latent"].shape[1]))([it]) for it in items]
    counts = [loss_counts(b) for b in singles]
    totals = (float(sum(c[0] for c in counts)), float(sum(c[1] for c in counts)))
    rows, starts = layout.episode_row.tolist(), layout.episode_start.tolist()
    accumulated = 0.0
    for e, (single, s_seed) in enumerate(zip(singles, seeds)):
        s_sample = episode_flow_sample(single, cfg, [s_seed])
        s_pred = model(s_sample.inputs, **s_sample.model_kwargs(), **kw)
        part = flow_loss(s_pred, s_sample, single, cfg)
        share = part.accumulation_loss(totals)
        share.backward()
        accumulated += float(share.detach())
        # the batched prediction of this episode, cut out of its row
        r, s0, n = rows[e], starts[e], single.layout.frame_doc.shape[1]
        video = pred.video[r : r + 1, :, s0 : s0 + n].detach()
        action = None if pred.action is None else pred.action[r : r + 1, :, s0 : s0 + n].detach()
        cut = flow_loss(type(pred)(video=video, action=action), s_sample, single, cfg)
        report.rows.append(EpisodeRow(
            episode=keys[e][0], frames=n, video_err=_rel(video, s_pred.video.detach()),
            action_err=0.0 if action is None else _rel(action, s_pred.action.detach()),
            loss_batched=float(cut.loss), loss_alone=float(part.loss.detach()),
        ))
    report.grad_err.append(_rel(g_batched, _grads(model)))
    report.loss_batched.append(float(full.loss.detach()))
    report.loss_alone.append(accumulated)
    model.zero_grad(set_to_none=True)
    return report


def verify_config(cfg: Any, *, micro_batches: int = 2, checkpoint_dir: str | None = None, tol: float = TOL,
                  drop_packing: bool = False) -> VerifyReport:
    """Verify the first ``micro_batches`` micro-batches of the config's sampler (epoch 0, rank 0)."""
    from flexpack.training import checkpoint
    from flexpack.training.build import build_data, build_model, model_kwargs

    data = build_data(cfg)
    model = build_model(cfg)
    if checkpoint_dir:
        from flexpack.training.export_io import pick_checkpoint  # says which one and why a newer one was skipped

        found = pick_checkpoint(Path(checkpoint_dir), "verify")
        state = checkpoint.load(found, model, restore_rng=False)
        print(f"verify: checkpoint {found} (step {state['step']})", file=sys.stderr)
    report = VerifyReport(tol=tol)
    for i, indices in enumerate(data.sampler):
        if i >= micro_batches:
            break
        items = [data.dataset[j] for j in indices]
        if not cfg.model.wan_config().action_channels:  # a video-only model gets no actions
            items = [{k: v for k, v in it.items() if k not in ("action", "action_mask")} for it in items]
        verify_batch(model, items, data.collate, cfg.objective, seed=cfg.runtime.seed,
                     model_kwargs=model_kwargs(cfg), drop_packing=drop_packing, report=report)
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="TOML or JSON training config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value (repeatable)")
    parser.add_argument("--checkpoint", default=None,
                        help="weights: a checkpoint folder or a run folder (its newest checkpoint); default: fresh init")
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches of the sampler to check")
    parser.add_argument("--tol", type=float, default=TOL, help="max relative error")
    parser.add_argument("--drop-packing", action="store_true",
                        help="feed the model a layout with all doc ids 0 (the bug this check catches); must fail")


def run(args: argparse.Namespace) -> int:
    from flexpack.training.config import load_config

    if args.micro_batches < 1:
        raise ValueError(f"--micro-batches must be >= 1, got {args.micro_batches}")
    if not (math.isfinite(args.tol) and args.tol > 0):  # tol <= 0 would call a correct model a MISMATCH
        raise ValueError(f"--tol must be a finite number > 0 (a max relative error, default {TOL:g}), got {args.tol!r}")
    cfg = load_config(args.config, args.overrides)
    report = verify_config(cfg, micro_batches=args.micro_batches, checkpoint_dir=args.checkpoint, tol=args.tol,
                           drop_packing=args.drop_packing)
    print(report.table())
    return 0 if report.ok else 1
