"""``flexpack export RUN OUT --format lingbot-upstream``: a lingbot-va run in upstream LingBot-VA's checkpoint layout.

``OUT`` holds what upstream's ``load_transformer(OUT/transformer, ...)`` (``WanTransformer3DModel.from_pretrained``)
and flexpack's own ``model.pretrained = OUT`` read, for a run on a LeRobot v3 latent cache or on a lingbot-bundle::

    transformer/config.json        diffusers-style: _class_name "WanTransformer3DModel", _diffusers_version and the
                                   keys upstream's WanTransformer3DModel.__init__ takes (the model's shape;
                                   pos_embed_seq_len null; attn_mode "torch", what upstream's inference passes
                                   anyway, its trainer passing "flex")
    transformer/diffusion_pytorch_model.safetensors
                                   the weights under upstream's names (LeRobot's without "transformer.",
                                   lingbot_convert.to_lerobot_state_dict(sd, prefix="")); over MAX_SHARD_BYTES
                                   (diffusers' 10 GB) as diffusers shards them: diffusion_pytorch_model-0000k-of-
                                   0000n.safetensors and diffusion_pytorch_model.safetensors.index.json
    flexpack_export.json           what upstream's config file (wan_va/configs/va_*_cfg.py) says beside the weights:
                                   obs_cam_keys, env_type ("robotwin_tshape" for a bundle composed as a T, else
                                   "none"), height / width, action_dim, used_action_channel_ids, action_per_frame,
                                   the inference fields, norm_stat (q01 / q99 over the model's action space,
                                   action_norm_method "quantiles"); and flexpack's: the cameras' frames, the
                                   statistics in the source columns, the dataset, the data's composition
    normalization.json             the statistics as flexpack writes them (``flexpack sample OUT`` reads them)
    ema/transformer/               with --ema: the EMA weights, the same layout

Nothing LeRobot-specific is refused: upstream's checkpoint is the transformer and its config file is the user's;
the fields it needs are recorded, not checked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from flexpack.run.root import Run

WEIGHTS = "diffusion_pytorch_model"
MAX_SHARD_BYTES = 10 * 10**9  # diffusers' default max_shard_size ("10GB")
CLASS_NAME = "WanTransformer3DModel"
UPSTREAM_DIFFUSERS = "0.36.0"  # the diffusers upstream pins, recorded where none is installed here
# upstream's WanTransformer3DModel.__init__ keys beyond LingbotConfig's LEROBOT_SHAPE, with the values written
UPSTREAM_EXTRA = {"pos_embed_seq_len": None, "attn_mode": "torch"}
INFERENCE = ("frame_chunk_size", "attn_window", "num_inference_steps", "action_num_inference_steps",
             "guidance_scale", "action_guidance_scale", "snr_shift", "action_snr_shift")


def transformer_config(model_cfg: Any) -> dict[str, Any]:
    """``transformer/config.json`` of ``model_cfg`` (a :class:`~flexpack.families.lingbot.config.LingbotConfig`)."""
    from flexpack.families.lingbot.config import LEROBOT_SHAPE

    try:
        from importlib.metadata import version

        diffusers_version = version("diffusers")
    except Exception:  # PackageNotFoundError: not installed here
        diffusers_version = UPSTREAM_DIFFUSERS
    fields = {k: getattr(model_cfg, k) for k in LEROBOT_SHAPE}
    fields["patch_size"] = list(model_cfg.patch_size)
    return {"_class_name": CLASS_NAME, "_diffusers_version": diffusers_version, **fields, **UPSTREAM_EXTRA}


def save_weights(folder: Path, sd: dict[str, torch.Tensor], max_bytes: int | None = None) -> list[str]:
    """``sd`` as ``diffusion_pytorch_model.safetensors`` in ``folder``, or, over ``max_bytes`` (default
    :data:`MAX_SHARD_BYTES`), as diffusers' shards (tensors in order, a new shard where the next would pass
    ``max_bytes``) with their index; returns the files."""
    from safetensors.torch import save_file

    max_bytes = MAX_SHARD_BYTES if max_bytes is None else max_bytes

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in sd.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t.contiguous()
        size += n
    if len(shards) == 1:
        names = [f"{WEIGHTS}.safetensors"]
    else:
        names = [f"{WEIGHTS}-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in sd.values())},
                 "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}
        (folder / f"{WEIGHTS}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    for name, shard in zip(names, shards):
        save_file(shard, str(folder / name), metadata={"format": "pt"})
    return names


def write_transformer(folder: Path, state_dict: dict[str, torch.Tensor], model_cfg: Any, dtype: torch.dtype) -> None:
    """A :class:`~flexpack.families.lingbot.model.LingbotVA` state dict as upstream's ``transformer/`` folder."""
    from flexpack.families.lingbot.convert import to_lerobot_state_dict

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(transformer_config(model_cfg), indent=2) + "\n")
    save_weights(folder, to_lerobot_state_dict({k: v.to(dtype) for k, v in state_dict.items()}, prefix=""))


