"""flexpack: packed, variable-length robot episodes for video/VLA diffusion transformers.

The core (samplers, collates, layout, masks, attention, model, objective) imports without
lerobot; ``flexpack.data`` imports lerobot lazily.
"""

__version__ = "0.1.0"
