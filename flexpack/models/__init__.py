"""Models: the Wan-style video-action DiT (:class:`WanVA`), its config and presets, diffusers conversion.

Import the packing layout and the attention layer, never training."""

from .wan import WanVA, WanVAOutput
from .wan_config import PRESETS, WanVAConfig, wan_config

__all__ = ["PRESETS", "WanVA", "WanVAConfig", "WanVAOutput", "wan_config"]
