"""Deprecated: moved to flexpack.run.state; each module here reads its names from there (goes in 0.3)."""
