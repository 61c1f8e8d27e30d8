"""The ``lingbot-va`` registry entry: LeRobot's ``lingbot_va`` policy as a flexpack model family.

How a training config's keys apply to this family (``docs/USAGE.md`` says the same for users):

``model.overrides`` take :class:`~flexpack.families.lingbot.config.LingbotConfig`'s fields (LeRobot's names)
and the names other families' configs use:

* ``action_channels = N``: the dataset's ``N`` action columns fill channels ``0..N-1`` of LeRobot's action
  space (``used_action_channel_ids = [0, ..., N-1]``; ``action_dim``, the action space, stays 30 as every
  released checkpoint has it). Set ``used_action_channel_ids`` itself for another placement.
* ``num_heads`` and ``head_dim`` are ``num_attention_heads`` and ``attention_head_dim``; ``dim`` is refused
  (it is their product: set those two).
* ``attn_backend``, ``in_channels``, ``out_channels``, ``text_dim``, ``freq_dim``, ``ffn_dim``,
  ``num_layers``, ``patch_size``, ``eps``, ``cross_attn_norm`` are the same fields.

``model.mask`` is ``"lingbot"`` (its default for this family); ``model.chunk_size`` is refused: the chunk size
and the window are drawn per episode from ``chunk_range`` and ``window_range``, as LeRobot draws them per step.

``objective`` (:func:`apply_objective`): ``shift``, ``action_shift`` and ``num_train_timesteps`` set to
other values than their defaults become ``snr_shift``, ``action_snr_shift`` and ``num_train_timesteps`` (the
same quantities; at their defaults the family's values stay, and setting both a key and its field is an
error); ``latent_weight`` / ``action_weight`` weight the two loss parts as for every family (LeRobot: 1 and
1); ``weighting``, ``chunk_size`` and ``teacher_forcing`` are refused away from their defaults: LeRobot's
objective weights each step by its noise grid, draws a step per frame and always has the clean copy.

Data (:func:`conventions`): a batch's actions are ``action_dim`` wide, the dataset's columns placed at
``used_action_channel_ids`` (the action mask True there); the latents join ``obs_cam_keys`` on width in
that order (empty: the dataset's cameras); ``data.action_steps`` must be ``action_per_frame``; latent frame
``f``'s action steps are the actions taken at video frames ``4f-4 .. 4f-1`` (:data:`ACTION_OFFSET`), frame 0
has none; every episode's text is zero padded to ``max_sequence_length`` tokens, all attended, as LeRobot
encodes a prompt.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from flexpack.families.lingbot.config import LingbotConfig
from flexpack.models.conventions import Alias, DataConventions

NAME = "lingbot-va"

# latent frame f carries the actions taken at video frames 4f-4 .. 4f-1, the ones that lead to its frames (as the
# LingBot-VA training data aligns them and LeRobot's select_action executes a predicted frame's actions); frame 0 none
ACTION_OFFSET = 1
# the fields a LeRobot checkpoint's config decides (its tensors' shapes; rope_max_seq_len shapes nothing)
SHAPE_FIELDS = ("patch_size", "num_attention_heads", "attention_head_dim", "in_channels", "out_channels",
                "action_dim", "text_dim", "freq_dim", "ffn_dim", "num_layers", "cross_attn_norm", "eps")
# LoRA's default targets: the attention projections (LeRobot's attn1 / attn2 to_q, to_k, to_v, to_out.0) and FFN
# linears (ffn.net.0.proj, ffn.net.2) of every block, under the model's names (flexpack's Wan blocks)
LORA_TARGETS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o",
                "cross_attn.q", "cross_attn.k", "cross_attn.v", "cross_attn.o", "ffn.fc1", "ffn.fc2")
# objective key -> LingbotConfig field meaning the same
OBJECTIVE_FIELDS = {"shift": "snr_shift", "action_shift": "action_snr_shift",
                    "num_train_timesteps": "num_train_timesteps"}
# objective keys with no counterpart in LeRobot's objective -> why
OBJECTIVE_REFUSED = {
    "weighting": "LeRobot's objective weights every noise step by its grid's training weights",
    "chunk_size": "LeRobot's objective draws a noise step per latent frame",
    "teacher_forcing": "the family always sees a clean copy of every frame (its mask is 'lingbot')",
}


def _channels(n: Any) -> tuple[int, ...]:
    """``action_channels = n`` -> the first ``n`` channels of the action space."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"model.overrides.action_channels must be >= 1 for model.family = {NAME!r} (the dataset's "
                         f"action columns fill channels 0..N-1 of the action space), got {n!r}")
    return tuple(range(n))


ALIASES = {"num_heads": "num_attention_heads", "head_dim": "attention_head_dim",
           "action_channels": Alias(field="used_action_channel_ids", type=int, convert=_channels)}
REFUSED = {"dim": "it is num_attention_heads * attention_head_dim; set those two"}


def apply_objective(config: LingbotConfig, objective: Any, overridden: frozenset[str]) -> LingbotConfig:
    """``config`` with the objective section's keys that mean the same for this family (see the module
    docstring); ``overridden``: the config fields ``model.overrides`` sets. ValueError, one line, for a key
    that does not apply or that contradicts its ``model.overrides`` field."""
    defaults = type(objective)()
    changed = [k for k in ("shift", "action_shift", "num_train_timesteps", *OBJECTIVE_REFUSED)
               if getattr(objective, k) != getattr(defaults, k)]
    kw: dict[str, Any] = {}
    for key in changed:
        value = getattr(objective, key)
        if key in OBJECTIVE_REFUSED:
            raise ValueError(f"objective.{key} = {value!r} does not apply to model.family = {NAME!r}: "
                             f"{OBJECTIVE_REFUSED[key]}; drop it")
        name = OBJECTIVE_FIELDS[key]
        if name in overridden:
            raise ValueError(f"objective.{key} = {value!r} and model.overrides.{name} both set the {NAME} "
                             f"{name}; keep one")
        if name == "num_train_timesteps":
            if value != int(value):
                raise ValueError(f"objective.num_train_timesteps = {value!r}: the {NAME} noise grid has a whole "
                                 "number of steps")
            value = int(value)
        kw[name] = value
    return replace(config, **kw) if kw else config


def conventions(config: LingbotConfig) -> DataConventions:
    """The data a ``lingbot-va`` model trains on (see the module docstring)."""
    return DataConventions(action_dim=config.action_dim, action_channels=tuple(config.used_action_channel_ids),
                           cameras=tuple(config.obs_cam_keys), action_offset=ACTION_OFFSET,
                           action_steps=config.action_per_frame,
                           text_tokens=config.max_sequence_length,
                           action_dim_field="action_dim", action_channels_field="used_action_channel_ids",
                           cameras_field="obs_cam_keys", action_steps_field="action_per_frame")
