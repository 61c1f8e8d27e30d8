"""LeRobot ``lingbot_va`` weights <-> :class:`~flexpack.families.lingbot.model.LingbotVA`, strictly, both ways.

Names. A LeRobot policy's ``model.safetensors`` holds the transformer under ``transformer.``
(``transformer.blocks.0.attn1.to_q.weight``); an upstream ``transformer/`` folder holds the same
tensors without the prefix (``diffusion_pytorch_model*.safetensors``). The blocks, the video time and
text embedders and the video output use diffusers' Wan names (one table with
:mod:`flexpack.families.wan.convert`); :data:`LINGBOT_NAMES` adds what LeRobot's model has beyond them.
No tensor of LeRobot's model lacks a counterpart (RoPE and the three norms without affine weights
have no parameters).

Strict. Every tensor of the checkpoint must be used and every tensor of the model filled, with the
shape the config implies; otherwise a one-line ``ValueError`` names the first offending key (a
checkpoint of another width, depth or family is such an error).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import torch
from torch import Tensor

from flexpack.families.lingbot.config import LingbotConfig, config_from_lerobot
from flexpack.families.lingbot.model import LingbotVA
from flexpack.families.wan.convert import _main_dtype, diffusers_files, rename

POLICY_PREFIX = "transformer."  # LeRobot's policy state dict: the transformer is its only module
POLICY_WEIGHTS = "model.safetensors"

# LeRobot module stem -> flexpack module stem, beyond the Wan table of wan_convert
LINGBOT_NAMES = {
    "patch_embedding_mlp": "patch_embed",  # a Linear here (the Wan table maps the Conv3d "patch_embedding")
    "action_embedder": "action_embed",
    "condition_embedder_action.time_embedder.linear_1": "action_time_embed.fc1",
    "condition_embedder_action.time_embedder.linear_2": "action_time_embed.fc2",
    "condition_embedder_action.time_proj": "action_time_embed.mod_proj",
    "condition_embedder_action.text_embedder.linear_1": "action_text_embed.fc1",
    "condition_embedder_action.text_embedder.linear_2": "action_text_embed.fc2",
    "action_proj_out": "action_head_proj",
}
_REVERSE = {v: k for k, v in LINGBOT_NAMES.items()}


def lingbot_name(name: str, *, to_lerobot: bool = False) -> str | None:
    """A LeRobot tensor name (no prefix) as flexpack names it, or the reverse; None without a counterpart."""
    table = _REVERSE if to_lerobot else LINGBOT_NAMES
    stem, _, leaf = name.rpartition(".")
    if stem in table:
        return f"{table[stem]}.{leaf}"
    if not to_lerobot and stem == "patch_embedding":
        return None  # Wan's Conv3d patch embedding: a checkpoint of plain Wan, not this family
    return rename(name, to_diffusers=to_lerobot)


def _modulation(name: str) -> bool:
    return name.endswith("modulation")  # LeRobot keeps these tables as (1, n, D), flexpack as (n, D)


def _expected(cfg: LingbotConfig) -> dict[str, tuple[int, ...]]:
    """flexpack name -> shape of every tensor of the model of ``cfg`` (built on the meta device)."""
    with torch.device("meta"):
        model = LingbotVA(cfg, attn=object())
    return {k: tuple(t.shape) for k, t in model.state_dict().items()}


def strip_policy_prefix(sd: Mapping[str, Tensor], source: str = "state dict") -> dict[str, Tensor]:
    """The transformer's tensors of a LeRobot policy state dict (``transformer.`` prefix removed),
    or a bare one unchanged; a mixture of both, or other modules, is an error."""
    prefixed = [k for k in sd if k.startswith(POLICY_PREFIX)]
    if not prefixed:
        return dict(sd)
    others = [k for k in sd if not k.startswith(POLICY_PREFIX)]
    if others:
        raise ValueError(f"{source}: tensor {others[0]!r} is outside the policy's transformer (expected "
                         f"every key under {POLICY_PREFIX!r})")
    return {k[len(POLICY_PREFIX):]: t for k, t in sd.items()}


def from_lerobot_state_dict(
    sd: Mapping[str, Tensor], cfg: LingbotConfig, *, source: str = "state dict"
) -> dict[str, Tensor]:
    """A LeRobot ``lingbot_va`` state dict (``transformer.`` prefixed or bare) under flexpack's names and
    shapes; every tensor used, every model tensor filled, shapes checked against ``cfg``."""
    want = _expected(cfg)
    out: dict[str, Tensor] = {}
    for name, t in strip_policy_prefix(sd, source).items():
        new = lingbot_name(name)
        if new is None or new not in want:
            raise ValueError(f"{source}: tensor {name!r} has no counterpart in a lingbot-va model "
                             "(a checkpoint of another family?)")
        if _modulation(new):
            t = t.reshape(t.shape[-2:]) if t.ndim == 3 and t.shape[0] == 1 else t
        if tuple(t.shape) != want[new]:
            raise ValueError(f"{source}: tensor {name!r} has shape {tuple(t.shape)}, the config needs "
                             f"{want[new]} (a checkpoint of another width?)")
        out[new] = t
    missing = [k for k in want if k not in out]
    if missing:
        lerobot = lingbot_name(missing[0], to_lerobot=True)
        raise ValueError(f"{source}: lacks tensor {lerobot!r} ({len(missing)} missing; a checkpoint of "
                         "another depth or family?)")
    return out


def to_lerobot_state_dict(sd: Mapping[str, Tensor], *, prefix: str = POLICY_PREFIX) -> dict[str, Tensor]:
    """A :class:`LingbotVA` state dict under LeRobot's names and shapes, each key prefixed with ``prefix``
    (``"transformer."`` for a policy's ``model.safetensors``, ``""`` for a ``transformer/`` folder)."""
    out: dict[str, Tensor] = {}
    for name, t in sd.items():
        new = lingbot_name(name, to_lerobot=True)
        if new is None:
            raise ValueError(f"lingbot-va tensor {name!r} has no LeRobot counterpart")
        out[prefix + new] = t.reshape(1, *t.shape) if _modulation(name) else t
    return out


def build_from_lerobot(
    sd: Mapping[str, Tensor], cfg: LingbotConfig, *, attn: Any = None, device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None, source: str = "state dict",
) -> LingbotVA:
    """A :class:`LingbotVA` holding ``sd``'s weights: built on the meta device, then the checkpoint's
    tensors adopted (cast to ``device`` / ``dtype``, default: the checkpoint's main floating dtype),
    so no random initialization of billions of weights that are overwritten anyway."""
    converted = from_lerobot_state_dict(sd, cfg, source=source)
    dtype = _main_dtype(converted.values()) if dtype is None else dtype
    with torch.device("meta"):
        model = LingbotVA(cfg, attn=attn)
    full = {k: t.to(device=device, dtype=dtype).contiguous() for k, t in converted.items()}
    model.load_state_dict(full, strict=True, assign=True)  # keeps the modules' requires_grad flags
    return model


def lingbot_files(path: str | os.PathLike) -> tuple[list[str], str | None]:
    """(weight files, ``config.json`` or None) of a LeRobot ``lingbot_va`` policy folder (``model.safetensors``),
    an upstream ``transformer/`` folder (``diffusion_pytorch_model*.safetensors``), a folder holding one (an
    upstream checkpoint, a ``--format lingbot-upstream`` export) or one ``.safetensors`` file."""
    path = os.fspath(path)
    policy = os.path.join(path, POLICY_WEIGHTS)
    if os.path.isdir(path) and os.path.isfile(policy):
        cfg_path = os.path.join(path, "config.json")
        return [policy], cfg_path if os.path.isfile(cfg_path) else None
    sub = os.path.join(path, "transformer")
    if not os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(sub, "config.json")):
        return diffusers_files(sub)
    return diffusers_files(path)


