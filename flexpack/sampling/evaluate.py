"""Sample held-out episodes and write what a user looks at: ``metrics.json``, plots, videos.

Shared by ``flexpack sample`` (:mod:`flexpack.commands.sample`) and training's ``sample.every``
(:class:`SampleHook`), so both write the same files for the same episodes. Both hand over a ``"sample"``
:class:`~flexpack.run.root.Run` (:func:`flexpack.run.compose.compose`): its episodes, geometry, grid, forward
options, device and autocast rule; nothing here derives them again.

- ``metrics.json``: the model's metrics and the ``baselines`` (:mod:`flexpack.sampling.metrics`),
  ``episodes``, ``pairs`` (episode, cut, horizon), ``steps``, ``solver``, ``mode``, and with a Wan
  VAE cache ``psnr`` / ``psnr_baseline_last`` of decoded frames;
- the pictures of :mod:`flexpack.sampling.pictures`: a predicted-vs-true video of every sampled
  episode (``episode_EEEEEE.mp4``), and for the first ``plots`` episodes an action plot
  (``episode_EEEEEE_actions.png``) and, without a decoder, a latent figure (``*_latents.png``).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch
from torch import nn

from flexpack.atomic import atomic_path
from flexpack.data.normalization import ActionStats
from flexpack.run.root import Run
from flexpack.sampling.metrics import Metrics
from flexpack.sampling.pairs import Pair, borrow_history, check_cut, cut_points, first_cut, make_pair
from flexpack.sampling.solver import PackedSampler, SampleOptions, context_chunk, sampler_class

if TYPE_CHECKING:
    from flexpack.data.dataset import LatentEpisodeDataset

MODES = ("forecast", "rollout")


# Latent frames of context a cut point needs by default: latent frame 0 holds the first video frame
# alone (the VAE is causal), so a one-frame context shows no motion, and a forecast from it can only
# guess direction and speed (an ill-posed pair that says little about the model).
DEFAULT_MIN_CONTEXT = 2


@dataclass(frozen=True)
class PairPlan:
    mode: str = "forecast"
    cuts: int = 4  # evenly spaced cut points per episode (forecast)
    horizon: int | None = None  # frames generated per pair (forecast) / per stage (rollout); None: default
    cut_points: tuple[int, ...] = ()  # explicit cut points (forecast), instead of ``cuts``
    seed: int = 0  # noise seed: the same pairs with another seed start from other noise
    samples: int = 1  # forecasts per (episode, cut), each from its own noise (K-sample metrics)
    min_context: int = DEFAULT_MIN_CONTEXT  # latent frames of context a cut point needs (rollouts start there)
    foreign_history: bool = False  # control: each pair forecasts from the next episode's history (borrow_history)

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"--samples must be >= 1 (forecasts per episode and cut point), got {self.samples}")
        if self.min_context < 0:
            raise ValueError(f"--min-context must be >= 0 latent frames, got {self.min_context}")


def default_horizon(run: Run) -> int:
    """Two context chunks, at least 4 latent frames (16 video frames at the usual stride)."""
    chunk = context_chunk(run)
    return max(2 * chunk, -(-4 // chunk) * chunk)


def build_pairs(run: Run, plan: PairPlan, *, limit_pairs: int | None = None, note: bool = True) -> list[Pair]:
    """Pairs of every episode of the run's dataset (a ``"sample"`` run: :func:`flexpack.run.compose.compose`):
    forecast cut points, or one rollout from the first allowed cut; ``plan.samples`` consecutive pairs (samples
    0..K-1, each its own noise) per (episode, cut)."""
    if plan.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {plan.mode!r}")
    cfg, dataset = run.config, run.dataset
    chunk = context_chunk(run)
    horizon = plan.horizon or default_horizon(run)
    if horizon < 1:
        raise ValueError(f"--horizon must be >= 1 latent frame, got {horizon}")
    if horizon % chunk:  # frames of one chunk share σ in training: never split one between context and target
        raise ValueError(f"--horizon {horizon} must be a multiple of the chunk the model was trained with "
                         f"({chunk} latent frames)")
    low = [c for c in plan.cut_points if c < plan.min_context]
    if low:
        raise ValueError(f"cut points {low} have less context than --min-context {plan.min_context} latent frames; "
                         "lower --min-context")
    first = first_cut(chunk, plan.min_context)
    actions = run.model_config.action_channels > 0
    # a pair is one document of a pack: automatic cut points and rollouts stay within one pack's frames
    budget = run.geometry.frame_budget
    lengths = dataset.lengths()
    pairs, short, cut_short = [], [], []
    for i, F_full in enumerate(lengths):
        episode = episode_of(dataset, i)
        F = F_full if plan.cut_points else min(F_full, budget)
        if F < F_full:
            cut_short.append(episode)
        if plan.mode == "rollout":
            cuts = [first] if F > first else []
        elif plan.cut_points:
            for c in plan.cut_points:
                check_cut(episode, F, c, horizon, chunk)
            cuts = list(plan.cut_points)
        else:
            cuts = cut_points(F, plan.cuts, horizon, chunk, plan.min_context)
        if not cuts:
            short.append(episode)
            continue
        item = dataset[i]
        for c in cuts:
            pairs += [make_pair(item, c, (F - c) if plan.mode == "rollout" else horizon, actions=actions,
                                noise_seed=plan.seed, sample=k) for k in range(plan.samples)]
        if limit_pairs is not None and len(pairs) >= limit_pairs:
            break
    if plan.foreign_history:
        _swap_histories(pairs, dataset, lengths)
    if cut_short and note:
        print(f"note: episodes {cut_short} are longer than a pack ({budget} latent frames at data.max_tokens = "
              f"{cfg.data.max_tokens}): "
              f"{'rolled out' if plan.mode == 'rollout' else 'cut'} within their first {budget} frames",
              file=sys.stderr)
    if short and note:
        print(f"note: episodes {short} are too short for {first} latent frame(s) of context (one chunk of {chunk}, "
              f"--min-context {plan.min_context}) plus the horizon ({horizon}); skipped", file=sys.stderr)
    if not pairs:
        raise ValueError(f"no episode has room for a cut point: each needs at least {first + horizon} latent frames "
                         f"(context {first}: one chunk of {chunk}, min context {plan.min_context}; + horizon "
                         f"{horizon}); lower --horizon or --min-context")
    return pairs


def episode_of(dataset: LatentEpisodeDataset, i: int) -> int:
    """The episode index item ``i`` belongs to (a bundle's: its bundle episode id)."""
    it = dataset.items[i]
    return it[0] if isinstance(it, tuple) else it.global_episode


def _swap_histories(pairs: list[Pair], dataset: LatentEpisodeDataset, lengths: Sequence[int]) -> None:
    """Each pair's history from the next episode of ``dataset`` (cyclic) that is long enough."""
    index = {episode_of(dataset, i): i for i in range(len(lengths))}
    items: dict[int, dict[str, Any]] = {}
    for p in pairs:
        i = index[p.episode]
        donors = [j % len(lengths) for j in range(i + 1, i + len(lengths)) if lengths[j % len(lengths)] >= p.cut]
        if not donors:
            raise ValueError(f"--foreign-history: no other episode has the {p.cut} latent frames of history that "
                             f"episode {p.episode} needs at cut {p.cut}")
        j = donors[0]
        borrow_history(p, items.setdefault(j, dataset[j]))


def checkpoint_stats(dataset: LatentEpisodeDataset, saved: ActionStats | None, where: str) -> ActionStats | None:
    """The action statistics the weights were trained with (``saved``, read from ``where``; None: the
    dataset's own); the dataset must normalize the same way."""
    from flexpack.run.state.resume import normalizer_state

    mine = normalizer_state(dataset)
    if saved is None:
        return mine
    if saved.mode != "none" and saved.columns != len(dataset.channels):
        raise ValueError(f"{where}: feature 'action': low has {saved.columns} values, the feature has "
                         f"{len(dataset.channels)} columns")
    if not saved.matches(mine):
        raise ValueError(f"{dataset.root}: its action statistics ({mine and mine.mode}) are not those {where} was "
                         f"trained with ({saved.mode}, low {np.round(saved.low, 4).tolist()[:4]}...); "
                         "sample with the training dataset or restore its meta/stats.json")
    return saved


def action_names(dataset: LatentEpisodeDataset) -> list[str]:
    """Names of the dataset's action columns (``meta/info.json``), else ``a0, a1, ...``."""
    if not hasattr(dataset, "source"):  # a bundle: its items' actions are the model's channels
        return [f"ch{i}" for i in range(len(dataset.channels))]
    names = dataset.source.meta.features[dataset.action_key].get("names")
    if isinstance(names, dict):  # LeRobot v2-style {"motors": [...]}
        names = next(iter(names.values()), None)
    n = len(dataset.channels)
    return [str(x) for x in names] if isinstance(names, list) and len(names) == n else [f"a{i}" for i in range(n)]


def mean_action(dataset: LatentEpisodeDataset) -> list[float] | None:
    from flexpack.data.action_stats import lerobot_stats

    if not hasattr(dataset, "source"):  # a bundle carries no per-column means
        return None
    stats = lerobot_stats(dataset.source, [dataset.action_key]).get(dataset.action_key) or {}
    return None if "mean" not in stats else np.asarray(stats["mean"], dtype=np.float64).reshape(-1).tolist()


def sample_pairs(model: nn.Module, run: Run, pairs: list[Pair], *, options: SampleOptions, stage: int | None = None,
                 text_slots: int | None = None) -> PackedSampler:
    """The family's sampler (:func:`~flexpack.sampling.solver.sampler_class`) over ``pairs`` with the run's parts."""
    sampler = sampler_class(run)(model, run, options, text_slots=text_slots, stage=stage)
    sampler.run(pairs)
    return sampler


HEADLINE = ("action_mse", "action_mse_kmean", "action_crps", "action_mse_raw", "latent_mse", "latent_mse_kmean")


def samples_of(pairs: Sequence[Pair]) -> list[list[Pair]]:
    """The pairs grouped by (episode, segment, cut): each group the K samples of one forecast, in order."""
    groups: dict[tuple[int, int, int], list[Pair]] = {}
    for p in pairs:
        groups.setdefault((p.episode, p.segment, p.cut), []).append(p)
    return list(groups.values())


def _headline(r: dict[str, Any]) -> dict[str, Any]:
    """The numbers of a group of pairs worth a line: the model's and each baseline's MSEs."""
    out = {k: r[k] for k in HEADLINE}
    out["pairs"] = r["pairs"]
    for b in ("last", "mean"):
        out.update({f"{b}_{k}": r["baselines"][b][k] for k in ("action_mse", "latent_mse")})
    return out


def score(pairs: Sequence[Pair], dataset: LatentEpisodeDataset, action_stats: ActionStats | None) -> dict[str, Any]:
    """All pairs' metrics (K samples per (episode, cut): :class:`Metrics`), plus ``per_episode`` and
    ``per_cut`` (keyed by the cut point: latent frames of context): the headline numbers of each
    episode's and each context length's pairs (which episodes a model gets wrong; how the error falls
    as the context grows)."""
    mean = mean_action(dataset)
    metrics = Metrics(action_stats, dataset.channels, mean)
    per: dict[str, dict[str, Metrics]] = {"per_episode": {}, "per_cut": {}}
    for group in samples_of(pairs):
        metrics.add(*group)
        p = group[0]
        for kind, key in (("per_episode", p.episode), ("per_cut", p.cut)):
            per[kind].setdefault(str(key), Metrics(action_stats, dataset.channels, mean)).add(*group)
    out = metrics.result()
    for kind, parts in per.items():
        out[kind] = {k: _headline(m.result()) for k, m in sorted(parts.items(), key=lambda kv: int(kv[0]))}
    return out


def write_media(out: Path, pairs: Sequence[Pair], dataset: LatentEpisodeDataset, plots: int,
                device: torch.device | str = "cpu", *,
                action_stats: ActionStats | None = None, mode: str = "forecast", chunk: int = 1
                ) -> tuple[dict[str, Path], dict[str, float]]:
    """:func:`flexpack.sampling.pictures.write_media` with the dataset's action names and mean action."""
    from flexpack.sampling import pictures

    return pictures.write_media(out, pairs, dataset, plots, device, action_stats=action_stats,
                                mean_raw=mean_action(dataset), names=action_names(dataset), mode=mode, chunk=chunk)


def write_report(out: Path, metrics: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "metrics.json") as tmp:
        Path(tmp).write_text(json.dumps(metrics, indent=2, allow_nan=True) + "\n")
    return out / "metrics.json"


TABLE = ("action_mse", "action_mse_kmean", "action_crps", "action_spread", "action_l1", "action_mse_raw",
         "action_l1_raw", "latent_mse", "latent_mse_kmean", "latent_crps", "latent_spread")


def table(metrics: dict[str, Any]) -> str:
    """The model against the ``last`` and ``mean`` baselines, one metric a line (``*_kmean``: the
    K-sample mean's; ``*_crps``, ``*_spread``: of the K samples; the rest: the first sample's)."""
    b = metrics["baselines"]
    lines = [f"{'':>16} {'model':>11} {'last':>11} {'mean':>11}"]
    for k in TABLE:
        if k in metrics:
            lines.append(f"{k:>16} {metrics[k]:>11.5g} {b['last'][k]:>11.5g} {b['mean'][k]:>11.5g}")
    if "psnr" in metrics:
        lines.append(f"{'psnr (dB)':>16} {metrics['psnr']:>11.4g} {metrics['psnr_baseline_last']:>11.4g} {'':>11}")
    return "\n".join(lines)


def evaluate(model: nn.Module, run: Run, plan: PairPlan, options: SampleOptions, *,
             action_stats: ActionStats | None, out: Path | None, plots: int = 4, write: bool = True,
             text_slots: int | None = None, note: bool = True, pairs: list[Pair] | None = None
             ) -> tuple[dict[str, Any], dict[str, Path]]:
    """Sample the run's episodes (a ``"sample"`` run), score, and (``write``: rank 0) write ``metrics.json`` and the
    plots into ``out``; ``pairs``: those :func:`build_pairs` made of the run and ``plan`` already (sampled in
    place), else built here."""
    dataset, device = run.dataset, run.device
    if pairs is None:
        pairs = build_pairs(run, plan, note=note)
    stage = (plan.horizon or default_horizon(run)) if plan.mode == "rollout" else None
    was = model.training
    model.eval()
    try:
        sampler = sample_pairs(model, run, pairs, options=options, stage=stage, text_slots=text_slots)
    finally:
        model.train(was)
    metrics = score(pairs, dataset, action_stats)
    metrics.update(episodes=sorted({p.episode for p in pairs}), steps=options.steps, solver=options.solver,
                   seed=plan.seed, mode=plan.mode, horizon=plan.horizon or default_horizon(run),
                   action_names=action_names(dataset),
                   min_context=plan.min_context, foreign_history=plan.foreign_history,
                   pair_list=[[p.episode, p.cut, p.horizon] for p in pairs if p.sample == 0],
                   model_calls=sampler.forwards)
    files: dict[str, Path] = {}
    if write and out is not None:
        files = _write_all(out, pairs, dataset, plots, device, metrics, action_stats=action_stats, mode=plan.mode,
                           chunk=context_chunk(run))
    return metrics, files


def _write_all(out: Path, pairs: list[Pair], dataset: LatentEpisodeDataset, plots: int, device: torch.device,
               metrics: dict[str, Any], **media: Any) -> dict[str, Path]:
    """Plots, videos and ``metrics.json`` into ``out``, all or nothing: written into a temporary folder beside
    it and moved in (a rename each) once every file is whole. A full disk leaves ``out`` as it was, in one line."""
    import os
    import shutil

    from flexpack.atomic import write_failure
    from flexpack.errors import UserError

    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        files: dict[str, Path] = {}
        if plots > 0:
            files, extra = write_media(tmp, pairs, dataset, plots, device, **media)
            metrics.update(extra)
        write_report(tmp, metrics)
        out.mkdir(exist_ok=True)
        for p in sorted(tmp.iterdir(), key=lambda p: p.name == "metrics.json"):  # metrics.json last
            os.replace(p, out / p.name)
        return {k: out / Path(v).name for k, v in files.items()}
    except Exception as exc:  # a full disk shows as OSError, or inside a media library's own error
        why = write_failure(exc)
        if why is None:
            raise
        raise UserError(f"{out}: cannot write the samples ({why}); nothing of this sampling was kept there (its "
                        f"earlier files are unchanged); free space (or grant write access) under {out.parent}, or "
                        "write elsewhere (sample --out), and run again") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

