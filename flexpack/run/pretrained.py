"""``model.pretrained``: start training from a checkpoint of the model's family (WanVA: a diffusers
``WanTransformer3DModel`` checkpoint; each family reads its own layout). What a checkpoint's files, config
and tensors mean is the family's (:mod:`flexpack.models.registry`: ``checkpoint_files``,
``read_checkpoint_config``, ``shape_fields``, ``checkpoint_defaults``, ``convert_tensor``, ``fresh_tensors``,
``load_checkpoint``); this module reads the files and fills the model.

Shape. A folder (or a ``.safetensors`` file with a ``config.json`` beside it; a diffusers pipeline
folder stands for its ``transformer/``) defines the shape:
its config replaces the preset's shape fields, while the preset and ``model.overrides`` still give
the options a video checkpoint cannot know (``action_channels``, ``attn_backend``, activation
checkpointing). The family's ``checkpoint_defaults`` (training fields a checkpoint's config records, such as the
action channels and cameras a policy was trained with) come from the checkpoint's config where it has them and
``model.overrides`` does not set them. An override of a shape field that contradicts the checkpoint is an
error naming both values. A lone ``.safetensors`` file without config.json takes the config's shape and is
checked tensor by tensor.

Loading. One process: :meth:`WanVA.from_diffusers_file` (built on the meta device, adopting the
checkpoint's tensors; only the action stream is initialized), then cast to float32 master
weights on the current default device. Several ranks (FSDP2): :func:`build_model` returns the
model on the meta device; after ``fully_shard`` :func:`load_pretrained` allocates each rank's
shards only (``to_empty``) and streams the checkpoint tensor by tensor from the memory-mapped
safetensors files, each rank copying just its slice (``distribute_tensor(...,
src_data_rank=None)`` slices locally, no communication). No rank holds more than one full tensor
at a time; the action stream is drawn the same way on every rank from the run seed and sliced
likewise, so a sharded start equals a single-process start.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from flexpack.models.registry import ModelFamily, ModelShape, family
from flexpack.parallel.parallelize import plain_name
from flexpack.run.state.finite import first_nonfinite, nonfinite


def transformer_path(path: str | os.PathLike) -> str:
    """``path``, or its ``transformer/`` folder when ``path`` is a diffusers pipeline folder."""
    sub = Path(path) / "transformer"
    return str(sub) if (sub / "config.json").is_file() else os.fspath(path)


def checkpoint_files(path: str | os.PathLike, family: ModelFamily) -> tuple[list[str], str | None]:
    """Weight files and config.json of ``model.pretrained`` as the family lays its checkpoints out
    (FileNotFoundError naming the path)."""
    if family.checkpoint_files is None:
        raise ValueError(f"model.pretrained: the {family.name} family cannot load checkpoints")
    try:
        return family.checkpoint_files(transformer_path(path))
    except ValueError as exc:
        raise FileNotFoundError(f"model.pretrained: {exc}") from None


def check_headers(files: list[str], fix: str = "") -> None:
    """Each weight file opens as safetensors (its header only is read, and the file must cover the tensors it
    lists: a file cut short fails): garbage fails here, in one line, not deep in a model build after the data
    is loaded. ``fix``: what to do, appended to the message."""
    from safetensors import safe_open

    for fn in files:
        try:
            with safe_open(fn, framework="pt") as f:
                f.keys()
        except Exception as exc:  # SafetensorError is no ValueError; every failure here is the file's
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ValueError(f"{fn}: not a readable safetensors file ({why})" + (f"; {fix}" if fix else "")) from None


def pretrained_config(path: str, base: Any, overrides: Mapping[str, Any], family: ModelFamily) -> Any:
    """``base`` (preset + overrides) with the checkpoint's shape; ValueError on a contradicting override."""
    from dataclasses import replace

    files, cfg_path = checkpoint_files(path, family)
    check_headers(files)
    if cfg_path is None or family.read_checkpoint_config is None:
        return base  # a bare .safetensors file: the config's shape, checked against every tensor on load
    raw = json.loads(Path(cfg_path).read_text())
    try:
        ckpt = family.read_checkpoint_config(raw)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{cfg_path}: not a checkpoint config of the {family.name} family: {exc}") from None
    for name in family.shape_fields:
        if name not in overrides:
            continue
        mine, theirs = getattr(base, name), getattr(ckpt, name)
        if name == "out_channels":
            mine, theirs = base.out_dim, ckpt.out_dim
        if mine != theirs:
            raise ValueError(f"model.overrides.{name}={overrides[name]!r} but {cfg_path} has {name}={theirs!r}")
    # what the checkpoint was trained with (LeRobot: action channels, cameras ...) where the config leaves it open
    kept = {name: getattr(ckpt, name) for name in family.checkpoint_defaults if name in raw and name not in overrides}
    return replace(base, **{name: getattr(ckpt, name) for name in family.shape_fields}, **kept)


