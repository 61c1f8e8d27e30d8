"""Tools over a trained run: export, verify, the config reference and the demo summary."""
