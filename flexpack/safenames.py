"""File names derived from data (camera keys, task strings, repo ids) stay inside their folder.

:func:`safe_component` turns any text into one path component: letters, digits and ``_ - . +``
are kept, every other character (``/``, ``\\``, NUL, spaces, ...) becomes ``_``, and a name that
would start with a dot (``.``, ``..``, a hidden file) gets a leading ``_``. Ordinary names
(``wrist``, ``cam_high``, ``top.rgb``) are unchanged, so existing caches keep their paths.
:func:`inside` checks that a joined path did not leave its folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_UNSAFE = re.compile(r"[^A-Za-z0-9_.+-]")


def safe_component(text: str, *, max_len: int = 200) -> str:
    """``text`` as a single, harmless path component (see the module doc)."""
    name = _UNSAFE.sub("_", str(text))[:max_len]
    if not name or name.startswith("."):
        name = "_" + name
    return name


def inside(folder: str | os.PathLike, path: str | os.PathLike) -> Path:
    """``path`` if it lies under ``folder`` once resolved; ValueError naming both otherwise."""
    base, full = Path(folder).resolve(), Path(path).resolve()
    if full != base and base not in full.parents:
        raise ValueError(f"{path}: leaves {folder} (a name from the data must stay inside its folder)")
    return Path(path)
