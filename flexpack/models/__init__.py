"""Models: the Wan-style video-action DiT (:class:`WanVA`), its config and presets, diffusers conversion;
LeRobot's LingBot-VA on the same blocks (:class:`LingbotVA`, its config, presets and LeRobot conversion).

Import the packing layout and the attention layer, never training."""

from .lingbot import LingbotVA
from .lingbot_config import LingbotConfig, lingbot_config
from .wan import WanVA, WanVAOutput
from .wan_config import PRESETS, WanVAConfig, wan_config

__all__ = ["PRESETS", "LingbotConfig", "LingbotVA", "WanVA", "WanVAConfig", "WanVAOutput", "lingbot_config",
           "wan_config"]
