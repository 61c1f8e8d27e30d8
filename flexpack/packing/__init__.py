"""The packing core: samplers, bin packing, collates, the sequence layout and waste stats.

Imports nothing else of flexpack but ``flexpack.atomic``."""
