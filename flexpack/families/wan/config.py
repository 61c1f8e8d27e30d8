"""Shape and options of :class:`~flexpack.families.wan.model.WanVA`, and its presets.

Its own module so that the diffusers conversion (:mod:`flexpack.families.wan.convert`) needs the
config but not the model class, which the loaders take as an argument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from flexpack.models.rope import ACTION_POSITIONS, rope_bands


@dataclass(frozen=True, kw_only=True)
class WanVAConfig:
    """Shape and options of :class:`WanVA` (defaults: the Wan 2.2 5B shape, video only)."""

    dim: int = 3072
    num_heads: int = 24
    ffn_dim: int = 14336
    num_layers: int = 30
    patch_size: tuple[int, int, int] = (1, 2, 2)
    in_channels: int = 48
    out_channels: int | None = None  # None: same as in_channels
    action_channels: int = 0  # 0: no action stream
    text_dim: int = 4096
    freq_dim: int = 256
    eps: float = 1e-6
    cross_attn_norm: bool = True
    rope_theta: float = 10000.0
    # RoPE position of action tokens (flexpack.models.rope): "step" = each action step of a frame at its own
    # fractional frame offset (LingBot-VA's rule); "frame" = at the frame's position (checkpoints made before it)
    action_positions: str = "step"
    attn_backend: str = "auto"
    # checkpoint every block inside forward, for direct users of the model; training configs cannot set
    # it (model.overrides refuses it): there parallel.activation_checkpointing wraps blocks from outside
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        for name in ("dim", "num_heads", "ffn_dim", "num_layers", "in_channels", "text_dim", "freq_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"WanVAConfig.{name} must be positive, got {getattr(self, name)}")
        if self.dim % self.num_heads:
            raise ValueError(f"WanVAConfig.dim={self.dim} is not divisible by num_heads={self.num_heads}")
        rope_bands(self.dim // self.num_heads)  # raises for an odd head_dim
        if len(self.patch_size) != 3 or min(self.patch_size) <= 0:
            raise ValueError(f"WanVAConfig.patch_size must be 3 positive ints, got {self.patch_size}")
        if self.action_positions not in ACTION_POSITIONS:
            raise ValueError(f"WanVAConfig.action_positions must be one of {ACTION_POSITIONS}, "
                             f"got {self.action_positions!r}")
        if self.action_channels < 0:
            raise ValueError(f"WanVAConfig.action_channels must be >= 0, got {self.action_channels}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def out_dim(self) -> int:
        return self.out_channels or self.in_channels

    @property
    def patch_volume(self) -> int:
        return math.prod(self.patch_size)


# the rule of weights that record none: checkpoints and exports made before per-step action positions
LEGACY_ACTION_POSITIONS = "frame"


def check_action_positions(saved: str | None, config: Any, where: str) -> None:
    """Refuse, in one line, weights whose action tokens were trained at other RoPE positions than
    ``config`` (a model config) gives them: the model would run but compute something else.
    ``saved``: the rule the weights record, None for none (:data:`LEGACY_ACTION_POSITIONS`).
    Models without an action stream, or whose config has no such rule, pass."""
    mine = getattr(config, "action_positions", None)
    if mine is None or not getattr(config, "action_channels", 0):
        return
    rule = saved or LEGACY_ACTION_POSITIONS
    if rule != mine:
        why = " (it records no rule: made before per-step action positions)" if saved is None else ""
        raise ValueError(f"{where}: its action tokens were trained with action_positions = {rule!r}{why}, the config "
                         f"builds {mine!r}; to load it set model.overrides.action_positions = '{rule}' "
                         f"(--set model.overrides.action_positions={rule})")


PRESETS: dict[str, WanVAConfig] = {
    # CPU tests and the demo: a train step in a few milliseconds.
    "tiny": WanVAConfig(
        dim=64, num_heads=4, ffn_dim=128, num_layers=2, in_channels=4, action_channels=7, text_dim=32, freq_dim=32
    ),
    # The CPU demo on Wan-VAE-shaped latents (48 channels, 2x2 patches): one video token carries 48 x 2 x 2 = 192
    # numbers and the velocity of all of them passes through `dim`; "tiny"'s 64 cannot carry it (the noise in the
    # other 128 directions is never removed: held-out latent MSE 0.70, ten times repeating the last frame), 256 can.
    "small": WanVAConfig(
        dim=256, num_heads=4, ffn_dim=512, num_layers=2, in_channels=48, action_channels=6, text_dim=64, freq_dim=32
    ),
    # Wan 2.2 TI2V-5B transformer shape; 30 action channels is a LingBot-style action vector width.
    "wan2.2-5b": WanVAConfig(
        dim=3072, num_heads=24, ffn_dim=14336, num_layers=30, in_channels=48, action_channels=30, text_dim=4096,
        freq_dim=256,
    ),
}


def wan_config(name: str, **overrides: Any) -> WanVAConfig:
    """A preset (``"tiny"``, ``"small"``, ``"wan2.2-5b"``) with keyword overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown WanVA preset {name!r}; known: {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)
