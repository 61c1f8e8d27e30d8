"""Reading a run's checkpoint for ``export``, and writing files others can read.

- :func:`export_format`: the format ``flexpack export`` writes (``--format``): the family's registry entry holds
  the formats it can be written in (``exports``: :class:`~flexpack.models.registry.ExportFormat`, each with its
  writer, its check and the package it needs).
- :class:`ExportJob`: what a writer gets (the loaded checkpoint, its composed export run and the command's
  options).
- :func:`load_checkpoint`: the checkpoint's own ``config.json`` (not the run's first one: a run
  started over with another model keeps the first) with ``--set`` overrides, and a
  single-process model of the run's family (and EMA) holding its weights.
- :func:`ordinary_modes`, :func:`remove_stale`: exported files readable by teammates (safetensors
  writes 0600), and the ``.tmp-OUT-PID`` folders of killed exports removed.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

if TYPE_CHECKING:
    from flexpack.data.normalization import ActionStats
    from flexpack.run.root import Run


@dataclass(frozen=True, kw_only=True)
class ExportOptions:
    """The command's choices: the format (None: the family's first), the weights' dtype, ``--ema``, the
    diffusers export's policy folder (``--no-policy``), the LeRobot export's ``wan_pretrained_path``, whether it
    may be written where LeRobot could not run it as trained (``--allow-unrunnable``), for a run on a
    lingbot-bundle, the dataset whose cameras an export describes (``--dataset``; a mixture's entry: also its
    statistics and action channels) and, for a LoRA run, a folder to
    write its adapters to as a peft adapter folder (``--adapter``)."""

    fmt: str | None = None
    dtype: torch.dtype = torch.float32
    ema: bool = False
    policy: bool = True
    wan_pretrained_path: str | None = None
    allow_unrunnable: bool = False

    dataset: str | None = None
    adapter: Path | None = None  # --adapter: also write the LoRA adapters as a peft adapter folder there


@dataclass(frozen=True, kw_only=True)
class ExportJob:
    """A loaded checkpoint to write: the run folder, the checkpoint folder, ``composed``: its config composed for
    ``"export"`` (:func:`flexpack.run.compose.compose`: the config, the family, the model config), the model (and EMA)
    holding its weights, its ``train_state.json``, the action statistics the weights were trained with, ``norm``: those
    statistics with the dataset's layout as ``normalization.json`` records them, and the options."""

    run: Path
    found: Path
    composed: Run
    model: torch.nn.Module
    averaged: Any
    state: dict[str, Any]
    stats: ActionStats
    norm: dict[str, Any]
    options: ExportOptions

    @property
    def step(self) -> int:
        return int(self.state["step"])


def export_format(run: Run, options: ExportOptions, where: Path | str) -> tuple[str, Callable[..., Any], str]:
    """(format, its writer, its load hint) for a checkpoint composed as ``run`` (its ``"export"`` run): ``options.fmt``
    or the family's first format; one line for a format the family cannot be written in or flexpack does not
    write, for options that do not apply to it, for a package it needs that is missing and for a config the
    format cannot represent (the format's check), all before any weight is read."""
    fam, cfg = run.family, run.config
    formats = list(fam.export_formats)
    fmt = options.fmt or (formats[0] if formats else None)
    if fmt not in formats:
        raise ValueError(f"{where}: a model.family = {cfg.model.family!r} checkpoint exports as "
                         f"{formats}, not --format {fmt!r}")
    spec = fam.exports[fmt]
    _check_format_options(options, fmt, spec.options)
    if options.dataset is not None:
        from flexpack.data.formats import is_bundle

        if not is_bundle(cfg.data):
            raise ValueError(f"--dataset applies to a run on a lingbot-bundle (the bundle's dataset an export "
                             f"describes), not to one on {cfg.data.root!r}")
    if options.adapter is not None and not cfg.lora.rank:
        raise ValueError(f"--adapter {options.adapter}: {where} was trained without LoRA (lora.rank = 0): it has no "
                         "adapters to write; export without --adapter")
    if spec.package:
        try:
            importlib.import_module(spec.package)
        except ImportError:
            raise ValueError(f"flexpack export --format {fmt} needs {spec.package}: pip install "
                             f"'flexpack[{spec.extra}]'") from None
    if spec.check is not None:
        spec.check(run, options)
    return fmt, spec.writer, spec.load


