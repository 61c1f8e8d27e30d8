"""Models: what every model family shares (the Wan backbone and its blocks, RoPE, the family registry, data
conventions); each family's own code is in its folder, :mod:`flexpack.families` (``families/wan/``,
``families/lingbot/``).

Import the packing layout and the attention layer, never training. The names this package re-exported before
the families moved (``WanVA``, ``LingbotConfig``, ...) still import from here for one minor version, warning with
a ``DeprecationWarning`` that names their new module."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

# name -> the module it moved to (flexpack 0.3 removes these names here; CHANGELOG.md)
_MOVED = {
    "LingbotConfig": "flexpack.families.lingbot.config",
    "LingbotVA": "flexpack.families.lingbot.model",
    "PRESETS": "flexpack.families.wan.config",
    "WanVA": "flexpack.families.wan.model",
    "WanVAConfig": "flexpack.families.wan.config",
    "WanVAOutput": "flexpack.families.wan.model",
    "lingbot_config": "flexpack.families.lingbot.config",
    "wan_config": "flexpack.families.wan.config",
}


def __getattr__(name: str) -> Any:
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"flexpack.models.{name} is deprecated: it moved to {module}; import it from there (the old "
                  "path goes in flexpack 0.3)", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), name)
