"""Load diffusers-format Wan transformer weights into :class:`~flexpack.families.wan.model.WanVA`, and back.

One name table serves both directions (:func:`rename`; :func:`to_diffusers_state_dict` and
:func:`config_to_diffusers` for export). The mapping is by name and shape; every diffusers tensor must
be used and every WanVA tensor except the action stream (which diffusers' video model does not have)
must be filled, so a renamed or missing weight fails loudly instead of staying at its random init.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any, Iterable, Mapping

import torch
from torch import Tensor, nn

from flexpack.families.wan.config import WanVAConfig

# The model class is an argument (``cls``), so this module never imports flexpack.families.wan.model.

# WanVAConfig fields a diffusers config.json determines (see config_from_diffusers)
SHAPE_FIELDS = ("dim", "num_heads", "ffn_dim", "num_layers", "patch_size", "in_channels", "out_channels",
                "text_dim", "freq_dim", "eps", "cross_attn_norm")

# WanVA tensors a diffusers checkpoint does not hold; they keep their initialization.
ACTION_PREFIXES = ("action_embed.", "action_head_modulation", "action_head_proj.")

# The name table, used in both directions (diffusers -> WanVA to load, WanVA -> diffusers to
# export): keys are full names or module stems (a stem maps ``stem.weight`` / ``stem.bias``).
_TOP_LEVEL = {
    "condition_embedder.time_embedder.linear_1": "time_embed.fc1",
    "condition_embedder.time_embedder.linear_2": "time_embed.fc2",
    "condition_embedder.time_proj": "time_embed.mod_proj",
    "condition_embedder.text_embedder.linear_1": "text_embed.fc1",
    "condition_embedder.text_embedder.linear_2": "text_embed.fc2",
    "proj_out": "head_proj",
    "patch_embedding": "patch_embed",
    "scale_shift_table": "head_modulation",
}
_BLOCK = {  # inside ``blocks.{i}.``
    "attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o", "attn1.norm_q": "self_attn.norm_q", "attn1.norm_k": "self_attn.norm_k",
    "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k", "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o", "attn2.norm_q": "cross_attn.norm_q", "attn2.norm_k": "cross_attn.norm_k",
    "ffn.net.0.proj": "ffn.fc1", "ffn.net.2": "ffn.fc2",
    "scale_shift_table": "modulation",
    "norm2.weight": "cross_norm_weight", "norm2.bias": "cross_norm_bias",  # only with cross_attn_norm
}
_TABLES = {
    False: (_TOP_LEVEL, _BLOCK),
    True: ({v: k for k, v in _TOP_LEVEL.items()}, {v: k for k, v in _BLOCK.items()}),
}


def _lookup(name: str, table: Mapping[str, str]) -> str | None:
    if name in table:
        return table[name]
    stem, _, leaf = name.rpartition(".")
    return f"{table[stem]}.{leaf}" if stem in table else None


def rename(name: str, *, to_diffusers: bool = False) -> str | None:
    """A diffusers tensor name as WanVA names it (or the reverse); None when it has no counterpart."""
    top, block = _TABLES[to_diffusers]
    parts = name.split(".")
    if parts[0] == "blocks" and len(parts) >= 3:
        rest = _lookup(".".join(parts[2:]), block)
        return None if rest is None else f"blocks.{parts[1]}.{rest}"
    return _lookup(name, top)


def config_from_diffusers(cfg: Mapping[str, Any], **overrides: Any) -> WanVAConfig:
    """A :class:`WanVAConfig` from a diffusers ``WanTransformer3DModel`` config (dict or FrozenDict)."""
    if cfg.get("image_dim") is not None or cfg.get("added_kv_proj_dim") is not None:
        raise ValueError(
            f"image conditioning (image_dim={cfg.get('image_dim')}, "
            f"added_kv_proj_dim={cfg.get('added_kv_proj_dim')}) is not supported"
        )
    qk = cfg.get("qk_norm", "rms_norm_across_heads")
    if qk != "rms_norm_across_heads":
        raise ValueError(f"only qk_norm='rms_norm_across_heads' is supported, got {qk!r}")
    heads, head_dim = int(cfg.get("num_attention_heads", 40)), int(cfg.get("attention_head_dim", 128))
    kw: dict[str, Any] = dict(
        dim=heads * head_dim,
        num_heads=heads,
        ffn_dim=int(cfg.get("ffn_dim", 13824)),
        num_layers=int(cfg.get("num_layers", 40)),
        patch_size=tuple(int(p) for p in cfg.get("patch_size", (1, 2, 2))),
        in_channels=int(cfg.get("in_channels", 16)),
        out_channels=cfg.get("out_channels"),
        text_dim=int(cfg.get("text_dim", 4096)),
        freq_dim=int(cfg.get("freq_dim", 256)),
        eps=float(cfg.get("eps", 1e-6)),
        cross_attn_norm=bool(cfg.get("cross_attn_norm", True)),
    )
    kw.update(overrides)
    return WanVAConfig(**kw)


def convert_tensor(name: str, t: Tensor) -> tuple[str, Tensor] | None:
    """One diffusers tensor under its WanVA name and shape; None when WanVA has no counterpart."""
    new = rename(name)
    if new is None:
        return None
    if new == "patch_embed.weight":
        t = t.reshape(t.shape[0], -1)  # Conv3d (D, C, pt, ph, pw) → Linear over (C, pt, ph, pw)
    elif new.endswith("modulation"):
        t = t.reshape(-1, t.shape[-1])  # (1, 6, D) / (1, 2, D) → (6, D) / (2, D)
    return new, t


def convert_state_dict(sd: Mapping[str, Tensor], cfg: WanVAConfig) -> dict[str, Tensor]:
    """Rename (and reshape) a diffusers Wan state dict to WanVA names; raises on leftovers."""
    out: dict[str, Tensor] = {}
    unused = []
    for name, t in sd.items():
        conv = convert_tensor(name, t)
        if conv is None:
            unused.append(name)
            continue
        out[conv[0]] = conv[1]
    if unused:
        raise ValueError("diffusers weights with no WanVA counterpart: "
                         f"{unused[:8]}{' ...' if len(unused) > 8 else ''}")
    return out


def to_diffusers_state_dict(sd: Mapping[str, Tensor], cfg: WanVAConfig) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A WanVA state dict split into (diffusers ``WanTransformer3DModel`` state dict, action stream)."""
    video: dict[str, Tensor] = {}
    action: dict[str, Tensor] = {}
    C, (pt, ph, pw) = cfg.in_channels, cfg.patch_size
    for name, t in sd.items():
        if name.startswith(ACTION_PREFIXES):
            action[name] = t
            continue
        new = rename(name, to_diffusers=True)
        if new is None:
            raise ValueError(f"WanVA weight {name!r} has no diffusers counterpart")
        if name == "patch_embed.weight":
            t = t.reshape(t.shape[0], C, pt, ph, pw)
        elif name.endswith("modulation"):
            t = t.reshape(1, *t.shape)
        video[new] = t
    return video, action