def _nonfinite_weight(path: str, fn: str, key: str, what: str) -> ValueError:
    return ValueError(f"model.pretrained = {path!r}: {fn}: weight {key!r} holds non-finite values ({what}); the "
                      "checkpoint itself is damaged (training from it fails at its first step, whatever the "
                      "learning rate): use an intact copy")


def _check_finite_weights(path: str, family: ModelFamily, model: nn.Module) -> None:
    """Name the checkpoint's first non-finite tensor (file and key) when the loaded ``model`` holds one: the
    model is checked in memory, the files are read again only to name it."""
    from safetensors import safe_open

    found = first_nonfinite(dict(model.named_parameters()))
    if found is None:
        return
    for fn in checkpoint_files(path, family)[0]:
        with safe_open(fn, framework="pt") as f:
            for key in f.keys():
                what = nonfinite(f.get_tensor(key))
                if what is not None:
                    raise _nonfinite_weight(path, fn, key, what)
    raise _nonfinite_weight(path, "the loaded model", found[0], found[1])  # not in a file: made so by the load


def field_source(model: Any, name: str) -> str:
    """Where the resolved model config's field ``name`` got its value, as a user finds it: the override that set
    it (``model.overrides.KEY``, an alias included), ``model.pretrained``'s config.json (a shape field, or a
    training field the checkpoint records), else the preset. ``model``: a :class:`~flexpack.run.config.ModelConfig`."""
    fam = family(model.family)
    for key in model.overrides:
        alias = fam.aliases.get(key, key)
        if (alias if isinstance(alias, str) else alias.field) == name:
            return f"model.overrides.{key}"
    if model.pretrained and fam.checkpoint_files is not None:
        _, cfg_path = checkpoint_files(model.pretrained, fam)
        if cfg_path is not None and (name in fam.shape_fields or (
                name in fam.checkpoint_defaults and name in json.loads(Path(cfg_path).read_text()))):
            return f"model.pretrained's config.json, {cfg_path}"
    return f"model.preset = {model.preset!r}"


def check_camera_layout(pretrained: str, family: ModelFamily, data_layout: str, bundle: str | None = None) -> None:
    """The camera composition ``model.pretrained``'s config records (the family's ``checkpoint_layout``) against
    the composition of the run's data, ``data_layout``: ``"width_concat"`` for a latent cache (``bundle`` None),
    which joins cameras on width; for the bundle at ``bundle``, how it composes them (``"width_concat"`` or
    ``"tshape"``, upstream's T); one line
    naming both where they differ. Nothing to check without a checkpoint, a recorded layout or its config (a
    checkpoint that moved since: the weights come from the run's own checkpoints then)."""
    if not pretrained or family.checkpoint_layout is None or family.checkpoint_files is None:
        return
    try:
        _, cfg_path = family.checkpoint_files(transformer_path(pretrained))
        raw = json.loads(Path(cfg_path).read_text()) if cfg_path else None
    except (OSError, ValueError):
        return
    theirs = family.checkpoint_layout(raw) if isinstance(raw, dict) else None
    if theirs is None or theirs == data_layout:
        return
    if bundle is None:
        raise ValueError(f"{cfg_path}: camera_layout {raw['camera_layout']!r}; flexpack's latent cache joins cameras "
                         f"on width ({data_layout!r}) only")
    raise ValueError(f"{cfg_path}: camera_layout {raw['camera_layout']!r} (cameras composed as {theirs!r}), but the "
                     f"bundle {bundle} composes them as {data_layout!r}; start from a checkpoint of that layout, or "
                     "set data.camera_layout where the cameras' latent grids compose both ways")


