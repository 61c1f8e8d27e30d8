"""The attention layer any model can use: mask_mods, block masks, ``FlexAttnFunc``.

Imports only the layout types from ``flexpack.packing``."""
