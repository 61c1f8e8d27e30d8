"""Models: the Wan-style video-action DiT (:class:`WanVA`) and its presets."""

from .wan import PRESETS, WanVA, WanVAConfig, WanVAOutput, wan_config

__all__ = ["PRESETS", "WanVA", "WanVAConfig", "WanVAOutput", "wan_config"]
