"""The ``wanva`` registry entry: flexpack's Wan video-action DiT (:class:`~flexpack.families.wan.model.WanVA`),
diffusers-compatible for the video half. Importing this module registers the family
(:func:`flexpack.models.registry.register`); its entry is built on first use."""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from flexpack.models.registry import WAN_BLOCK_LINEARS, ExportFormat, ModelFamily, register

NAME = "wanva"


def weights_record(model: nn.Module) -> dict[str, Any]:
    """The action tokens' RoPE rule a checkpoint records beside the weights (checked by :func:`check_weights`)."""
    rule = getattr(model.config, "action_positions", None)
    return {} if rule is None else {"action_positions": rule}


def check_weights(train_state: Mapping[str, Any], model: nn.Module, where: str) -> None:
    """Refuse weights whose action tokens were trained at other RoPE positions than the model gives them."""
    from flexpack.families.wan.config import check_action_positions

    check_action_positions(train_state.get("action_positions"), model.config, where)


def wanva() -> ModelFamily:
    from flexpack.families.wan.config import PRESETS, WanVAConfig
    from flexpack.families.wan.convert import (
        SHAPE_FIELDS,
        config_from_diffusers,
        convert_tensor,
        diffusers_files,
    )
    from flexpack.families.wan.export import read_export, write_diffusers
    from flexpack.families.wan.model import WanVA, action_stream_init

    load = "diffusers.WanTransformer3DModel.from_pretrained({out!r}); model card {out}/README.md"
    diffusers = ExportFormat(writer=write_diffusers, package="diffusers", extra="hf", load=load,
                             options={"policy": "its OUT/lerobot_policy/; other formats are a policy folder"})
    return ModelFamily(name=NAME, config_class=WanVAConfig, presets=PRESETS, model_class=WanVA,
                       read_checkpoint_config=config_from_diffusers, shape_fields=SHAPE_FIELDS,
                       checkpoint_files=diffusers_files,
                       convert_tensor=convert_tensor, fresh_tensors=action_stream_init,
                       load_checkpoint=lambda path, config: WanVA.from_diffusers_file(path, config),
                       read_export=read_export, exports={"diffusers": diffusers},
                       weights_record=weights_record, check_weights=check_weights, lora_targets=WAN_BLOCK_LINEARS)


register(NAME, wanva)
