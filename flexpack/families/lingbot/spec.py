"""The ``lingbot-va`` registry entry: LeRobot's ``lingbot_va`` policy as a flexpack model family (what each
config key means for it: :mod:`flexpack.families.lingbot.family`). Importing this module registers the family
(:func:`flexpack.models.registry.register`); its entry is built on first use, which also registers its mask
(``"lingbot"``: :mod:`flexpack.families.lingbot.mask`)."""

from __future__ import annotations

from typing import Any, Mapping

from flexpack.families.lingbot.family import NAME
from flexpack.models.registry import ExportFormat, ModelFamily, register


def export_normalization(run: Any, state: Mapping[str, Any], where: str,
                         dataset: str | None = None) -> tuple[Any, dict[str, Any]] | None:
    """The statistics and ``normalization.json`` record an export of ``run`` (the checkpoint's ``"export"``
    :class:`~flexpack.run.root.Run`) on a lingbot-bundle writes for the
    source ``dataset`` names (``--dataset``; a mixture's entry: its own), the model space's q01 / q99 and the
    source columns': :func:`flexpack.families.lingbot.export_bundle.bundle_normalization`; None for a run on other
    data (flexpack's rule)."""
    from flexpack.data.formats import is_bundle

    if not is_bundle(run.config.data):
        return None
    from flexpack.families.lingbot.export_bundle import bundle_normalization

    return bundle_normalization(run, state, where, dataset)


def lingbot_va() -> ModelFamily:
    from flexpack.families.lingbot import mask  # noqa: F401  (registers the "lingbot" mask)
    from flexpack.families.lingbot.config import (
        COPIES,
        LEROBOT_INFERENCE,
        LEROBOT_TRAINING,
        PRESETS,
        LingbotConfig,
        camera_layout_of,
        config_from_lerobot,
    )
    from flexpack.families.lingbot.convert import convert_tensor, lingbot_files, load_checkpoint
    from flexpack.families.lingbot.export_lerobot import check_export, write_lerobot
    from flexpack.families.lingbot.export_upstream import write_upstream
    from flexpack.families.lingbot.family import (
        ALIASES,
        LORA_TARGETS,
        REFUSED,
        SHAPE_FIELDS,
        apply_objective,
        conventions,
    )
    from flexpack.families.lingbot.model import LingbotVA
    from flexpack.families.lingbot.objective import LingbotObjective
    from flexpack.families.lingbot.sampler import LingbotSampler

    exports = {
        "lerobot": ExportFormat(writer=write_lerobot, check=check_export,
                                package="lerobot.policies.lingbot_va.modeling_lingbot_va", extra="hf",
                                load="lerobot's LingBotVAPolicy.from_pretrained({out!r}) and make_pre_post_processors",
                                options={"wan_pretrained_path": "LeRobot's frozen VAE and text encoder",
                                         "allow_unrunnable": "a policy LeRobot runs with its own VAE and text "
                                                             "encoder"}),
        "lingbot-upstream": ExportFormat(writer=write_upstream, package="safetensors",
                                         load="upstream LingBot-VA's load_transformer({out!r} + '/transformer', ...); "
                                              "its config fields in {out}/flexpack_export.json"),
    }
    return ModelFamily(name=NAME, config_class=LingbotConfig, presets=PRESETS, model_class=LingbotVA,
                       aliases=ALIASES, refused=REFUSED, read_checkpoint_config=config_from_lerobot,
                       shape_fields=SHAPE_FIELDS, checkpoint_defaults=LEROBOT_TRAINING + LEROBOT_INFERENCE,
                       checkpoint_files=lingbot_files, checkpoint_layout=camera_layout_of,
                       convert_tensor=convert_tensor, load_checkpoint=load_checkpoint,
                       mask="lingbot", copies=COPIES, objective=LingbotObjective, apply_objective=apply_objective,
                       conventions=conventions, sampler=LingbotSampler, sampling_fields=LEROBOT_INFERENCE,
                       exports=exports, export_normalization=export_normalization, lora_targets=LORA_TARGETS)


register(NAME, lingbot_va)
