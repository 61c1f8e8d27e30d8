"""Deprecated: moved to :mod:`flexpack.families.wan.convert` (this path goes in flexpack 0.3; ``CHANGELOG.md``)."""

from flexpack.families.wan import convert as _new
from flexpack.training.deprecated import moved

__getattr__ = moved(__name__, _new)
