"""Deprecated: moved to :mod:`flexpack.families.lingbot.export_lerobot` (goes in flexpack 0.3; ``CHANGELOG.md``)."""

from flexpack.families.lingbot import export_lerobot as _new
from flexpack.training.deprecated import moved

__getattr__ = moved(__name__, _new)
