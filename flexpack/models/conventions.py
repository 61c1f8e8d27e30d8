"""The parts of a model family's registry entry (:mod:`flexpack.models.registry`) that its own modules build:
override aliases and the data conventions of its datasets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True, kw_only=True)
class Alias:
    """An override name as other families' configs write it, onto one field of this family: ``convert``
    turns its value (of ``type``, checked when the config loads) into the field's."""

    field: str
    type: Any = None  # None: the field's own type
    convert: Callable[[Any], Any] | None = None


@dataclass(frozen=True, kw_only=True)
class DataConventions:
    """What a family's datasets must look like, as plain values the run reads (the data layer knows no
    family). ``action_dim``: the action width of a batch; ``action_channels``: the channel of each of
    the dataset's action columns, in column order (None: column j -> channel j); ``cameras``: the
    camera keys the latents must join along width, in that order (empty: the dataset's, or
    ``data.cameras``); ``action_offset``: video frames every action step is taken earlier than flexpack's
    default alignment (``flexpack.data.actions``); ``action_steps``: the action steps per latent frame the
    model was built for (None: ``data.action_steps`` decides); ``text_tokens``: every episode's text
    padded with zero rows to this many tokens, all of them attended (``text_len`` = it; None: each text's
    own length). The ``*_field`` fields name the model config field behind each rule, for error messages
    (which say where its value came from: :func:`flexpack.run.pretrained.field_source`); ``action_dim_field`` the
    one of the action space's width."""

    action_dim: int
    action_channels: tuple[int, ...] | None = None
    cameras: tuple[str, ...] = ()
    action_offset: int = 0
    action_steps: int | None = None
    text_tokens: int | None = None
    action_dim_field: str = ""
    action_channels_field: str = ""
    cameras_field: str = ""
    action_steps_field: str = ""
