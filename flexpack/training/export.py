"""``flexpack export RUN OUT``: a run's newest checkpoint as a folder the ecosystem loads.

``OUT`` (a new or empty folder, written under a temporary name and renamed when complete)::

    config.json, diffusion_pytorch_model*.safetensors   the video transformer:
                                                        diffusers.WanTransformer3DModel.from_pretrained(OUT)
    action_stream.safetensors                           the action stream's weights (WanVA names)
    action_stream.json                                  its config: action channels and steps, the WanVA config
    normalization.json                                  how actions were normalized (invert it at inference)
    flexpack_config.json                                the checkpoint's training config (its own
                                                        config.json, with export's --set applied)
    ema/                                                with --ema: the EMA weights, the same layout
    README.md, lerobot_policy/                          model card; LeRobot-style policy folder
                                                        (:mod:`flexpack.training.export_extras`)

``--push-to-hub REPO`` uploads the finished folder through ``huggingface_hub``.

The config and the action statistics come from the checkpoint itself (``config.json`` and
``train_state.json`` in its folder), so a run whose dataset moved still exports; the dataset is
read only for a checkpoint that carries no statistics. A damaged newest checkpoint is reported
and the one before it used; the step exported is printed. Files get ordinary permissions.
The weights come from :func:`flexpack.training.runstate.checkpoint.load` into a single-process model built on
the meta device (no random init), as ``flexpack verify --checkpoint`` loads them. Names and
shapes go back through the table of :mod:`flexpack.models.wan_convert` (the one used to load
diffusers checkpoints); :func:`load_export` reads a folder back into a :class:`WanVA`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from flexpack.models.wan_config import LEGACY_ACTION_POSITIONS, WanVAConfig

ACTION_FORMAT = "flexpack-action-stream-v1"


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: exists and is not empty; export writes into a new or empty folder")


def _normalization(cfg: Any, state: dict[str, Any]) -> dict[str, Any]:
    """The action normalization of the run: the dataset's layout (columns, channels) from its
    metadata, the statistics the weights were trained with from the checkpoint where it carries them
    (``extra.action_normalizer``), else ``data.action_stats``'s (what LatentEpisodeDataset used)."""
    saved = (state.get("extra") or {}).get("action_normalizer")
    from flexpack.data import action_stats, cache
    from flexpack.data.actions import ActionNormalizer, channel_map
    from flexpack.data.episodes import EpisodeSource

    key = "action"
    action_dim = max(cfg.model.wan_config().action_channels, 1)
    if saved:  # the statistics the weights were trained with: no dataset needed (it may have moved)
        mode, low, high = saved["mode"], list(saved["low"]), list(saved["high"])
        columns = len(low)
    else:
        try:
            source = EpisodeSource(cfg.data.root)
        except (OSError, ValueError) as exc:
            raise ValueError(f"the checkpoint carries no action statistics and data.root = {cfg.data.root!r} cannot be "
                             f"read ({exc}); pass --set data.root=DATASET") from None
        columns = int(torch.Size(source.meta.features[key]["shape"]).numel())
        norm = ActionNormalizer.identity(columns)
        if cfg.data.normalize:  # the statistics the dataset used (data.action_stats)
            latents = cfg.data.latents_dir or cache.default_latents_dir(source.root)
            stats = action_stats.feature_stats(source, latents, key, getattr(cfg.data, "action_stats", "pooled"))
            norm = ActionNormalizer.from_stats(stats, columns, key)
        mode, low, high = norm.mode, norm.low.tolist(), norm.high.tolist()
    return {"action_key": key, "mode": mode, "low": low, "high": high,
            "columns": columns, "channels": channel_map(columns, action_dim, None).tolist(),
            "action_steps": cfg.data.action_steps, "stride": cfg.data.stride, "dataset": str(cfg.data.root),
            "formula": {"quantile": "2 (x - low) / (high - low) - 1, clipped to [-1, 1]",
                        "meanstd": "(x - low) / high", "none": "x"}[mode]}


def write_weights(folder: Path, state_dict: dict[str, torch.Tensor], wcfg: WanVAConfig, *, action_steps: int,
                  dtype: torch.dtype = torch.float32, max_shard_size: str | int = "10GB") -> None:
    """A WanVA state dict as a diffusers WanTransformer3DModel folder plus the action-stream files."""
    try:
        from diffusers import WanTransformer3DModel
    except ImportError as exc:
        raise ImportError("flexpack export needs diffusers: pip install 'flexpack[hf]'") from exc
    from safetensors.torch import save_file

    from flexpack.models.wan_convert import config_to_diffusers, to_diffusers_state_dict

    video, action = to_diffusers_state_dict({k: v.to(dtype) for k, v in state_dict.items()}, wcfg)
    with torch.device("meta"):  # no random init: the tensors are adopted below
        dm = WanTransformer3DModel(**config_to_diffusers(wcfg))
    dm.load_state_dict(video, strict=True, assign=True)
    dm.save_pretrained(folder, safe_serialization=True, max_shard_size=max_shard_size)
    if action:
        save_file({k: v.contiguous() for k, v in action.items()}, str(folder / "action_stream.safetensors"),
                  metadata={"format": ACTION_FORMAT})
    info = {"format": ACTION_FORMAT, "action_channels": wcfg.action_channels, "action_steps": action_steps,
            "dim": wcfg.dim, "weights": sorted(action), "wanva_config": asdict(wcfg)}
    (folder / "action_stream.json").write_text(json.dumps(info, indent=2) + "\n")


