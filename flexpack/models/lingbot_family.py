"""Deprecated: moved to :mod:`flexpack.families.lingbot.family` (this path goes in flexpack 0.3; ``CHANGELOG.md``)."""

from flexpack.families.lingbot import family as _new
from flexpack.training.deprecated import moved

__getattr__ = moved(__name__, _new)
