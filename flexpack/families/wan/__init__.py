"""The Wan family (wanva): the Wan video-action DiT, its config, presets, diffusers conversion and export."""