def config_to_diffusers(cfg: WanVAConfig) -> dict[str, Any]:
    """The ``WanTransformer3DModel`` config of a WanVA shape (inverse of :func:`config_from_diffusers`)."""
    if cfg.rope_theta != 10000.0:  # diffusers' Wan RoPE has a fixed theta
        raise ValueError(f"rope_theta={cfg.rope_theta} cannot be expressed in a diffusers Wan config (fixed 10000)")
    return dict(
        patch_size=list(cfg.patch_size), num_attention_heads=cfg.num_heads, attention_head_dim=cfg.head_dim,
        in_channels=cfg.in_channels, out_channels=cfg.out_dim, text_dim=cfg.text_dim, freq_dim=cfg.freq_dim,
        ffn_dim=cfg.ffn_dim, num_layers=cfg.num_layers, cross_attn_norm=cfg.cross_attn_norm,
        qk_norm="rms_norm_across_heads", eps=cfg.eps, image_dim=None, added_kv_proj_dim=None,
    )


def _check_converted(model: nn.Module, sd: Mapping[str, Tensor]) -> None:
    """Only the action stream may be missing from ``sd``; names and shapes must match ``model``."""
    own = model.state_dict()
    for k, t in sd.items():
        if k not in own:
            raise ValueError(f"converted weight {k!r} is not a WanVA parameter")
        if tuple(own[k].shape) != tuple(t.shape):
            raise ValueError(f"weight {k!r}: checkpoint shape {tuple(t.shape)} != model shape {tuple(own[k].shape)}")
    missing = [k for k in own if k not in sd and not k.startswith(ACTION_PREFIXES)]
    if missing:
        raise ValueError(f"the checkpoint lacks WanVA weights {missing[:8]}{' ...' if len(missing) > 8 else ''}")


def load_converted(model: nn.Module, sd: Mapping[str, Tensor]) -> nn.Module:
    """Load a converted state dict into an existing model (copying); the action stream keeps its weights."""
    _check_converted(model, sd)
    model.load_state_dict(dict(sd), strict=False)
    return model


