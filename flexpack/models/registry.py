"""Model families: one registry entry per family, as torchtitan's ``ModelSpec``.

An entry says everything the rest of flexpack needs to know about a family: its name, config class
and presets, how a config is built from a preset and overrides, the model class, how a checkpoint's
config and tensors map onto the family's (weight converters), which tensors a checkpoint may lack
and how they start, the block container that ``parallel/`` wraps, compiles and shards block by block,
the self-attention masks it trains with, how many copies of an episode it sees (noisy, or noisy and
clean), and the export formats it writes. The run (:mod:`flexpack.run.root`), the geometry, the collate,
the objective and the sampler ask the family; nothing else branches on a family's name.

Every family config offers the shape properties generic code reads (``patch_size``, ``in_channels``,
``out_dim``, ``action_channels``, ``text_dim``, ``dim``, ``num_heads``, ``head_dim``, ``ffn_dim``,
``num_layers``, ``attn_backend``), whatever its own field names are.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from torch import Tensor, nn


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    """One model family (see the module docstring)."""

    name: str
    config_class: type
    presets: Mapping[str, Any]  # preset name -> config
    model_class: type[nn.Module]  # ``model_class(config)`` builds a randomly initialized model
    # override names as configs write them (e.g. ``action_channels``) -> the family's own field
    aliases: Mapping[str, str] = field(default_factory=dict)
    # a checkpoint's config.json -> a config of the family's shape (pretrained weights)
    read_checkpoint_config: Callable[[Mapping[str, Any]], Any] | None = None
    shape_fields: tuple[str, ...] = ()  # the fields a checkpoint's config decides
    # one checkpoint tensor under the model's name (and shape), or None when the model has no counterpart
    convert_tensor: Callable[[str, Tensor], tuple[str, Tensor] | None] | None = None
    # the tensors a checkpoint of this family may lack, freshly drawn from the global RNG (by name)
    fresh_tensors: Callable[[Any], dict[str, Tensor]] = lambda config: {}
    # a whole checkpoint (file or folder) as a model of ``config``, built without a random init first
    load_checkpoint: Callable[[str, Any], nn.Module] | None = None
    blocks: str = "blocks"  # the ModuleList of transformer blocks (parallelize, float8, checkpointing)
    masks: tuple[str, ...] = ("document",)  # self-attention masks (model.mask) the family trains with
    copies_with_teacher_forcing: bool = True  # a clean copy exactly under objective.teacher_forcing
    export_formats: tuple[str, ...] = ()

    def config(self, preset: str, **overrides: Any) -> Any:
        """The preset with ``overrides`` (their names as configs write them, aliases resolved)."""
        if preset not in self.presets:
            label = self.config_class.__name__.removesuffix("Config")
            raise ValueError(f"unknown {label} preset {preset!r}; known: {sorted(self.presets)}")
        return dataclasses.replace(self.presets[preset], **self.fields(overrides))

    def fields(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """``overrides`` under the family's field names (an alias and its field together are refused)."""
        out: dict[str, Any] = {}
        for key, value in overrides.items():
            name = self.aliases.get(key, key)
            if name in out:
                raise ValueError(f"model.overrides sets {name} twice (as {key!r} and as {name!r})")
            out[name] = value
        return out

    def field_names(self) -> set[str]:
        """Override names this family takes: its config's fields and the aliases."""
        return {f.name for f in dataclasses.fields(self.config_class)} | set(self.aliases)

    def build(self, config: Any) -> nn.Module:
        return self.model_class(config)


_FAMILIES: dict[str, Callable[[], ModelFamily]] = {}


def register(name: str, make: Callable[[], ModelFamily]) -> None:
    """Register a family under ``name``; ``make`` builds its entry on first use (imports stay lazy)."""
    _FAMILIES[name] = functools.cache(make)


def family(name: str) -> ModelFamily:
    """The registered family ``name`` (``model.family``), or a ValueError naming the known ones."""
    if name not in _FAMILIES:
        raise ValueError(f"model.family must be one of {sorted(_FAMILIES)}, got {name!r}")
    return _FAMILIES[name]()


def families() -> list[str]:
    return sorted(_FAMILIES)


def _wanva() -> ModelFamily:
    from .wan import WanVA, action_stream_init
    from .wan_config import PRESETS, WanVAConfig
    from .wan_convert import SHAPE_FIELDS, config_from_diffusers, convert_tensor

    return ModelFamily(name="wanva", config_class=WanVAConfig, presets=PRESETS, model_class=WanVA,
                       read_checkpoint_config=config_from_diffusers, shape_fields=SHAPE_FIELDS,
                       convert_tensor=convert_tensor, fresh_tensors=action_stream_init,
                       load_checkpoint=lambda path, config: WanVA.from_diffusers_file(path, config),
                       masks=("document", "chunk_causal", "teacher_forcing"),
                       export_formats=("diffusers", "lerobot_policy"))


register("wanva", _wanva)
