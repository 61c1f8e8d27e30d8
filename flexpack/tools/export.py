"""``flexpack export RUN OUT``: a run's newest checkpoint as a folder the ecosystem loads.

``--format`` picks the layout among the formats the run's family can be written in (its registry entry's
``exports``, each with its writer): ``diffusers`` (WanVA: :mod:`flexpack.families.wan.export`, the layout
below) or ``lerobot`` (lingbot-va: a LeRobot ``lingbot_va`` policy folder,
:mod:`flexpack.families.lingbot.export_lerobot`) or ``lingbot-upstream``
(lingbot-va: upstream LingBot-VA's ``transformer/`` folder, :mod:`flexpack.families.lingbot.export_upstream`);
a run on a lingbot-bundle: :mod:`flexpack.families.lingbot.export_bundle` (its statistics through the family's
``export_normalization``).
Every format gets ``flexpack_config.json`` and ``export.json`` beside its own files.

``OUT`` (a new or empty folder, written under a temporary name and renamed when complete), ``diffusers``::

    config.json, diffusion_pytorch_model*.safetensors   the video transformer:
                                                        diffusers.WanTransformer3DModel.from_pretrained(OUT)
    action_stream.safetensors                           the action stream's weights (WanVA names)
    action_stream.json                                  its config: action channels and steps, the WanVA config
    normalization.json                                  how actions were normalized (invert it at inference)
    flexpack_config.json                                the checkpoint's training config (its own
                                                        config.json, with export's --set applied)
    ema/                                                with --ema: the EMA weights, the same layout
    README.md, lerobot_policy/                          model card; LeRobot-style policy folder
                                                        (:mod:`flexpack.tools.export_extras`)

``--push-to-hub REPO`` uploads the finished folder through ``huggingface_hub``.

The config and the action statistics come from the checkpoint itself (``config.json`` and
``train_state.json`` in its folder), so a run whose dataset moved still exports; the dataset is
read only for a checkpoint that carries no statistics. A damaged newest checkpoint is reported
and the one before it used; the step exported is printed. Files get ordinary permissions.
The weights come from :func:`flexpack.run.state.checkpoint.load` into a single-process model built on
the meta device (no random init), as ``flexpack verify --checkpoint`` loads them. Names and
shapes go back through the table of :mod:`flexpack.families.wan.convert` (the one used to load
diffusers checkpoints); :func:`flexpack.families.wan.export.load_export` reads a folder back into a WanVA.

``write_weights``, ``write_diffusers``, ``load_export`` and ``ACTION_FORMAT`` moved to
:mod:`flexpack.families.wan.export`; their old names here warn (a ``DeprecationWarning``) until flexpack 0.3.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from flexpack.data.normalization import ActionStats
    from flexpack.run.root import Run

def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: exists and is not empty; export writes into a new or empty folder")


def _normalization(run: Run, state: dict[str, Any], where: str = "the checkpoint",
                   dataset: str | None = None) -> tuple[ActionStats, dict[str, Any]]:
    """The action normalization of ``run`` (the checkpoint's ``"export"`` run): the statistics the weights were
    trained with from the checkpoint where it carries them (``extra.action_normalizer``), else
    ``data.action_stats``'s (what LatentEpisodeDataset used); and ``normalization.json``'s record, those statistics
    with the dataset's layout (columns, channels).
    A family that reads its own data layout decides first (``export_normalization``; ``dataset``: ``--dataset``,
    e.g. a lingbot-va mixture's entry, whose own statistics and channels it gives)."""
    from flexpack.data import action_stats, cache
    from flexpack.data.actions import ActionNormalizer, channel_map
    from flexpack.data.episodes import EpisodeSource
    from flexpack.data.normalization import ActionStats
    from flexpack.run.state.resume import saved_stats

    cfg = run.config
    family_rule = run.family.export_normalization  # e.g. a lingbot-va run on a lingbot-bundle
    if family_rule is not None and (family_stats := family_rule(run, state, where, dataset)) is not None:
        return family_stats
    saved = saved_stats(state, where)
    key = "action"
    conv = run.family.conventions(run.model_config)  # the family's action width and channels
    placed = None if conv.action_channels is None else list(conv.action_channels)
    if saved is not None:  # the statistics the weights were trained with: no dataset needed (it may have moved)
        stats = saved
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
            found = action_stats.feature_stats(source, latents, key, getattr(cfg.data, "action_stats", "pooled"))
            norm = ActionNormalizer.from_stats(found, columns, key)
        stats = ActionStats.of(norm)
    record = {"action_key": key, **stats.to_json(), "columns": stats.columns,
              "channels": channel_map(stats.columns, conv.action_dim, placed).tolist(),
              "action_steps": cfg.data.action_steps, "stride": cfg.data.stride, "dataset": str(cfg.data.root),
              "formula": {"quantile": "2 (x - low) / (high - low) - 1, clipped to [-1, 1]",
                          "meanstd": "(x - low) / high", "none": "x"}[stats.mode]}
    return stats, record


def export_run(run: str | os.PathLike, out: str | os.PathLike, *, ema: bool = False,
               dtype: torch.dtype = torch.float32, overrides: Sequence[str] = (), policy: bool = True,
               fmt: str | None = None, wan_pretrained_path: str | None = None, allow_unrunnable: bool = False,
               dataset: str | None = None, adapter: str | os.PathLike | None = None) -> Path:
    """Export ``run``'s newest intact checkpoint into ``out`` in ``fmt`` (default: the family's first export
    format; ``diffusers`` is the module docstring's layout, ``lerobot``
    :mod:`flexpack.families.lingbot.export_lerobot`'s, ``lingbot-upstream``
    :mod:`flexpack.families.lingbot.export_upstream`'s); returns ``out``. ``overrides`` (``--set``) apply to
    the checkpoint's own config; ``allow_unrunnable``: write a ``lerobot`` export that LeRobot could not run as
    trained (stand-in encoders, other widths) with a warning; ``dataset``: a bundle run's dataset whose cameras the
    export describes (a mixture's entry, or ENTRY/DATASET: also its statistics and action channels);
    ``adapter``: a LoRA run's adapters also go there, as a peft adapter folder
    (:func:`flexpack.run.lora.write_adapter`; ``OUT`` gets the merged weights either way)."""
    from flexpack.atomic import write_failure
    from flexpack.errors import UserError
    from flexpack.run.config import save_config
    from flexpack.run.state.locate import load_newest
    from flexpack.tools.export_io import ExportJob, ExportOptions, export_format, ordinary_modes, remove_stale
    from flexpack.tools.export_io import load_checkpoint as _load

    run, out = Path(run), Path(out)
    adapter = None if adapter is None else Path(adapter)
    _check_out(out)
    if adapter is not None:
        _check_out(adapter)
        if adapter.resolve() == out.resolve():
            raise ValueError(f"--adapter {adapter}: the adapter folder must be another folder than OUT")
    options = ExportOptions(fmt=fmt, dtype=dtype, ema=ema, policy=policy, wan_pretrained_path=wan_pretrained_path,
                            allow_unrunnable=allow_unrunnable, dataset=dataset, adapter=adapter)
    found, (composed, model, averaged, state, adapters) = load_newest(run, "export",
                                                                 lambda f: _load(f, run, ema, overrides, options))
    if adapter is not None and adapters is None:
        raise ValueError(f"--adapter {adapter}: {found} holds no LoRA adapters (trained without LoRA); export without "
                         "--adapter")
    fmt, writer, _ = export_format(composed, options, found)
    stats, norm = _normalization(composed, state, str(found / "train_state.json"), dataset)
    job = ExportJob(run=run, found=found, composed=composed, model=model, averaged=averaged, state=state, stats=stats,
                    norm=norm, options=options)
    print(f"export: checkpoint {found} (step {job.step}, format {fmt})", file=sys.stderr)

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(out)
        tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as exc:
        raise ValueError(f"{out}: cannot write the export there ({exc.strerror or exc}); choose another OUT") from None
    try:
        writer(job, tmp)
        save_config(composed.config, tmp / "flexpack_config.json")
        (tmp / "export.json").write_text(json.dumps(
            {"run": str(run), "checkpoint": str(found), "step": job.step, "ema": ema, "format": fmt}, indent=2) + "\n")
        ordinary_modes(tmp)
        if adapter is not None:
            _write_adapter(adapter, adapters)
        if out.exists():
            out.rmdir()  # empty (checked above): the rename needs the name free
        os.replace(tmp, out)
    except Exception as exc:  # a full disk shows as OSError, safetensors' IoError, torch's short write, ...
        why = write_failure(exc)
        if why is None:
            raise
        raise UserError(f"{out}: cannot write the export ({why}); nothing was written there (its temporary folder "
                        f"is removed); free space under {out.parent} or choose another OUT, and run again") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_adapter(folder: Path, adapters: Any) -> None:
    """The adapters as a peft adapter folder at ``folder`` (new or empty), written under a temporary name first."""
    from flexpack.run.lora import write_adapter
    from flexpack.tools.export_io import ordinary_modes

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".tmp-{folder.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_adapter(tmp, adapters.state, adapters.config)
        ordinary_modes(tmp)
        if folder.exists():
            folder.rmdir()  # empty (checked before anything was read)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"export: LoRA adapters -> {folder} (peft: PeftModel.from_pretrained(base_model, {str(folder)!r}))",
          file=sys.stderr)


_MOVED = ("ACTION_FORMAT", "load_export", "write_diffusers", "write_weights")  # to flexpack.families.wan.export


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    import warnings

    warnings.warn(f"flexpack.tools.export.{name} is deprecated: it moved to flexpack.families.wan.export; import it "
                  "from there (the old path goes in flexpack 0.3)", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module("flexpack.families.wan.export"), name)
