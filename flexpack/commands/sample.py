"""``flexpack sample RUN`` (or ``CONFIG --checkpoint RUN``): sample episodes from a trained model and score them.

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
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flexpack.commands.common import add_config, add_set, load
from flexpack.run import bounds
from flexpack.run.bounds import check_count

if TYPE_CHECKING:
    from torch import nn

    from flexpack.data.normalization import ActionStats
    from flexpack.run.config import TrainConfig
    from flexpack.run.root import Run

# the choices of --mode and --solver, named here so that building the parser imports no torch (--help);
# tests/test_cli.py checks they are sampling.evaluate.MODES and sampling.schedule.SOLVERS
MODES = ("forecast", "rollout")
SOLVERS = ("euler", "heun")
DEFAULT_SAMPLES = 4  # forecasts per (episode, cut) of flexpack sample (sample.draws: 1, for its cost)
DEFAULT_MIN_CONTEXT = 2  # tests/test_cli.py checks it is sampling.evaluate.DEFAULT_MIN_CONTEXT


def _int_list(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config(parser, folders="a run, checkpoint or export folder (its config; also the default --checkpoint)")
    parser.add_argument("--checkpoint", default=None,
                        help="a run folder (its newest checkpoint), a checkpoint folder, or an export folder "
                             "(default: CONFIG where it is one of those)")
    add_set(parser)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--episodes", type=_int_list, default=None, metavar="LIST",
                       help="dataset episode indices, e.g. 0,3,7 "
                            "(default: the held-out episodes if the config has any, else all)")
    which.add_argument("--val", action="store_true",
                       help="the config's held-out episodes (data.val_fraction / val_episodes)")
    parser.add_argument("--mode", choices=MODES, default="forecast",
                        help="open-loop forecast or autoregressive rollout")
    parser.add_argument("--steps", type=int, default=None,
                        help="solver steps from noise to data (default 10; lingbot-va: its num_inference_steps and "
                             "action_num_inference_steps, set with --set model.overrides.KEY=N)")
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
                        help="noise seed (default 0: the noise sample.every uses); another draws other noise")
    parser.add_argument("--ema", action="store_true", help="use the checkpoint's EMA weights")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default CHECKPOINT/samples/MODE)")
    parser.add_argument("--plots", type=int, default=4,
                        help="episodes to plot (action plot, latent figure); every sampled episode also gets a "
                             "predicted-vs-true video unless 0 (metrics only). Default 4")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default runtime.device)")


def load_weights(run: Run, source: str | Path, *, ema: bool = False
                 ) -> tuple[nn.Module, ActionStats | None, str]:
    """The run's model with the weights of a run / checkpoint / export folder; returns (model, the action statistics
    it was trained with or None, a label naming the weights). The model is of the run's model config (its config:
    :func:`load_trained`, the shape the weights record); ``model.pretrained`` is not read."""
    import torch

    from flexpack.data.normalization import ActionStats
    from flexpack.run import lora
    from flexpack.run.checks import check_state_shapes
    from flexpack.run.state import checkpoint
    from flexpack.run.state.finite import check_finite
    from flexpack.run.state.locate import load_newest
    from flexpack.run.state.resume import saved_stats
    from flexpack.run.state.trained import saved_lora

    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such run, checkpoint or export folder")
    cfg, fam = run.config, run.family
    torch.manual_seed(cfg.runtime.seed)
    model = fam.build(run.model_config)  # its init is replaced by the weights below
    if (path / "flexpack_config.json").is_file():  # an export folder
        folder = path / "ema" if ema else path
        if ema and not folder.is_dir():
            raise ValueError(f"{path}: --ema but the export has no ema/ folder (exported without --ema)")
        check_export_files(path, folder)
        # the family reads its own exports (wanva: the diffusers folder and action stream; lingbot-va: a LeRobot
        read = fam.read_export or fam.load_checkpoint  # policy folder)
        if read is None:
            raise ValueError(f"{path}: flexpack cannot read a model.family = {cfg.model.family!r} export back; "
                             "sample the run's folder instead")
        loaded = read(str(folder), run.model_config)
        check_state_shapes(folder, loaded.state_dict(), model)
        check_finite(loaded.state_dict(), str(folder), "it cannot sample: export the run again from an intact "
                     "checkpoint", collective=False)
        model.load_state_dict(loaded.state_dict())
        norm = path / "normalization.json"
        return model, ActionStats.from_json(json.loads(norm.read_text()), str(norm)), str(folder)
    tried: list[Path] = []

    def weights(found: Path) -> dict[str, Any]:
        tried.append(found)
        record = saved_lora(found)
        if record is not None and not lora.lora_layers(model):  # a LoRA run's structure, its adapters merged below
            lora.apply(model, cfg, record=record, cast=False)
        state = checkpoint.load(found, model, restore_rng=False)
        if ema:
            if not checkpoint.has_ema(found):
                raise ValueError(f"{found}: --ema but the checkpoint holds no EMA weights "
                                 "(trained with optim.ema_decay = 0)")
            model.load_state_dict(checkpoint.read_ema(found))
        return state

    # the newest intact checkpoint; each damaged newer one said with why, a pruned one taken again
    found, state = load_newest(path, "sample", weights)
    lora.merge(model)  # a plain model, as an export of the run holds it (nothing to merge without LoRA)
    newest = max((p.name for p in found.parent.glob("step_*")), default=found.name)
    if len(tried) > 1 or (found.parent.name == "checkpoints" and found.name != newest):  # name what it fell back to
        print(f"sample: checkpoint {found} (step {int(state['step'])})", file=sys.stderr)
    return model, saved_stats(state, found / "train_state.json"), str(found)


def check_export_files(path: Path, folder: Path) -> None:
    """Every JSON and safetensors file of an export (``folder``: it, or its ``ema/``) reads, or one line naming the
    first that does not (a copy cut short, a file overwritten), before any weights load."""
    from flexpack.run.pretrained import check_headers

    for f in sorted({*path.glob("*.json"), *folder.glob("*.json")}):
        try:
            json.loads(f.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{f}: not readable as JSON ({exc}); the export is damaged: export the run "
                             "again") from None
    check_headers([str(f) for f in sorted(folder.glob("*.safetensors"))], "the export is damaged (cut short?): "
                  "export the run again")


def _default_out(source: Path, label: str, mode: str) -> Path:
    """RUN/samples/MODE_STEP for a run or one of its checkpoints, EXPORT/samples/MODE_... for an export."""
    base = source
    if source.parent.name == "checkpoints" and (source / "train_state.json").is_file():
        base = source.parent.parent  # never inside checkpoints/: that folder holds checkpoints only
    elif not ((source / "flexpack_config.json").is_file() or (source / "checkpoints").is_dir()):
        base = source.parent
    return base / "samples" / f"{mode}_{Path(label).name}"


def check_flags(args: argparse.Namespace) -> None:
    """Every count of the command line in its range (:mod:`flexpack.run.bounds`), before any work."""
    if args.steps is not None:
        check_count("--steps", args.steps, 1, bounds.SOLVER_STEPS, unit="solver steps from noise to data")
    check_count("--cuts", args.cuts, 1, bounds.CUTS, unit="cut points per episode")
    if args.horizon is not None:
        check_count("--horizon", args.horizon, 1, bounds.HORIZON, unit="latent frames")
    check_count("--plots", args.plots, 0, bounds.PLOTS, unit="episodes plotted")
    check_count("--samples", args.samples, 1, bounds.SAMPLES, unit="forecasts per episode and cut point")
    check_count("--min-context", args.min_context, 0, bounds.HORIZON, unit="latent frames of context")
    check_count("--seed", args.seed, 0, bounds.SEED, unit="the noise keeps 32 bits of it")
    check_count("the number of --cut-points", len(args.cut_points), 0, bounds.CUTS)
    for c in args.cut_points:
        check_count("--cut-points", c, 1, bounds.HORIZON, unit="latent frames of context")


def load_trained(config: Path, overrides: Sequence[str], source: Path) -> TrainConfig:
    """The config argument with ``--set`` ``overrides``, of the model the weights at ``source`` record
    (:func:`~flexpack.run.state.trained.recorded_model`): a run fine-tuned from a checkpoint of another shape than
    its preset samples in its own shape, and ``model.pretrained`` (which may have moved) is not read. Weights that
    record no model (older checkpoints): the config as it resolves."""
    from flexpack.run.state.trained import pinned, recorded_model

    record = recorded_model(source)
    if record is None:
        return load(config, overrides)
    return pinned(load(config, ['model.pretrained=""', *overrides]), record)


def check_trained_config(cfg: TrainConfig, source: Path, given: str) -> None:
    """A config (or ``--set``) that disagrees with what the weights at ``source`` were trained with is one line:
    sampling it would build another model or mask around the weights (:mod:`flexpack.run.state.trained`)."""
    from flexpack.run.state.trained import check_trained, run_config

    trained = run_config(source)
    check_trained(cfg, load_trained(trained, (), source), given_from=given, trained_from=trained, command="sample")


def run(args: argparse.Namespace) -> int:
    from flexpack.run.checks import resolve_device
    from flexpack.run.compose import compose
    from flexpack.run.cpu_threads import cpu_threads
    from flexpack.sampling.evaluate import PairPlan, build_pairs, checkpoint_stats, evaluate, table
    from flexpack.sampling.solver import SampleOptions, context_chunk, solver_steps

    check_flags(args)
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} is a file; sample writes its metrics and plots into a folder")
    if args.cut_points and args.mode == "rollout":
        raise ValueError("--cut-points applies to --mode forecast (a rollout starts from the first chunk)")
    source = args.checkpoint or args.config
    if args.checkpoint is None and not args.config.is_dir():
        raise ValueError(f"{args.config} is a config file: add --checkpoint RUN (a run, checkpoint or export folder) "
                         "for the weights")
    cfg = load_trained(args.config, args.overrides, Path(source))
    given = str(args.config) + (" with --set " + " ".join(args.overrides) if args.overrides else "")
    check_trained_config(cfg, Path(source), given)
    plan = PairPlan(mode=args.mode, cuts=args.cuts, horizon=args.horizon, cut_points=tuple(args.cut_points),
                    seed=args.seed, samples=args.samples, min_context=args.min_context,
                    foreign_history=args.foreign_history)
    if (Path(source) / "flexpack_config.json").is_file():  # a damaged export fails before the dataset is read
        check_export_files(Path(source), Path(source) / ("ema" if args.ema else ""))
    val = args.val or (args.episodes is None and bool(cfg.data.val_fraction or cfg.data.val_episodes))
    run = compose(cfg, "sample", episodes=args.episodes, val=val,
                  device=resolve_device(args.device) if args.device else None)
    context_chunk(run)  # a one-σ-per-episode model fails here, before any weights load
    steps = solver_steps(run, args.steps)
    pairs = build_pairs(run, plan)  # cut points and horizons that do not fit fail before any weights load
    model, saved, label = load_weights(run, source, ema=args.ema)
    action_stats = checkpoint_stats(run.dataset, saved, label)
    model.to(run.device)
    out = args.out or _default_out(Path(source), label, args.mode)
    options = SampleOptions(steps=steps, solver=args.solver)  # autocast: the run's (bf16 on CUDA only)
    with cpu_threads(cfg.runtime.cpu_threads, run.device, model):  # a tiny model: one thread, said so
        metrics, files = evaluate(model, run, plan, options, action_stats=action_stats, out=out, plots=args.plots,
                                  pairs=pairs)
    print(f"{label}: {metrics['mode']} of {len(metrics['episodes'])} episode(s), {metrics['pairs']} pair(s) x "
          f"{args.samples} sample(s), context >= {args.min_context} latent frames, horizon {metrics['horizon']}, "
          f"{steps} {args.solver} steps" + (", control: each pair from another episode's history"
                                              if args.foreign_history else ""))
    print(table(metrics))
    videos = len(list(out.glob("episode_*.mp4")))
    print(f"wrote {out / 'metrics.json'}" + (f", {len(files)} plot(s)" if files else "")
          + (f", {videos} video(s)" if videos else "") + (f" in {out}" if files or videos else ""))
    return 0