def export_run(run: str | os.PathLike, out: str | os.PathLike, *, ema: bool = False,
               dtype: torch.dtype = torch.float32, overrides: Sequence[str] = (), policy: bool = True) -> Path:
    """Export ``run``'s newest intact checkpoint into ``out`` (see the module docstring); returns ``out``.
    ``overrides`` (``--set``) apply to the checkpoint's own config."""
    from flexpack.training.config import save_config
    from flexpack.training.export_io import load_checkpoint as _load
    from flexpack.training.export_io import ordinary_modes, pick_checkpoint, remove_stale

    run, out = Path(run), Path(out)
    _check_out(out)
    for attempt in range(3):  # a pruning run may rename the chosen checkpoint away meanwhile: take the next
        found = pick_checkpoint(run, "export")
        try:
            cfg, model, averaged, state = _load(found, run, ema, overrides)
            break
        except (FileNotFoundError, ValueError):
            if found.exists() or attempt == 2:
                raise
            print(f"export: {found} was pruned while reading it; taking the newest again", file=sys.stderr)
    wcfg = cfg.model.wan_config()
    norm = _normalization(cfg, state)
    print(f"export: checkpoint {found} (step {int(state['step'])})", file=sys.stderr)

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(out)
        tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as exc:
        raise ValueError(f"{out}: cannot write the export there ({exc.strerror or exc}); choose another OUT") from None
    try:
        write_weights(tmp, model.state_dict(), wcfg, action_steps=cfg.data.action_steps, dtype=dtype)
        if averaged is not None:
            (tmp / "ema").mkdir()
            write_weights(tmp / "ema", averaged.full_state_dict(), wcfg, action_steps=cfg.data.action_steps,
                          dtype=dtype)
        (tmp / "normalization.json").write_text(json.dumps(norm, indent=2) + "\n")
        save_config(cfg, tmp / "flexpack_config.json")
        from flexpack.training.export_extras import write_extras

        write_extras(tmp, run=run, cfg=cfg, wcfg=wcfg, state_dict=model.state_dict(), norm=norm,
                     step=int(state["step"]), ema=ema, dtype=dtype, policy=policy)
        (tmp / "export.json").write_text(json.dumps(
            {"run": str(run), "checkpoint": str(found), "step": int(state["step"]), "ema": ema}, indent=2) + "\n")
        ordinary_modes(tmp)
        if out.exists():
            out.rmdir()  # empty (checked above): the rename needs the name free
        os.replace(tmp, out)
    except OSError as exc:
        raise ValueError(f"{out}: cannot write the export ({exc.strerror or exc}); nothing was written there") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_export(folder: str | os.PathLike, *, attn: Any = None) -> torch.nn.Module:
    """A :class:`WanVA` from an exported folder (or its ``ema/``): the diffusers weights plus the action stream."""
    from safetensors.torch import load_file

    from flexpack.models import WanVA

    folder = Path(folder)
    info_file = folder / "action_stream.json"
    if not info_file.is_file():
        raise FileNotFoundError(f"{info_file}: missing; not a flexpack export folder")
    info = json.loads(info_file.read_text())
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in info["wanva_config"].items()}
    kw.setdefault("action_positions", LEGACY_ACTION_POSITIONS)  # exported before the rule was recorded
    wcfg = WanVAConfig(**kw)
    model = WanVA.from_diffusers_file(str(folder), wcfg, attn=attn)
    if info["weights"]:
        action = load_file(folder / "action_stream.safetensors")
        missing = sorted(set(info["weights"]) - set(action))
        if missing:
            raise ValueError(f"{folder / 'action_stream.safetensors'}: lacks {missing}")
        with torch.no_grad():
            for name, t in action.items():
                model.get_parameter(name).copy_(t)
    return model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", type=Path, help="run folder (runtime.out_dir of flexpack train)")
    parser.add_argument("out", type=Path, help="new or empty folder to write")
    parser.add_argument("--ema", action="store_true", help="also write the EMA weights (OUT/ema/, same layout)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of the exported weights")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a value of the checkpoint's config, e.g. --set data.root=DATASET (repeatable)")
    parser.add_argument("--no-policy", action="store_true",
                        help="skip the LeRobot-style policy folder (OUT/lerobot_policy)")
    parser.add_argument("--push-to-hub", metavar="REPO", default=None,
                        help="upload OUT to this Hugging Face model repo (org/name) once written")
    parser.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")


def run(args: argparse.Namespace) -> int:
    from flexpack.errors import UserError, one_line

    try:
        import diffusers  # noqa: F401  (checked before any work: the diffusers folder is the export's core)
    except ImportError:
        raise UserError("flexpack export needs diffusers: pip install 'flexpack[hf]'") from None
    if args.push_to_hub:
        try:
            import huggingface_hub  # noqa: F401
        except ImportError:
            raise UserError("--push-to-hub needs huggingface_hub: pip install 'flexpack[hub]'") from None
    out = export_run(args.run, args.out, ema=args.ema, dtype=getattr(torch, args.dtype), overrides=args.overrides,
                     policy=not args.no_policy)
    print(f"exported {args.run} -> {out} (load: diffusers.WanTransformer3DModel.from_pretrained({str(out)!r}); "
          f"model card {out / 'README.md'})")
    if args.push_to_hub:
        from flexpack.training.export_extras import push_to_hub

        try:
            where = push_to_hub(out, args.push_to_hub, private=args.private)
        except Exception as exc:  # network, auth, offline mode: the export itself is complete
            raise UserError(f"{out} is exported, but the upload to {args.push_to_hub} failed ({type(exc).__name__}: "
                            f"{one_line(exc)}); retry with: python -c \"from flexpack.training.export_extras import "
                            f"push_to_hub; push_to_hub('{out}', '{args.push_to_hub}')\" (HF_HUB_OFFLINE unset, "
                            "logged in with hf auth login)") from exc
        print(f"pushed {out} -> {args.push_to_hub}: {where}")
    return 0
