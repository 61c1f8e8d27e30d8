"""``flexpack verify CONFIG``: packed ≡ per-episode, for outputs, loss and gradients.

For each micro-batch checked, the model (same weights) runs twice:

- **batched**: the micro-batch as the config's collate builds it (pack: episodes back to back in
  one row; pad: one padded row per episode);
- **alone**: every episode as its own micro-batch (unpadded; with compiled blocks in the run's
  pack shape, so that no episode length compiles a graph of its own).

Both paths see identical x_t: σ and noise (and, where the objective draws them, the mask's chunk size
and window) are drawn per episode from a seed of the episode alone, by the run's objective (the model family's:
:mod:`flexpack.flow.objectives`). Compared, per episode: the model's
video and action predictions, and the episode's loss; for the micro-batch: the total loss
(batched ``FlowLoss.loss`` vs Σ ``accumulation_loss`` of the episodes alone) and the gradients,
per parameter group (the embeddings, each block, the heads). Errors are ``max |a − b| / max |b|``;
anything above its tolerance, or any non-finite gradient, fails (exit status 1).

Micro-batches, collate, forward options and the autocast rule come from the run (``compose(cfg, "verify")``,
:mod:`flexpack.run.compose`), as in training. The model is built as training builds it
(:meth:`~flexpack.run.root.Run.build_model`): on the run's device, blocks compiled where ``parallel.compile``
compiles them, bf16 autocast (one process) or FSDP2 mixed precision (``torchrun``, every rank checks the same
micro-batches) for ``runtime.dtype = "bfloat16"``, the configured attention backend (FA4 or Triton flex on
CUDA). Tolerances depend on that dtype (:data:`TOLERANCES`): float32 paths agree to rounding; bf16 rounds every
activation to 8 bits of mantissa, and a packed row and an episode alone reduce in different orders. With
``parallel.float8`` the blocks' linears run float8 as in training, and a packed row and an episode alone
differ by float8 rounding under different scales too (a tensorwise scale spans the whole pack). The
bf16 tolerances apply and separate both modes from a dropped packing on the H200 (5B width, 2 compiled
blocks, 36 tokens per frame; ``benchmarks/float8_h200.sh``'s ``verify8`` stage): largest error 6.5e-3
tensorwise and 2.1e-2 rowwise against the output tolerance of 3e-2, and 6.1e-2 / 6.3e-2 (gradients
1.7e-1 against 5e-2) with the packing dropped (``BENCHMARKS.md``).

``drop_packing=True`` reproduces the bug this guards against (DeepSeek-V3's post-mortem: packing
metadata silently dropped at the model boundary): the model gets a layout whose doc ids are all
0, so attention crosses episodes and padding; the check must then fail.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from flexpack.errors import UserError
from flexpack.flow.noise import noise_seeds
from flexpack.flow.objective import FlowMatchingConfig
from flexpack.flow.objectives import Objective, as_objective
from flexpack.packing.collate import Batch, PackCollate
from flexpack.run.root import ForwardOptions, Run
from flexpack.tools.verify_report import (  # noqa: F401  (the report's names are verify's public API too)
    TOL,
    TOLERANCES,
    EpisodeRow,
    Tolerance,
    VerifyReport,
    _compare_grads,
    _grads,
    _rel,
    param_group,
)


def _into(frame: torch.Tensor | None, part: torch.Tensor | None) -> torch.Tensor | None:
    """``part`` (1, C, n, ...) written over the first ``n`` frames of a detached copy of ``frame``."""
    if frame is None or part is None:
        return part
    out = frame.detach().clone()
    out[:, :, : part.shape[2]] = part
    return out


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return torch.device("cpu") if p is None else p.device


def verify_batch(
    model: nn.Module,
    items: Sequence[dict],
    collate: Any,
    cfg: FlowMatchingConfig | Objective,
    *,
    seed: int = 0,
    forward: ForwardOptions = ForwardOptions(),
    drop_packing: bool = False,
    report: VerifyReport | None = None,
    autocast: torch.dtype | None = None,
    alone_collate: Any = None,
) -> VerifyReport:
    """Check one micro-batch of ``items`` (dataset items) collated by ``collate``; appends to ``report``.
    ``cfg``: the objective (a run's), or a :class:`FlowMatchingConfig` for flexpack's flow matching.

    Collated batches move to the model's device. ``autocast``: run the forwards under
    ``torch.autocast`` of that dtype (training's bf16 on one process). ``alone_collate``: the
    collate of the per-episode passes (default: exactly the episode's frames as collated, no padding)."""
    report = report or VerifyReport()
    objective = as_objective(cfg)
    device = _device(model)
    amp = (lambda: torch.autocast(device.type, autocast)) if autocast is not None else contextlib.nullcontext

    # batched path
    model.zero_grad(set_to_none=True)
    batch: Batch = collate(items).to(device)
    # noise keyed by (episode, segment) from the layout, as training keys it; the singles' layouts
    # carry the same keys, so both paths draw the same x_t
    seeds = noise_seeds(batch.layout, seed)
    episodes = [e if e >= 0 else slot for slot, e in enumerate(batch.layout.episode_index.tolist())]
    sample = objective.sample(batch, seeds)
    layout = batch.layout
    if drop_packing:  # the bug: every frame in episode 0, padding included
        layout = replace(layout, frame_doc=torch.zeros_like(layout.frame_doc))
    with amp():
        pred = forward(model, sample, layout)
    full = objective.loss(pred, sample, batch)
    full.loss.backward()
    g_batched = _grads(model)

    # alone: each episode its own micro-batch, accumulated with the exact weighting
    model.zero_grad(set_to_none=True)
    rows, starts = layout.episode_row.tolist(), layout.episode_start.tolist()
    frames = batch.layout.episode_frames.tolist()  # as collated: a cropped episode keeps its first frames
    singles = [(alone_collate or PackCollate(n, crop=True))([it]).to(device) for it, n in zip(items, frames)]
    counts = [objective.counts(b) for b in singles]
    totals = {name: float(sum(c[name] for c in counts)) for name in counts[0]}
    accumulated = 0.0
    for e, (single, s_seed) in enumerate(zip(singles, seeds)):
        s_sample = objective.sample(single, [s_seed])
        with amp():
            s_pred = forward(model, s_sample)
        part = objective.loss(s_pred, s_sample, single)
        share = part.accumulation_loss(totals)
        share.backward()
        accumulated += float(share.detach())
        # the batched prediction of this episode, cut out of its row; the single's own frames
        r, s0, n = rows[e], starts[e], frames[e]
        h, w = s_pred.video.shape[-2:]  # the episode's own grid: spatial padding of a run's grid is cut off
        video = pred.video[r : r + 1, :, s0 : s0 + n, :h, :w].detach()
        action = None if pred.action is None else pred.action[r : r + 1, :, s0 : s0 + n].detach()
        s_video = s_pred.video[:, :, :n].detach()
        s_action = None if s_pred.action is None else s_pred.action[:, :, :n].detach()
        # the batched prediction in the single's frames (a padded single: its padding frames are
        # outside the loss), so the episode's loss is computed the same way on both paths
        cut = objective.loss(type(pred)(video=_into(s_pred.video, video), action=_into(s_pred.action, action)),
                             s_sample, single)
        report.rows.append(EpisodeRow(
            episode=episodes[e], frames=n, video_err=_rel(video, s_video),
            action_err=0.0 if action is None else _rel(action, s_action),
            loss_batched=float(cut.loss), loss_alone=float(part.loss.detach()),
        ))
    total, per_group, nonfinite = _compare_grads(g_batched, _grads(model))
    report.grad_err.append(total)
    report.grad_groups.append(per_group)
    report.nonfinite += [n for n in nonfinite if n not in report.nonfinite]
    report.loss_batched.append(float(full.loss.detach()))
    report.loss_alone.append(accumulated)
    model.zero_grad(set_to_none=True)
    return report


def check_backend(run: Run) -> None:
    """An attention backend that cannot run the run's dtype on its device, in one line."""
    from flexpack.attention.flex import has_flash

    backend, dtype, device = run.model_config.attn_backend, run.config.runtime.dtype, run.device
    if backend == "flex-flash" and dtype != "bfloat16":
        raise UserError(f"model.overrides.attn_backend = 'flex-flash' (FA4) takes bfloat16 inputs, but runtime.dtype = "
                        f"{dtype!r}; set runtime.dtype = 'bfloat16' or attn_backend = 'flex'")
    if backend in ("flex", "flex-flash") and device.type == "cpu":
        raise UserError(f"model.overrides.attn_backend = {backend!r} has no CPU backward (FlexAttention); on CPU use "
                        "attn_backend = 'dense' or 'auto'")
    if backend == "flex-flash" and not has_flash():
        raise UserError("model.overrides.attn_backend = 'flex-flash' needs FA4 (flash_attn.cute), "
                        "which is not installed here; install it or use attn_backend = 'flex'")
    if dtype == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError(f"runtime.dtype = 'bfloat16' is not supported by {torch.cuda.get_device_name(device)}; "
                        "set runtime.dtype = 'float32'")


def verify_config(run: Run, *, micro_batches: int = 2, checkpoint_dir: str | None = None,
                  tol: float | None = None, drop_packing: bool = False) -> VerifyReport:
    """Verify the first ``micro_batches`` micro-batches of the run's sampler (epoch 0, rank 0's share: under
    ``torchrun`` every rank checks the same ones, so the sharded model sees the same work on each) with the model
    as training builds it. ``run``: ``compose(cfg, "verify")`` (:mod:`flexpack.run.compose`), or a run over other
    episodes (e.g. :func:`flexpack.run.memory_data.synthetic_run`). ``tol``: one max relative error for all
    quantities (default: :data:`TOLERANCES` of ``runtime.dtype``)."""
    from flexpack.parallel.parallelize import is_sharded, world
    from flexpack.run.cpu_threads import cpu_threads
    from flexpack.run.state import checkpoint

    cfg, device, m = run.config, run.device, run.model_config
    check_backend(run)
    model, compiled = run.build_model(), run.parallel.compile  # as training builds it
    if checkpoint_dir:
        # pick_checkpoint says which one and why a newer one was skipped
        from flexpack.run.state.locate import pick_checkpoint

        found = pick_checkpoint(Path(checkpoint_dir), "verify")
        state = checkpoint.load(found, model, restore_rng=False)  # a checkpoint of another shape: one line
        print(f"verify: checkpoint {found} (step {state['step']})", file=sys.stderr)
    sharded = is_sharded(model)
    bf16 = cfg.runtime.dtype == "bfloat16"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    mode = "FSDP2 mixed precision" if bf16 and sharded else "autocast" if run.autocast_dtype else "no autocast"
    report = VerifyReport(tol=TOLERANCES[cfg.runtime.dtype] if tol is None else Tolerance.uniform(tol), setup=(
        f"{device} ({name}), runtime.dtype {cfg.runtime.dtype} ({mode}), blocks {'compiled' if compiled else 'eager'}, "
        f"attention {m.attn_backend}, float8 {cfg.parallel.float8}, {world()[1]} rank(s)"
        f"{', FSDP2' if sharded else ''}"))
    with cpu_threads(cfg.runtime.cpu_threads, device, model, say=world()[0] == 0):
        for i, indices in enumerate(run.sampler):
            if i >= micro_batches:
                break
            # as the model takes them (a video-only model gets no actions): the per-episode passes collate
            # these items themselves
            items = run.collate.items([run.dataset[j] for j in indices])
            # compiled blocks: the episodes alone in the run's pack shape (one graph), as training would see them;
            # float8: that shape holds a multiple of 16 tokens, which its GEMMs need (float8.check_tokens)
            verify_batch(model, items, run.collate, run.objective, seed=cfg.runtime.seed, forward=run.forward,
                         drop_packing=drop_packing, report=report, autocast=run.autocast_dtype,
                         alone_collate=run.collate if compiled or cfg.parallel.float8 != "off" else None)
    return report
