"""Packed flow-matching sampling conditioned on ground-truth history.

Every (episode, cut point) :class:`~flexpack.sampling.pairs.Pair` is one document of a packed
micro-batch, built by the training path itself: the pairs' frame counts go through
:class:`~flexpack.packing.batch_sampler.TokenBudgetBatchSampler` and :class:`~flexpack.packing.collate.PackCollate`
with the config's ``data.max_tokens`` (one fixed shape for every pack, so compiled blocks never
recompile), and the model runs with the config's mask. A pack is solved from σ = 1 to 0
(:mod:`flexpack.sampling.schedule`) with the model called once (Euler) or twice (Heun) per step.

Conditioning per mask (what training taught the model):

- ``document`` / ``chunk_causal`` with per-frame or per-chunk σ: context frames enter at σ = 0
  (timestep 0) holding the truth at every solver step; target frames (video latents and actions
  together) start from noise and are integrated. Their velocity update is 0 on context frames,
  and context values are written back exactly after each step.
- ``teacher_forcing``: the batch has a noisy and a clean copy. The clean copy holds the history
  (truth, or the frames generated so far); the noisy copy holds the chunk being denoised, which
  attends to the clean copy of earlier chunks only. So targets are generated chunk by chunk
  (``model.chunk_size`` frames per stage), each stage's result becoming clean history for the next.
- one σ per episode (``objective.chunk_size`` unset): the model never saw clean frames next to
  noisy ones, so it can only generate whole episodes jointly: conditioning is refused in one line.

A *stage* generates the next ``stage_frames`` target frames of every unfinished pair at once:
forecast under ``document`` / ``chunk_causal`` is one stage of ``horizon`` frames; a rollout
(cut = the first chunk, horizon = the rest of the episode) runs stage after stage, each conditioned
on the model's own earlier output. A pair's sequence in a stage is its frames ``[0, k + n)``, the
known ones and the ones being generated: under the chunk-causal masks the later frames could not
change the result anyway, under ``document`` they are simply not there yet.

Under several ranks each rank solves its packs (the sampler deals bins so every rank runs the same
number of forwards, keeping FSDP's collectives matched) and the stage's results are summed across
ranks before the next stage.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flexpack.attention.masks import mask_kind, text_slots
from flexpack.packing.batch_sampler import TokenBudgetBatchSampler
from flexpack.packing.collate import PackCollate
from flexpack.packing.geometry import frame_budget, too_long
from flexpack.run.root import Run
from flexpack.sampling.pairs import Pair, pair_noise
from flexpack.sampling.schedule import check_solver, sigma_grid, solve


def context_chunk(run: Run) -> int:
    """Frames that share one σ in training (cut points sit on multiples of it). Raises the one-line
    error for a model trained with one σ per episode, which cannot be conditioned on history."""
    o, m = run.config.objective, run.config.model
    cls = sampler_class(run)  # the family's registry entry says how it samples, where it does
    if cls is not PackedSampler:
        return cls.context_chunk(run)
    if o.chunk_size is None:
        raise ValueError("objective.chunk_size is unset: the model was trained with one σ per episode and can only "
                         "generate whole episodes jointly, not condition on history (train with a per-frame or "
                         "per-chunk σ, objective.chunk_size = 1 or a chunk size)")
    return int(m.chunk_size) if mask_kind(m.mask).chunked else int(o.chunk_size)


def sampler_class(run: Run) -> type["PackedSampler"]:
    """The sampler of the run's model family (its registry entry's ``sampler``): :class:`PackedSampler`
    where it names none, else the class it holds (a subclass, with its ``context_chunk(run)``)."""
    fam = run.family
    if not fam.samples:
        raise ValueError(f"model.family = {run.config.model.family!r} cannot be sampled by flexpack yet")
    return PackedSampler if fam.sampler is None else fam.sampler


def solver_steps(run: Run, given: int | None, *, default: int = 10) -> int:
    """``given`` solver steps (``--steps``; None: ``default``), or where the family's sampler takes its steps
    from the model config (lingbot-va: LeRobot's fields), those; ``given`` there is one line naming the fields."""
    sampler = sampler_class(run)
    if not hasattr(sampler, "config_steps"):
        return default if given is None else given
    if given is not None:
        raise ValueError(f"--steps {given}: model.family = {run.config.model.family!r} samples with its config's "
                         "solver steps (LeRobot's num_inference_steps for the video, action_num_inference_steps for "
                         "the actions); set them with --set model.overrides.num_inference_steps=N")
    return sampler.config_steps(run)


def stage_frames(run: Run, horizon: int) -> int:
    """Target frames generated per stage: one chunk under teacher forcing, else the horizon."""
    m = run.config.model
    return int(m.chunk_size) if mask_kind(m.mask).teacher_forcing else int(horizon)


@dataclass(frozen=True)
class SampleOptions:
    steps: int = 10
    solver: str = "euler"
    # None: the run's autocast rule (Run.autocast: compose's); "bfloat16" / "float32": forced (benchmarks compare)
    dtype: str | None = None

    def autocast(self, run: Run) -> Any:
        """The model calls' autocast context: the run's, unless :attr:`dtype` forces one."""
        if self.dtype is None:
            return run.autocast()
        on = self.dtype == "bfloat16"
        return torch.autocast(run.device.type, torch.bfloat16) if on else contextlib.nullcontext()


class PackedSampler:
    """Solve pairs in packs of ``max_tokens`` tokens with a run's model config, mask, geometry and schedule.

    ``run``: a ``"sample"`` run (:func:`flexpack.run.compose.compose`): its geometry (tokens per frame, the pack's
    token budget), latent grid, forward options, device, ranks and autocast rule; its dataset (if any) is the pairs'
    episodes, for a family's sampler that reads more of them (its negative prompt). ``max_tokens``: another budget
    (one episode alone, say)."""

    def __init__(self, model: nn.Module, run: Run, options: SampleOptions = SampleOptions(), *,
                 max_tokens: int | None = None, text_slots: int | None = None, stage: int | None = None) -> None:
        context_chunk(run)
        check_solver(options.solver)
        cfg = run.config
        self.model, self.sample_run, self.cfg, self.opt = model, run, cfg, options
        self.tpf, self.device = run.geometry.tokens_per_frame, run.device
        self.max_tokens = int(max_tokens or run.geometry.max_tokens or cfg.data.max_tokens)
        self.text_slots = text_slots
        # frames per stage: one chunk under teacher forcing, else set by the caller (rollout) or the horizon
        self.stage = int(cfg.model.chunk_size) if mask_kind(cfg.model.mask).teacher_forcing else stage
        self.actions = run.model_config.action_channels > 0
        o = cfg.objective
        self.grid_v = sigma_grid(options.steps, o.shift).float()
        self.grid_a = sigma_grid(options.steps, o.action_shift).float()
        self.grid = run.grid  # the run's grid where the dataset's grids differ: packs pad smaller ones spatially
        self.forwards = 0  # model calls (for throughput accounting)
        self.tokens = 0  # valid tokens × model calls

    @property
    def dataset(self) -> Any:
        """The run's episodes (None: pairs made in memory)."""
        return None if self.sample_run.data is None else self.sample_run.dataset

    # ------------------------------------------------------------------ stages
    def run(self, pairs: Sequence[Pair]) -> None:
        """Fill every pair's ``pred_*`` target frames, stage after stage.

        Block masks are built on segment grids fixed by the pack's shape (see
        :meth:`~flexpack.attention.flex.FlexAttnFunc.fixed_segment_bounds`): packs holding different
        numbers of episodes then share one compiled builder, so nothing compiles after the first pack.
        """
        for p in pairs:
            p.done = 0
        attn = getattr(self.model, "attn", None)
        with attn.fixed_segment_bounds() if hasattr(attn, "fixed_segment_bounds") else contextlib.nullcontext():
            while True:
                active = [p for p in pairs if p.done < p.horizon]
                if not active:
                    return
                todo = [(p, p.cut + p.done, self.stage_count(p)) for p in active]
                self._stage(todo)
                for p, _, n in todo:
                    p.done += n

    def stage_count(self, p: Pair) -> int:
        """Target frames of ``p`` the next stage generates."""
        return min(self.stage or stage_frames(self.sample_run, p.horizon), p.horizon - p.done)

    def _stage(self, todo: list[tuple[Pair, int, int]]) -> None:
        rank, size = self.sample_run.rank, self.sample_run.world_size
        lengths = [k + n for _, k, n in todo]
        over = too_long(lengths, frame_budget(self.max_tokens, self.tpf))  # the training rule (packing.geometry)
        if over:
            (p, _, _), n = todo[over[0]], lengths[over[0]]
            raise ValueError(f"episode {p.episode} at cut {p.cut}: {n} latent frames = {n * self.tpf} tokens do "
                             f"not fit a pack of data.max_tokens={self.max_tokens}; raise data.max_tokens "
                             "or lower --horizon")
        sampler = TokenBudgetBatchSampler(lengths, self.max_tokens, tokens_per_frame=self.tpf, rank=rank,
                                          world_size=size, seed=0)
        collate = PackCollate.from_token_budget(self.max_tokens, self.tpf, grid=self.grid)
        # one text-key shape for every pack (compiled blocks never see another); the first stage has the
        # shortest sequences, so the most pairs per pack: later stages keep its value
        need = text_slots(max(1, sampler.max_batch_size()))
        if self.text_slots is None or need > self.text_slots:
            self.text_slots = need
        written: list[tuple[int, Tensor, Tensor | None]] = []
        for indices in sampler:
            group = [todo[i] for i in indices]
            lat, act = self.solve_pack([p for p, _, _ in group], [k for _, k, _ in group],
                                       [n for _, _, n in group], collate)
            for j, (i, (p, k, n)) in enumerate(zip(indices, group)):
                written.append((i, lat[j][:, k:k + n], None if act is None else act[j][:, k:k + n]))
        if size > 1:
            written = _gather(written, todo, self.actions)
        for i, lat, act in written:
            p, k, n = todo[i]
            p.pred_latent[:, k:k + n] = lat.to(p.pred_latent.dtype).cpu()
            if act is not None and p.pred_action is not None:
                p.pred_action[:, k:k + n] = torch.where(p.action_mask[:, k:k + n], act.cpu().float(), 0.0)

    # ------------------------------------------------------------------ one pack
    @torch.no_grad()
    def solve_pack(self, pairs: Sequence[Pair], known: Sequence[int], counts: Sequence[int], collate: Any
                   ) -> tuple[list[Tensor], list[Tensor] | None]:
        """Denoise frames ``[known[e], known[e] + counts[e])`` of every pair (its first ``known + count``
        frames packed by ``collate``); returns per pair its (C, L, H, W) latents and (Ca, L, A) actions."""
        items = [p.item(k + n) for p, k, n in zip(pairs, known, counts)]
        return self._solve_items(pairs, items, known, collate)

    def _solve_items(self, pairs: Sequence[Pair], items: list[dict], known: Sequence[int], collate: Any
                     ) -> tuple[list[Tensor], list[Tensor] | None]:
        cfg, dev = self.cfg, self.device
        if not self.actions:
            items = [{k: v for k, v in it.items() if k not in ("action", "action_mask")} for it in items]
        batch = collate(items).to(dev)
        lay = batch.layout
        doc, pos = lay.frame_doc, lay.frame_pos
        known_E = torch.as_tensor(list(known), dtype=torch.int64, device=dev)
        target = (doc >= 0) & (pos >= known_E[doc.clamp(min=0)])  # (R, Fr)
        x_true = batch.latent.float()
        a_true = None if batch.action is None else batch.action.float()
        noise, anoise = pair_noise(lay, [p.seed for p in pairs], x_true.shape,
                                   None if a_true is None else a_true.shape, dev)
        t5 = target[:, None, :, None, None]
        x0 = torch.where(t5, noise, x_true)
        states, grids, keep = [x0], [self.grid_v.to(dev)[:, None, None] * target[None].float()], [~t5]
        if a_true is not None:
            a_live = target[:, None, :, None] & batch.action_mask
            states.append(torch.where(a_live, anoise, a_true))
            grids.append(self.grid_a.to(dev)[:, None, None] * target[None].float())
            keep.append(~a_live)
        tf = mask_kind(cfg.model.mask).teacher_forcing  # the mask relates a noisy and a clean copy
        scale = cfg.objective.num_train_timesteps
        forward = replace(self.sample_run.forward, text_slots=self.text_slots)  # training's mask and chunk size
        n_valid = int(lay.episode_frames.sum()) * self.tpf

        def velocity(xs: tuple[Tensor, ...], i: int) -> tuple[Tensor, ...]:
            t_v, t_a = grids[0][i] * scale, (grids[-1][i] if a_true is not None else grids[0][i]) * scale
            lat, act = xs[0], xs[1] if a_true is not None else None
            if tf:  # (noisy, clean): the clean copy is the known history at t = 0
                lat, t_v = torch.stack([lat, x_true]), torch.stack([t_v, torch.zeros_like(t_v)])
                t_a = torch.stack([t_a, torch.zeros_like(t_a)])
                act = None if act is None else torch.stack([act, a_true])
            inputs = replace(batch, latent=lat.to(batch.latent.dtype), action=act)
            with self.opt.autocast(self.sample_run):
                out = forward.call(self.model, inputs, timestep=t_v, action_timestep=t_a)
            self.forwards += 1
            self.tokens += n_valid * (2 if tf else 1)
            vs = [out.video.float()]
            if a_true is not None:
                vs.append(out.action.float())
            return tuple(vs)

        # grids are (N+1, R, Fr); view them to broadcast against (R, C, Fr, H, W) / (R, Ca, Fr, A)
        shaped = [grids[0][:, :, None, :, None, None]] + ([grids[1][:, :, None, :, None]] if a_true is not None else [])
        xs = solve(velocity, tuple(states), tuple(shaped), self.opt.solver, keep=tuple(keep))
        rows, starts, frames = lay.episode_row.tolist(), lay.episode_start.tolist(), lay.episode_frames.tolist()
        lats = [xs[0][r, :, s:s + f, :h, :w] for r, s, f, (h, w) in zip(rows, starts, frames,
                                                                           episode_grids(lay, x_true.shape[-2:]))]
        acts = None if a_true is None else [xs[1][r, :, s:s + f] for r, s, f in zip(rows, starts, frames)]
        return lats, acts


def episode_grids(layout: Any, hw: Sequence[int]) -> list[tuple[int, int]]:
    """Each episode's own latent grid (H, W) in a packed batch of grid ``hw`` (where it has spatial padding, the
    part that is the episode's)."""
    host = layout.on_host()
    if host.episode_hw is None:
        return [(int(hw[0]), int(hw[1]))] * host.num_episodes
    return [(h, w) for h, w in host.episode_hw.tolist()]


def pack_text_slots(pairs: Sequence[Pair], max_tokens: int, tokens_per_frame: int, stage: int | None = None) -> int:
    """Text key slots that fit every pack of a first stage over ``pairs`` (pass it as ``text_slots``
    to keep one shape across several runs, e.g. a warm-up on fewer pairs)."""
    first = [p.cut + min(stage or p.horizon, p.horizon) for p in pairs]
    plan = TokenBudgetBatchSampler(first, max_tokens, tokens_per_frame=tokens_per_frame)
    return text_slots(max(1, plan.max_batch_size()))


def _gather(written: list, todo: list[tuple[Pair, int, int]], actions: bool) -> list:
    """Every rank's stage results on every rank: each pair's slice summed over the ranks that
    solved it, divided by how many did (a bin repeated to fill the last step solves a pair twice)."""
    sizes = []
    for p, _, n in todo:
        s = p.latent.shape[0] * n * p.latent.shape[2] * p.latent.shape[3]
        if actions and p.action is not None:
            s += p.action.shape[0] * n * p.action.shape[2]
        sizes.append(s)
    offs = [0]
    for s in sizes:
        offs.append(offs[-1] + s)
    dev = written[0][1].device if written else torch.device("cpu")
    flat = torch.zeros(offs[-1], device=dev)
    count = torch.zeros(len(todo), device=dev)
    for i, lat, act in written:
        parts = [lat.reshape(-1)] + ([act.reshape(-1)] if act is not None else [])
        flat[offs[i]:offs[i + 1]] += torch.cat(parts).float()
        count[i] += 1
    dist.all_reduce(flat)
    dist.all_reduce(count)
    out = []
    for i, (p, _, n) in enumerate(todo):
        v = flat[offs[i]:offs[i + 1]] / count[i].clamp(min=1)
        C, _, H, W = p.latent.shape
        lat = v[: C * n * H * W].view(C, n, H, W)
        act = (v[C * n * H * W:].view(p.action.shape[0], n, p.action.shape[2])
               if actions and p.action is not None else None)
        out.append((i, lat, act))
    return out