def lerobot_files(path: str | os.PathLike) -> tuple[list[str], dict[str, Any], str]:
    """(weight files, config dict, config file) of a LeRobot ``lingbot_va`` policy folder
    (``config.json`` + ``model.safetensors``) or an upstream ``transformer/`` folder (``config.json`` +
    ``diffusion_pytorch_model*.safetensors``)."""
    path = os.fspath(path)
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isdir(path) or not os.path.isfile(cfg_path):
        raise ValueError(f"{path}: not a folder with a config.json (a LeRobot lingbot_va policy or a "
                         "transformer/ folder expected)")
    with open(cfg_path) as f:
        cfg = json.load(f)
    return lingbot_files(path)[0], cfg, cfg_path


def convert_tensor(name: str, t: Tensor) -> tuple[str, Tensor] | None:
    """One LeRobot tensor (``transformer.``-prefixed or bare) under its :class:`LingbotVA` name and shape;
    None without a counterpart (the streaming loader of :mod:`flexpack.run.pretrained` names it)."""
    new = lingbot_name(name.removeprefix(POLICY_PREFIX))
    if new is not None and _modulation(new) and t.ndim == 3 and t.shape[0] == 1:
        t = t.reshape(t.shape[-2:])
    return None if new is None else (new, t)


def load_checkpoint(path: str | os.PathLike, cfg: LingbotConfig) -> LingbotVA:
    """A :class:`LingbotVA` of ``cfg`` holding the weights of a LeRobot policy folder, a ``transformer/``
    folder or a ``.safetensors`` file (on the CPU, in the checkpoint's dtype)."""
    files, _ = lingbot_files(path)
    return build_from_lerobot(_read(files), cfg, source=files[0])


def _read(files: list[str]) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    sd: dict[str, Tensor] = {}
    for fn in files:
        sd.update(load_file(fn))
    return sd


def load_lerobot(
    path: str | os.PathLike, *, attn: Any = None, device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None, **overrides: Any,
) -> LingbotVA:
    """A :class:`LingbotVA` from a LeRobot policy folder or an upstream ``transformer/`` folder; the
    config is read from its ``config.json`` (``overrides`` replace :class:`LingbotConfig` fields)."""
    files, raw, cfg_path = lerobot_files(path)
    cfg = config_from_lerobot(raw, source=cfg_path, **overrides)
    return build_from_lerobot(_read(files), cfg, attn=attn, device=device, dtype=dtype, source=files[0])
