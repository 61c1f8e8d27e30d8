"""Names into objects for the model: the family of ``model.family`` and its resolved model config.

:class:`~flexpack.run.config.TrainConfig` is plain data: building it looks nothing up and reads no file. What the
model section names is turned into objects here, on demand, and :func:`flexpack.run.compose.compose` does it once
per run (every other part of the run reads ``Run.family`` / ``Run.model_config``):

- :func:`config_family`: the :class:`~flexpack.models.registry.ModelFamily` registry entry of ``model.family``;
- :func:`model_config_of`: the family's preset, then the shape trained weights record (``model.recorded``: what
  ``flexpack sample`` pins, :func:`flexpack.run.state.trained.pinned`), then ``model.overrides``, then
  ``model.pretrained``'s ``config.json`` (read here, the one disk read of a config), then the objective section
  where the family maps it onto its own fields;
- :func:`check`: what validating a config needs the registry and the mask table for (the family's masks, chunk
  sizes, teacher forcing, a sampler for ``sample.every``, LoRA targets), with ``model.mask`` filled in with the
  family's default. :func:`~flexpack.run.config.load_config` calls it, so a bad key is blamed on its file or
  ``--set``; ``compose`` calls it again on whatever config it is given.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import TYPE_CHECKING, Any

from flexpack.run.config_parse import check_type

if TYPE_CHECKING:  # the config is not imported: flexpack.run.config's loader calls check()
    from flexpack.models.registry import ModelFamily, ModelShape

TrainConfig = ModelConfig = Any  # flexpack.run.config's classes


def config_family(cfg: TrainConfig | ModelConfig) -> ModelFamily:
    """The :class:`~flexpack.models.registry.ModelFamily` of ``model.family`` (a config or its model section)."""
    from flexpack.models.registry import family

    return family(getattr(cfg, "model", cfg).family)


def base_model_config(model: ModelConfig) -> ModelShape:
    """The family's config of the model section before any objective: the preset, the recorded shape
    (``model.recorded``: its shape fields and the family's checkpoint defaults where ``model.overrides`` does not set
    them), the overrides, then ``model.pretrained``'s shape. Errors name the key as a user writes it."""
    fam = config_family(model)
    known = fam.field_names()
    unknown = sorted(set(model.overrides) - known)
    if unknown:
        raise ValueError(f"model.overrides has unknown {fam.config_class.__name__} fields {unknown} "
                         f"(known: {sorted(known)})")
    hints = typing.get_type_hints(fam.config_class)
    keep, given = (*fam.shape_fields, *fam.checkpoint_defaults), fam.fields(model.overrides)
    recorded = {k: v for k, v in model.recorded.items() if k in keep and k not in given}
    kw = {k: check_type(v, hints[k], f"{model.recorded_from}: {k}") for k, v in recorded.items()}
    kw.update({k: check_type(v, fam.override_type(k, hints), f"model.overrides.{k}")
               for k, v in model.overrides.items()})
    prefix = f"{fam.config_class.__name__}."
    try:
        wc = fam.config(model.preset, **kw)
    except (ValueError, TypeError) as exc:  # named as the config writes them
        text = str(exc).replace(prefix, "model.overrides.")
        raise ValueError(f"model.preset = {model.preset!r}: {text}" if "preset" in text else text) from None
    if model.pretrained:
        from flexpack.run.pretrained import pretrained_config

        try:
            wc = pretrained_config(model.pretrained, wc, fam.fields(kw), fam)
        except (ValueError, TypeError) as exc:  # named after the key, so a --set of it is blamed
            text = str(exc).replace(prefix, "model.overrides.")
            named = "model.pretrained" in text or "model.overrides" in text
            raise ValueError(text if named else f"model.pretrained = {model.pretrained!r}: {text}") from None
    from flexpack.attention.flex import BACKENDS

    if wc.attn_backend not in BACKENDS:  # else only met when the model is built, after the data
        raise ValueError(f"model.overrides.attn_backend must be one of {BACKENDS}, got {wc.attn_backend!r}")
    return wc


