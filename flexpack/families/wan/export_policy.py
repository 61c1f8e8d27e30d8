"""The lerobot_policy/ folder of the ``diffusers`` export (:mod:`flexpack.families.wan.export`), beside the model
card of :mod:`flexpack.tools.export_extras`.

``OUT/lerobot_policy/``
    The layout LeRobot users know from ``PreTrainedPolicy.save_pretrained`` and its processors:
    ``config.json`` (``type``, ``input_features``, ``output_features``, ``normalization_mapping``,
    the WanVA config), ``model.safetensors`` (the whole WanVA, flexpack names, one file), and the
    normalization as LeRobot processor pipelines (``policy_preprocessor.json`` /
    ``policy_postprocessor.json`` with their ``*.safetensors`` statistics), written by lerobot's own
    ``DataProcessorPipeline.save_pretrained`` so ``DataProcessorPipeline.from_pretrained`` reads them.
    The action statistics are those the weights were trained with (the checkpoint's); states and
    the remaining fields come from the dataset's pooled statistics (:mod:`flexpack.data.action_stats`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from flexpack.tools.export_extras import POLICY_DIR, model_card, stats_tensors

if TYPE_CHECKING:
    from flexpack.data.normalization import ActionStats
    from flexpack.models.registry import ModelShape
    from flexpack.run.config import DataConfig
    from flexpack.run.root import Run

POLICY_TYPE = "flexpack_wanva"


def _features(meta: Any, data: DataConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """LeRobot ``PolicyFeature``s as JSON: cameras (3, H, W), the state, the action."""
    inputs: dict[str, Any] = {}
    cams = list(data.cameras) if data.cameras else list(meta.video_keys)
    for key in meta.video_keys:
        if key in cams or key.split(".")[-1] in cams:
            h, w, c = meta.features[key]["shape"]
            inputs[key] = {"type": "VISUAL", "shape": [int(c), int(h), int(w)]}
    if "observation.state" in meta.features:
        state_size = int(torch.Size(meta.features["observation.state"]["shape"]).numel())
        inputs["observation.state"] = {"type": "STATE", "shape": [state_size]}
    action = {"action": {"type": "ACTION", "shape": [int(torch.Size(meta.features["action"]["shape"]).numel())]}}
    return inputs, action


def write_policy_folder(folder: Path, *, data: DataConfig, model_cfg: ModelShape, state_dict: dict[str, torch.Tensor],
                        stats: ActionStats, norm: dict[str, Any], pooled: dict[str, Any], meta: Any,
                        dtype: torch.dtype = torch.float32) -> Path:
    """``folder`` as a LeRobot-style policy folder (see the module docstring)."""
    from dataclasses import asdict

    from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
    from lerobot.processor import DataProcessorPipeline
    from lerobot.processor.normalize_processor import NormalizerProcessorStep, UnnormalizerProcessorStep
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    inputs, outputs = _features(meta, data)
    mode = {"quantile": "QUANTILES", "meanstd": "MEAN_STD", "none": "IDENTITY"}[stats.mode]
    state_mode = "QUANTILES" if mode == "QUANTILES" else ("MEAN_STD" if mode == "MEAN_STD" else "IDENTITY")
    mapping = {"VISUAL": "IDENTITY", "STATE": state_mode, "ACTION": mode}
    config = {
        "type": POLICY_TYPE, "n_obs_steps": 1, "normalization_mapping": mapping,
        "input_features": inputs, "output_features": outputs, "device": "cuda", "use_amp": False,
        "action_steps_per_latent_frame": data.action_steps, "temporal_stride": data.stride,
        "action_channels": norm["channels"], "wanva_config": asdict(model_cfg), "license": "apache-2.0",
        "note": "weights in flexpack's WanVA names; flexpack.models.WanVA(WanVAConfig(**wanva_config)).load_state_dict",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2, default=list) + "\n")
    save_file({k: v.to(dtype).contiguous() for k, v in state_dict.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt", "flexpack": POLICY_TYPE})

    features = {k: PolicyFeature(type=FeatureType(v["type"]), shape=tuple(v["shape"]))
                for k, v in {**inputs, **outputs}.items()}
    norm_map = {FeatureType(k): NormalizationMode(v) for k, v in mapping.items()}
    tensors = stats_tensors(stats, pooled, [k for k in features if k in pooled or k == "action"])
    pre = NormalizerProcessorStep(features=features, norm_map=norm_map, stats=tensors)
    post = UnnormalizerProcessorStep(features={"action": features["action"]}, norm_map=norm_map, stats=tensors)
    DataProcessorPipeline([pre], name="policy_preprocessor").save_pretrained(folder)
    DataProcessorPipeline([post], name="policy_postprocessor").save_pretrained(folder)
    return folder


def write_extras(out: Path, *, run: Path, composed: Run, state_dict: dict[str, torch.Tensor], stats: ActionStats,
                 norm: dict[str, Any], step: int, ema: bool, dtype: torch.dtype = torch.float32,
                 policy: bool = True) -> None:
    """The model card and (``policy``) the LeRobot-style policy folder inside the export folder ``out`` of the run
    folder ``run``, whose checkpoint ``composed`` is (its ``"export"`` run)."""
    from flexpack.data import action_stats, cache
    from flexpack.data.episodes import EpisodeSource

    data = composed.config.data
    source = EpisodeSource(data.root)
    latents = data.latents_dir or cache.default_latents_dir(source.root)
    pooled = action_stats.pooled(source, latents)
    cams = list(data.cameras) if data.cameras else list(source.video_keys)
    info = {"episodes": len(source.episodes), "frames": pooled["frames"], "cameras": cams}
    card = model_card(run=run, composed=composed, step=step, norm=norm, ema=ema, dataset_info=info)
    (out / "README.md").write_text(card)
    if policy:
        write_policy_folder(out / POLICY_DIR, data=data, model_cfg=composed.model_config, state_dict=state_dict,
                            stats=stats, norm=norm, pooled=pooled["features"], meta=source.meta, dtype=dtype)
