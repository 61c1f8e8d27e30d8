"""Deprecated: moved to :mod:`flexpack.run.config` (this path goes in flexpack 0.3; ``CHANGELOG.md``)."""

from flexpack.run import config as _new
from flexpack.training.deprecated import moved

__getattr__ = moved(__name__, _new)