def model_config_of(cfg: TrainConfig) -> ModelShape:
    """The family's resolved model config of ``cfg`` (:func:`base_model_config` with the objective section applied
    where the family says so: :attr:`~flexpack.models.registry.ModelFamily.apply_objective`). Each call resolves
    afresh (``model.pretrained``'s config.json included): a run holds the result (``Run.model_config``)."""
    fam = config_family(cfg)
    base = base_model_config(cfg.model)
    if fam.apply_objective is None:
        return base
    return fam.apply_objective(base, cfg.objective, frozenset(fam.fields(cfg.model.overrides)))


def with_default_mask(cfg: TrainConfig, fam: ModelFamily) -> TrainConfig:
    """``cfg`` with an empty ``model.mask`` set to the family's default (``fam.masks[0]``), else ``cfg`` itself."""
    if cfg.model.mask:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mask=fam.masks[0]))


def _check_mask(cfg: TrainConfig, fam: ModelFamily) -> TrainConfig:
    """``model.mask`` (the family's default where empty), ``model.chunk_size`` and ``objective.teacher_forcing``
    against the mask table; returns ``cfg`` with the default mask written in (and so into its saved copy)."""
    from flexpack.attention.masks import mask_kind  # the mask table: what each mask takes

    cfg = with_default_mask(cfg, fam)
    m = cfg.model
    if m.mask not in fam.masks:
        raise ValueError(f"model.mask must be one of {fam.masks} for model.family = {m.family!r}, got {m.mask!r}")
    chunked = mask_kind(m.mask).chunked
    if chunked and (m.chunk_size is None or m.chunk_size <= 0):
        raise ValueError(f"model.mask={m.mask!r} needs a positive model.chunk_size, got {m.chunk_size!r}")
    if not chunked and m.chunk_size is not None:
        if not fam.chunk_masks:
            raise ValueError(f"model.chunk_size={m.chunk_size!r} does not apply to model.family = {m.family!r} (its "
                             "chunk size is drawn per episode, see model.overrides.chunk_range); drop model.chunk_size")
        raise ValueError(f"model.chunk_size={m.chunk_size!r} has no effect with model.mask={m.mask!r}; "
                         f"set model.mask to {' or '.join(repr(x) for x in fam.chunk_masks)}, or drop chunk_size")
    return cfg


def check(cfg: TrainConfig) -> tuple[TrainConfig, ModelShape]:
    """``cfg`` checked where the registry and the mask table decide (see the module docstring), with the family's
    default mask filled in, and its resolved model config (:func:`model_config_of`)."""
    from flexpack.attention.masks import mask_kind

    fam = config_family(cfg)  # an unknown family: the registry's one line, naming the known ones
    model_cfg = model_config_of(cfg)  # unknown preset or override fields raise here
    cfg = _check_mask(cfg, fam)
    if cfg.sample.every and not fam.samples:
        raise ValueError(f"sample.every={cfg.sample.every}: model.family = {cfg.model.family!r} "
                         "has no sampler yet; set sample.every = 0")
    tf_mask = mask_kind(cfg.model.mask).teacher_forcing
    if cfg.objective.teacher_forcing and not tf_mask:
        takers = " or ".join(repr(m) for m in fam.masks if mask_kind(m).teacher_forcing) or "a teacher-forcing mask"
        raise ValueError(f"objective.teacher_forcing needs model.mask = {takers}, got {cfg.model.mask!r}")
    if tf_mask and not cfg.objective.teacher_forcing:
        # without the clean copy every token is noisy: attention would shrink to the own chunk
        raise ValueError(f"model.mask = {cfg.model.mask!r} needs objective.teacher_forcing = true (the clean copy)")
    if cfg.objective.latent_weight == 0 and not model_cfg.action_channels:
        raise ValueError("objective.latent_weight = 0 on a model without actions (action_channels = 0): "
                         "the loss would be 0; set objective.latent_weight > 0")
    if cfg.lora.rank:
        from flexpack.run.lora import check_targets

        check_targets(cfg, model_cfg, fam)
    return cfg, model_cfg


def checked(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` as :func:`check` returns it (the model config dropped)."""
    return check(cfg)[0]



def lora_record(cfg: TrainConfig) -> dict[str, Any] | None:
    """The LoRA options as a checkpoint records them (:func:`flexpack.run.lora.lora_record`, the targets resolved
    with ``model.family``'s defaults), None without LoRA."""
    from flexpack.run.lora import lora_record as record

    return record(cfg, config_family(cfg))
