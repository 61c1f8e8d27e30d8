"""``flexpack sample CONFIG --checkpoint RUN``: sample episodes from a trained model and score them.

Open-loop forecast (default): from ground-truth history at ``--cuts`` evenly spaced cut points per
episode (each with at least ``--min-context`` latent frames of context), predict the next
``--horizon`` latent frames (video latents and actions together), ``--samples`` times from
different noise. ``--mode rollout``: from the first allowed cut, generate the rest of each episode
``--horizon`` frames (teacher forcing: one chunk) at a time, each stage conditioned on the model's
own output.

Writes ``OUT/metrics.json`` (:mod:`flexpack.sampling.evaluate`) and plots, prints a short table of
the model against the ``last`` and ``mean`` baselines and where the files are. The weights come
from a run folder (its newest checkpoint), a checkpoint folder, or an ``flexpack export`` folder;
``--ema`` takes the EMA weights.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import nn

from flexpack.sampling.evaluate import (
    DEFAULT_MIN_CONTEXT,
    MODES,
    PairPlan,
    checkpoint_normalizer,
    dataset_for,
    evaluate,
    table,
)
from flexpack.sampling.sampler import SampleOptions
from flexpack.sampling.schedule import SOLVERS

DEFAULT_SAMPLES = 4  # forecasts per (episode, cut) of flexpack sample (runtime.sample_draws: 1, for its cost)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path,
                        help="TOML/JSON training config, or a run folder (config.json) or export folder holding one")
    parser.add_argument("--checkpoint", required=True,
                        help="a run folder (its newest checkpoint), a checkpoint folder, or an export folder")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value (repeatable)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--episodes", type=_int_list, default=None, metavar="LIST",
                       help="dataset episode indices, e.g. 0,3,7 "
                            "(default: the held-out episodes if the config has any, else all)")
    which.add_argument("--val", action="store_true",
                       help="the config's held-out episodes (data.val_fraction / val_episodes)")
    parser.add_argument("--mode", choices=MODES, default="forecast",
                        help="open-loop forecast or autoregressive rollout")
    parser.add_argument("--steps", type=int, default=10, help="solver steps from noise to data (default 10)")
    parser.add_argument("--solver", choices=SOLVERS, default="euler", help="euler (default) or heun (2nd order)")
    parser.add_argument("--cuts", type=int, default=4, help="cut points per episode in forecast mode (default 4)")
    parser.add_argument("--cut-points", type=_int_list, default=(), metavar="LIST",
                        help="explicit cut points (latent frames of context) used for every episode")
    parser.add_argument("--horizon", type=int, default=None,
                        help="latent frames to generate per cut (rollout: per stage); default two context chunks, >= 4")
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, metavar="K",
                        help=f"forecasts per (episode, cut point), each from its own noise, packed together (default "
                             f"{DEFAULT_SAMPLES}): metrics.json adds the MSE of their mean (*_kmean), their spread and "
                             "CRPS; one draw from a model that is rightly unsure scores worse than the mean baseline, "
                             "the mean of K does not. The single-sample numbers are the first sample's")
    parser.add_argument("--min-context", type=int, default=DEFAULT_MIN_CONTEXT, metavar="N",
                        help=f"latent frames of context a cut point needs (default {DEFAULT_MIN_CONTEXT}): latent "
                             "frame 0 holds the first video frame alone (causal VAE), so a one-frame context shows "
                             "no motion and its forecast can only guess direction and speed; cut points with less "
                             "context are not made (rollouts start at the first cut with N), per_cut in "
                             "metrics.json shows each context length apart; 1 keeps them")
    parser.add_argument("--foreign-history", action="store_true",
                        help="a control: each pair forecasts from another episode's history (the next one long "
                             "enough; truth, text and noise its own); a model that reads its history scores worse "
                             "than with its own, one that ignores it the same")
    parser.add_argument("--seed", type=int, default=0,
                        help="noise seed (default 0: the noise runtime.sample_every uses); another draws other noise")
    parser.add_argument("--ema", action="store_true", help="use the checkpoint's EMA weights")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default CHECKPOINT/samples/MODE)")
    parser.add_argument("--plots", type=int, default=4,
                        help="episodes to plot (action plot, latent figure); every sampled episode also gets a "
                             "predicted-vs-true video unless 0 (metrics only). Default 4")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default runtime.device)")


def _config_file(path: Path) -> Path:
    if path.is_dir():
        for name in ("flexpack_config.json", "config.json"):  # an export's config.json is the diffusers one
            if (path / name).is_file():
                return path / name
        raise FileNotFoundError(f"{path}: holds neither config.json (a run folder) "
                                "nor flexpack_config.json (an export)")
    return path


def load_weights(cfg: Any, source: str | Path, *, ema: bool = False) -> tuple[nn.Module, dict[str, Any] | None, str]:
    """The config's model with the weights of a run / checkpoint / export folder; returns
    (model, the action statistics it was trained with or None, a label naming the weights)."""
    from flexpack.models.wan_config import check_action_positions
    from flexpack.training.build import build_model
    from flexpack.training.checks import check_state_shapes
    from flexpack.training.runstate import checkpoint

    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such run, checkpoint or export folder")
    cfg = replace(cfg, model=replace(cfg.model, pretrained=""))  # the weights come from the checkpoint
    model = build_model(cfg)
    if (path / "action_stream.json").is_file():  # an export folder
        from flexpack.training.export import load_export

        folder = path / "ema" if ema else path
        if ema and not (folder / "action_stream.json").is_file():
            raise ValueError(f"{path}: --ema but the export has no ema/ folder (exported without --ema)")
        loaded = load_export(folder)
        check_action_positions(loaded.config.action_positions, model.config, str(folder))
        check_state_shapes(folder, loaded.state_dict(), model)
        model.load_state_dict(loaded.state_dict())
        norm = json.loads((path / "normalization.json").read_text())
        return model, {k: norm[k] for k in ("mode", "low", "high")}, str(folder)
    found = checkpoint.latest(path / "checkpoints") or checkpoint.latest(path)
    if found is None and (path / "train_state.json").is_file():
        found = path
    if found is None:
        raise ValueError(f"{path}: holds no checkpoint "
                         "(expected a run folder, a checkpoint folder or an export folder)")
    state = checkpoint.load(found, model, restore_rng=False)
    if ema:
        if not checkpoint.has_ema(found):
            raise ValueError(f"{found}: --ema but the checkpoint holds no EMA weights "
                             "(trained with optim.ema_decay = 0)")
        model.load_state_dict(checkpoint.read_ema(found))
    return model, (state.get("extra") or {}).get("action_normalizer"), str(found)


def _default_out(source: Path, label: str, mode: str) -> Path:
    """RUN/samples/MODE_STEP for a run or one of its checkpoints, EXPORT/samples/MODE_... for an export."""
    base = source
    if source.parent.name == "checkpoints" and (source / "train_state.json").is_file():
        base = source.parent.parent  # never inside checkpoints/: that folder holds checkpoints only
    elif not ((source / "action_stream.json").is_file() or (source / "checkpoints").is_dir()):
        base = source.parent
    return base / "samples" / f"{mode}_{Path(label).name}"


def run(args: argparse.Namespace) -> int:
    from flexpack.training.checks import resolve_device
    from flexpack.training.config import load_config

    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1 (solver steps from noise to data), got {args.steps}")
    if args.cuts < 1:
        raise ValueError(f"--cuts must be >= 1, got {args.cuts}")
    if args.horizon is not None and args.horizon < 1:
        raise ValueError(f"--horizon must be >= 1 latent frame, got {args.horizon}")
    if args.plots < 0:
        raise ValueError(f"--plots must be >= 0, got {args.plots}")
    if args.cut_points and args.mode == "rollout":
        raise ValueError("--cut-points applies to --mode forecast (a rollout starts from the first chunk)")
    cfg = load_config(_config_file(args.config), args.overrides)
    device = resolve_device(args.device or cfg.runtime.device)
    plan = PairPlan(mode=args.mode, cuts=args.cuts, horizon=args.horizon, cut_points=tuple(args.cut_points),
                    seed=args.seed, samples=args.samples, min_context=args.min_context,
                    foreign_history=args.foreign_history)
    from flexpack.sampling.sampler import context_chunk

    context_chunk(cfg)  # a one-σ-per-episode model fails here, before any loading
    val = args.val or (args.episodes is None and bool(cfg.data.val_fraction or cfg.data.val_episodes))
    dataset = dataset_for(cfg, args.episodes, val=val)
    model, saved, label = load_weights(cfg, args.checkpoint, ema=args.ema)
    normalizer = checkpoint_normalizer(dataset, saved, label)
    model.to(device)
    out = args.out or _default_out(Path(args.checkpoint), label, args.mode)
    options = SampleOptions(steps=args.steps, solver=args.solver,
                            dtype=cfg.runtime.dtype if device.type == "cuda" else "float32")
    metrics, files = evaluate(model, cfg, dataset, plan, options, device=device, normalizer=normalizer, out=out,
                              plots=args.plots)
    print(f"{label}: {metrics['mode']} of {len(metrics['episodes'])} episode(s), {metrics['pairs']} pair(s) x "
          f"{args.samples} sample(s), context >= {args.min_context} latent frames, horizon {metrics['horizon']}, "
          f"{args.steps} {args.solver} steps" + (", control: each pair from another episode's history"
                                                   if args.foreign_history else ""))
    print(table(metrics))
    videos = len(list(out.glob("episode_*.mp4")))
    print(f"wrote {out / 'metrics.json'}" + (f", {len(files)} plot(s)" if files else "")
          + (f", {videos} video(s)" if videos else "") + (f" in {out}" if files or videos else ""))
    return 0

