"""The Wan family's export: the ``diffusers`` format (``flexpack export --format diffusers``), a folder
``diffusers.WanTransformer3DModel.from_pretrained`` loads plus the action stream's files (the layout:
:mod:`flexpack.tools.export`), and :func:`load_export`, which reads such a folder back into a :class:`WanVA`."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from flexpack.families.wan.config import LEGACY_ACTION_POSITIONS, WanVAConfig, check_action_positions

ACTION_FORMAT = "flexpack-action-stream-v1"


def write_weights(folder: Path, state_dict: dict[str, torch.Tensor], model_cfg: WanVAConfig, *, action_steps: int,
                  dtype: torch.dtype = torch.float32, max_shard_size: str | int = "10GB") -> None:
    """A WanVA state dict as a diffusers WanTransformer3DModel folder plus the action-stream files."""
    try:
        from diffusers import WanTransformer3DModel
    except ImportError as exc:
        raise ImportError("flexpack export needs diffusers: pip install 'flexpack[hf]'") from exc
    from safetensors.torch import save_file

    from flexpack.families.wan.convert import config_to_diffusers, to_diffusers_state_dict

    video, action = to_diffusers_state_dict({k: v.to(dtype) for k, v in state_dict.items()}, model_cfg)
    with torch.device("meta"):  # no random init: the tensors are adopted below
        dm = WanTransformer3DModel(**config_to_diffusers(model_cfg))
    dm.load_state_dict(video, strict=True, assign=True)
    dm.save_pretrained(folder, safe_serialization=True, max_shard_size=max_shard_size)
    if action:
        save_file({k: v.contiguous() for k, v in action.items()}, str(folder / "action_stream.safetensors"),
                  metadata={"format": ACTION_FORMAT})
    info = {"format": ACTION_FORMAT, "action_channels": model_cfg.action_channels, "action_steps": action_steps,
            "dim": model_cfg.dim, "weights": sorted(action), "wanva_config": asdict(model_cfg)}
    (folder / "action_stream.json").write_text(json.dumps(info, indent=2) + "\n")


def write_diffusers(job: Any, folder: Path) -> None:
    """The ``diffusers`` format (the module docstring's layout but ``flexpack_config.json`` and
    ``export.json``, which every format gets) into ``folder``."""
    cfg, model, dtype = job.composed.config, job.model, job.options.dtype
    model_cfg = job.composed.model_config
    write_weights(folder, model.state_dict(), model_cfg, action_steps=cfg.data.action_steps, dtype=dtype)
    if job.averaged is not None:
        (folder / "ema").mkdir()
        write_weights(folder / "ema", job.averaged.full_state_dict(), model_cfg, action_steps=cfg.data.action_steps,
                      dtype=dtype)
    (folder / "normalization.json").write_text(json.dumps(job.norm, indent=2) + "\n")
    from flexpack.families.wan.export_policy import write_extras

    write_extras(folder, run=job.run, composed=job.composed, state_dict=model.state_dict(), stats=job.stats,
                 norm=job.norm, step=job.step, ema=job.options.ema, dtype=dtype, policy=job.options.policy)


def load_export(folder: str | os.PathLike, *, attn: Any = None) -> torch.nn.Module:
    """A :class:`WanVA` from an exported folder (or its ``ema/``): the diffusers weights plus the action stream."""
    from safetensors.torch import load_file

    from flexpack.families.wan.model import WanVA

    folder = Path(folder)
    info_file = folder / "action_stream.json"
    if not info_file.is_file():
        raise FileNotFoundError(f"{info_file}: missing; not a flexpack export folder")
    info = json.loads(info_file.read_text())
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in info["wanva_config"].items()}
    kw.setdefault("action_positions", LEGACY_ACTION_POSITIONS)  # exported before the rule was recorded
    model_cfg = WanVAConfig(**kw)
    model = WanVA.from_diffusers_file(str(folder), model_cfg, attn=attn)
    if info["weights"]:
        action = load_file(folder / "action_stream.safetensors")
        missing = sorted(set(info["weights"]) - set(action))
        if missing:
            raise ValueError(f"{folder / 'action_stream.safetensors'}: lacks {missing}")
        with torch.no_grad():
            for name, t in action.items():
                model.get_parameter(name).copy_(t)
    return model


def read_export(folder: str, config: WanVAConfig) -> torch.nn.Module:
    """The WanVA of an export folder (:func:`load_export`), refused in one line where its action tokens were
    trained at other RoPE positions than ``config`` gives them."""
    loaded = load_export(folder)
    check_action_positions(loaded.config.action_positions, config, str(folder))
    return loaded