def _cameras(run: Run, dataset: str | None) -> dict[str, Any]:
    """obs_cam_keys, env_type, height, width and the cameras' frames (C, H, W) of the run's data."""
    from flexpack.data.formats import is_bundle
    from flexpack.families.lingbot.export_bundle import VAE_PIXELS, bundle_cameras, frame_shape

    if is_bundle(run.config.data):
        cams = bundle_cameras(run, dataset)
        h, w = (x * VAE_PIXELS for x in cams.grids[0])  # the main camera's latents: the size upstream encodes at
        return {"obs_cam_keys": list(cams.frames), "env_type": "robotwin_tshape" if cams.layout == "tshape" else "none",
                "height": h, "width": w, "camera_layout": cams.layout, "dataset": cams.dataset,
                "frame_ids_stride": cams.stride, "cameras": {c: list(f) for c, f in cams.frames.items()}}
    from flexpack.data.episodes import EpisodeSource
    from flexpack.data.problems import resolve_cameras

    src = EpisodeSource(run.config.data.root)
    conv = run.family.conventions(run.model_config)
    given = list(conv.cameras) or (list(run.config.data.cameras) if run.config.data.cameras else None)
    names = resolve_cameras(src.video_keys, given, src.info_file)
    frames = {c: frame_shape(src.meta.features[c], c, src.info_file) for c in names}
    _, h, w = frames[names[0]]
    return {"obs_cam_keys": names, "env_type": "none", "height": h, "width": w, "camera_layout": "width_concat",
            "dataset": None, "cameras": {c: list(f) for c, f in frames.items()}}


def _statistics(norm: dict[str, Any], action_dim: int) -> dict[str, Any]:
    """norm_stat (model space) and the source columns' statistics of ``normalization.json``'s record."""
    if norm.get("space") == "model":  # a bundle run: the checkpoint's statistics are the model space's
        low, high = list(norm["low"]), list(norm["high"])
        cols = {"q01": norm["column_low"], "q99": norm["column_high"]}
    else:  # a latent cache's: per column, placed at its channel (other channels 0, as upstream's configs fill them)
        low, high = [0.0] * action_dim, [0.0] * action_dim
        for j, c in enumerate(norm["channels"]):
            low[c], high[c] = norm["low"][j], norm["high"][j]
        cols = {"q01": norm["low"], "q99": norm["high"]}
    if norm["mode"] != "quantile":
        return {"action_norm_method": norm["mode"], "norm_stat": None, "source_columns": None}
    return {"action_norm_method": "quantiles", "norm_stat": {"q01": low, "q99": high}, "source_columns": cols}


def export_fields(run: Run, norm: dict[str, Any], dataset: str | None) -> dict[str, Any]:
    """``flexpack_export.json``: upstream's config fields of the run, then flexpack's (the module docstring)."""
    m = run.model_config
    cams = _cameras(run, dataset)
    stats = _statistics(norm, m.action_dim)
    # a bundle run's: the channels of the source described (a mixture entry's own action_channels)
    used = list(norm["channels"]) if norm.get("space") == "model" else list(m.used_action_channel_ids)
    upstream = {"obs_cam_keys": cams.pop("obs_cam_keys"), "env_type": cams.pop("env_type"),
                "height": cams.pop("height"), "width": cams.pop("width"), "action_dim": m.action_dim,
                "used_action_channel_ids": used, "action_per_frame": m.action_per_frame,
                "patch_size": list(m.patch_size), **{k: getattr(m, k) for k in INFERENCE},
                "action_norm_method": stats["action_norm_method"], "norm_stat": stats["norm_stat"]}
    return {"format": "lingbot-upstream", "transformer": "transformer", "upstream_config": upstream,
            "source_columns": stats["source_columns"], "data_root": norm.get("dataset", str(run.config.data.root)),
            **cams,
            "max_sequence_length": m.max_sequence_length}


def write_upstream(job: Any, folder: Path) -> None:
    """The ``lingbot-upstream`` format of an :class:`~flexpack.tools.export_io.ExportJob` into ``folder``."""
    run, opts = job.composed, job.options
    model_cfg = run.model_config
    fields = export_fields(run, job.norm, opts.dataset)  # the data's facts first: a refusal writes no weights
    write_transformer(folder / "transformer", job.model.state_dict(), model_cfg, opts.dtype)
    if job.averaged is not None:
        write_transformer(folder / "ema" / "transformer", job.averaged.full_state_dict(), model_cfg, opts.dtype)
    (folder / "flexpack_export.json").write_text(json.dumps(fields, indent=2) + "\n")
    (folder / "normalization.json").write_text(json.dumps(job.norm, indent=2) + "\n")