# the options only some formats take (ExportFormat.options): field -> (its flag, whether the command gave it)
FORMAT_OPTIONS: dict[str, tuple[str, Callable[[ExportOptions], bool]]] = {
    "wan_pretrained_path": ("--wan-pretrained-path", lambda o: o.wan_pretrained_path is not None),
    "allow_unrunnable": ("--allow-unrunnable", lambda o: o.allow_unrunnable),
    "policy": ("--no-policy", lambda o: not o.policy),
}


def _check_format_options(options: ExportOptions, fmt: str, takes: Mapping[str, str]) -> None:
    """One line for an option given that the format ``fmt`` does not take, naming the formats that do."""
    from flexpack.models.registry import families, family

    for name, (flag, given) in FORMAT_OPTIONS.items():
        if given(options) and name not in takes:
            takers = [f"--format {f} ({e.options[name]})" for n in families()
                      for f, e in family(n).exports.items() if name in e.options]
            raise ValueError(f"{flag} applies to {' or '.join(takers) or 'no format'}, not to the {fmt!r} export")


def load_checkpoint(
    found: Path, run: Path, ema: bool, overrides: Sequence[str], options: ExportOptions | None = None
) -> tuple[Any, Any, Any, dict[str, Any], Any]:
    """The checkpoint's config (its own config.json, else the run's first) with ``overrides``, composed for
    ``"export"``, and a single-process model of its family (and EMA) with its weights; returns (the composed run, model,
    ema or None,
    train_state, adapters). A LoRA checkpoint's adapters are merged into the model (float32) and also returned
    (:class:`~flexpack.run.lora.Adapters`; None without LoRA). The export format (``options``) is checked against
    the family before any weight is read."""
    from flexpack.run import lora
    from flexpack.run.compose import compose
    from flexpack.run.config import load_config
    from flexpack.run.state import checkpoint
    from flexpack.run.state.trained import run_config, saved_lora
    from flexpack.training.ema import EMA

    source = run_config(run, found)
    if ema and not checkpoint.has_ema(found):
        raise ValueError(f"{found}: holds no EMA weights (trained with optim.ema_decay = 0); export without --ema")
    composed = compose(load_config(source, overrides), "export", device=torch.device("cpu"))  # resolved once
    export_format(composed, options or ExportOptions(ema=ema), found)
    cfg = composed.config
    with torch.device("meta"):
        model = composed.family.build(composed.model_config)
        record = saved_lora(found)
        if record is not None:  # a LoRA run's structure, its adapters merged below
            lora.apply(model, cfg, record=record, cast=False)
    model.to_empty(device="cpu")  # every tensor is overwritten by the checkpoint (float32: the merge is too)
    averaged = EMA(model, 0.5) if ema else None  # the decay is irrelevant: only loaded, never updated
    state = checkpoint.load(found, model, restore_rng=False, ema=averaged)
    adapters = None
    if record is not None:
        adapters = lora.Adapters(config=lora.peft_config(cfg, record), state=lora.adapter_state(model))
        lora.merge(model)  # the names and tensors of a run without LoRA: every format writes them as it is
    return composed, model, averaged, state, adapters


def ordinary_modes(folder: Path) -> None:
    """Files ``0666`` and folders ``0777`` minus the umask: safetensors writes its files private (0600)."""
    from flexpack.atomic import _umask

    mask = _umask()
    for p in [folder, *folder.rglob("*")]:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def remove_stale(out: Path) -> None:
    """Remove ``.tmp-OUT-PID`` folders of exports that were killed (their PID no longer runs here)."""
    from flexpack.atomic import remove_dead_temporaries

    for p in remove_dead_temporaries(out.parent, f".tmp-{out.name}-*"):
        print(f"export: removed {p} (a killed export)", file=sys.stderr)
