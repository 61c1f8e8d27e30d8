"""The packing core: samplers, bin packing, collates, the sequence layout and waste stats; imports nothing else of flexpack but ``flexpack.atomic``."""
