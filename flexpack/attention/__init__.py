"""The attention layer any model can use: mask_mods, block masks, ``FlexAttnFunc``; imports only the layout types from ``flexpack.packing``."""
