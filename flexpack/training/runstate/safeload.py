"""Deprecated: moved to :mod:`flexpack.run.state.safeload` (this path goes in flexpack 0.3; ``CHANGELOG.md``)."""

from flexpack.run.state import safeload as _new
from flexpack.training.deprecated import moved

__getattr__ = moved(__name__, _new)