def build_converted(
    cls: type[nn.Module], cfg: WanVAConfig, sd: dict[str, Tensor], *, attn: Any, device: torch.device | str,
    dtype: torch.dtype, copy: bool,
) -> nn.Module:
    """A WanVA holding ``sd``'s weights, without a random initialization of the whole model.

    The model is built on the meta device and adopts the checkpoint tensors (``assign=True``,
    cast to ``device``/``dtype``); only the action stream, which the checkpoint lacks, is
    materialized and initialized (:meth:`WanVA.reset_action_stream`). At 5B this avoids ~20 GB of
    fp32 random weights and minutes of init. ``copy=False`` may consume ``sd`` (its tensors are
    moved into the model one by one); ``copy=True`` leaves the caller's tensors untouched.
    """
    with torch.device("meta"):
        model = cls(cfg, attn=attn)
    _check_converted(model, sd)
    full: dict[str, Tensor] = {}
    for k in list(sd):
        t = sd[k] if copy else sd.pop(k)  # pop: drop the source tensor as soon as it is converted
        full[k] = t.to(device=device, dtype=dtype, copy=copy).contiguous()
    for k, p in model.state_dict().items():
        if k not in full:  # the action stream: materialized here, initialized below
            full[k] = torch.empty(p.shape, device=device, dtype=dtype)
    model.load_state_dict(full, strict=True, assign=True)
    model.reset_action_stream()
    return model


def _main_dtype(tensors: Iterable[Tensor]) -> torch.dtype:
    """The floating dtype holding most elements (a bf16 file with a few fp32 norms stays bf16)."""
    counts: dict[torch.dtype, int] = {}
    for t in tensors:
        if t.dtype.is_floating_point:
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return max(counts, key=counts.__getitem__) if counts else torch.float32


def from_diffusers(cls: type[nn.Module], model: nn.Module, *, attn: Any = None, **overrides: Any) -> nn.Module:
    cfg = config_from_diffusers(dict(model.config), **overrides)
    p = next(model.parameters())
    sd = convert_state_dict(model.state_dict(), cfg)
    return build_converted(cls, cfg, sd, attn=attn, device=p.device, dtype=p.dtype, copy=True)


def diffusers_files(path: str | os.PathLike) -> tuple[list[str], str | None]:
    """The weight files of a diffusers checkpoint and its ``config.json`` (None where absent).

    ``path``: a ``.safetensors`` file (config.json beside it, optionally) or a folder with
    ``config.json`` and ``diffusion_pytorch_model.safetensors`` or its ``.index.json`` shards.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        single = os.path.join(path, "diffusion_pytorch_model.safetensors")
        index = single + ".index.json"
        if os.path.exists(single):
            files = [single]
        elif os.path.exists(index):
            with open(index) as f:
                files = [os.path.join(path, s) for s in sorted(set(json.load(f)["weight_map"].values()))]
        else:
            raise ValueError(f"{path}: no diffusion_pytorch_model.safetensors(.index.json) in this folder")
        folder = path
    elif os.path.isfile(path):
        files, folder = [path], os.path.dirname(path)
    else:
        raise ValueError(f"{path}: no such file or folder")
    cfg_path = os.path.join(folder, "config.json")
    return files, cfg_path if os.path.exists(cfg_path) else None


def from_diffusers_file(
    cls: type[nn.Module], path: str, config: Any = None, *, attn: Any = None, **overrides: Any
) -> nn.Module:
    """``path``: a ``.safetensors`` file or a folder with ``config.json`` and
    ``diffusion_pytorch_model.safetensors`` (or its ``.index.json`` shards). The model takes the
    checkpoint's main floating dtype and lives on the CPU."""
    from safetensors.torch import load_file

    files, cfg_path = diffusers_files(path)
    if config is None:
        if cfg_path is None:
            raise ValueError(f"{path}: pass config= or put the diffusers config.json beside the weights")
        with open(cfg_path) as f:
            config = json.load(f)
    cfg = (replace(config, **overrides) if isinstance(config, WanVAConfig)
           else config_from_diffusers(config, **overrides))
    sd: dict[str, Tensor] = {}
    for fn in files:
        sd.update(load_file(fn))
    converted = convert_state_dict(sd, cfg)
    del sd  # `converted` holds the only references now: build_converted releases them one by one
    dtype = _main_dtype(converted.values())
    return build_converted(cls, cfg, converted, attn=attn, device="cpu", dtype=dtype, copy=False)