def load_single(family: ModelFamily, path: str, model_cfg: ModelShape, seed: int) -> nn.Module:
    """The whole model in one process: float32 on the current default device (``model_cfg``: the family's
    resolved model config, e.g. a ``WanVAConfig``); a non-finite weight is named, before any step."""
    if family.load_checkpoint is None:
        raise ValueError(f"model.pretrained: the {family.name} family cannot load checkpoints")
    torch.manual_seed(seed)  # the fresh tensors' init (WanVA: the action stream)
    model = family.load_checkpoint(transformer_path(path), model_cfg)
    _check_finite_weights(path, family, model)
    return model.to(device=torch.get_default_device(), dtype=torch.float32)


@torch.no_grad()
def _copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``full`` into ``param``, or into this rank's slice of it when ``param`` is a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


def load_pretrained(model: nn.Module, path: str, model_cfg: ModelShape, family: ModelFamily, *, device: torch.device,
                    seed: int) -> None:
    """Fill a (sharded) model built on the meta device from the checkpoint at ``path``, slice by slice."""
    from safetensors import safe_open

    convert_tensor = family.convert_tensor
    if convert_tensor is None:
        raise ValueError(f"model.pretrained: the {family.name} family cannot load checkpoints")
    files, _ = checkpoint_files(path, family)
    model.to_empty(device=device)  # FSDP2 allocates only each rank's shards
    from flexpack.run.lora import base_name, is_adapter

    # a LoRA model (flexpack.run.lora): its base layers take the checkpoint's tensors, its adapters start fresh
    params = {base_name(plain_name(n)): p for n, p in model.named_parameters() if not is_adapter(n)}
    filled: set[str] = set()
    for fn in files:
        with safe_open(fn, framework="pt") as f:  # memory-mapped: one tensor read at a time
            for key in f.keys():
                conv = convert_tensor(key, f.get_tensor(key))
                if conv is None or conv[0] not in params:
                    raise ValueError(f"{fn}: weight {key!r} has no counterpart in the model")
                name, t = conv
                what = nonfinite(t)  # every rank reads the whole tensor: all raise here, or none
                if what is not None:
                    raise _nonfinite_weight(path, fn, key, what)
                if tuple(t.shape) != tuple(params[name].shape):
                    raise ValueError(f"{fn}: weight {key!r} has shape {tuple(t.shape)}, the model's {name} "
                                     f"{tuple(params[name].shape)}")
                _copy_into(params[name], t)
                filled.add(name)
    torch.manual_seed(seed)  # the same draws as load_single: a sharded start equals a single-process one
    for name, t in family.fresh_tensors(model_cfg).items():
        _copy_into(params[name], t)
        filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"model.pretrained={path}: the checkpoint lacks weights {missing[:8]}")
    for name, buf in model.named_buffers():  # the families have none today; a new one must not stay uninitialized
        raise ValueError(f"load_pretrained cannot initialize buffer {name!r}")


def loaded_note(path: str, model_cfg: ModelShape, family: ModelFamily, model: nn.Module) -> str:
    """The start line of a run from ``model.pretrained`` (after a load, which is strict: every checkpoint tensor
    filled a tensor of the model): the weights read, the shape they gave and how many tensors matched.
    Counts come from the safetensors headers and the model's parameters (under FSDP2 their global shapes)."""
    from safetensors import safe_open

    files, cfg_path = checkpoint_files(path, family)
    loaded = 0
    for fn in files:
        with safe_open(fn, framework="pt") as f:  # the header only
            loaded += len(list(f.keys()))
    params = [p for _, p in model.named_parameters()]
    total, numel = len(params), sum(p.numel() for p in params)
    fresh = total - loaded
    shape = (f"dim {model_cfg.dim} ({model_cfg.num_heads} heads x {model_cfg.head_dim}), {model_cfg.num_layers} "
             f"layers, ffn {model_cfg.ffn_dim}, {model_cfg.in_channels} latent channels, text {model_cfg.text_dim}; "
             f"{numel / 1e6:,.2f}M parameters")
    where = f"{len(files)} safetensors file{'s' if len(files) != 1 else ''}" + (
        f", shape from {cfg_path}" if cfg_path else ", shape from the config (no config.json)")
    rest = (f"all {total} of the model's tensors came from it" if fresh <= 0 else
            f"{fresh} of the model's {total} tensors are not in it and start fresh (new to the {family.name} model)")
    return (f"model.pretrained: {path} ({where}): {shape}; {loaded} tensors matched the model by name and shape "
            f"and were loaded, {rest}")


def is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())
