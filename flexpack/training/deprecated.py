"""Import paths kept for one minor version after their modules moved (``CHANGELOG.md`` lists them).

Each old module is a small file that warns once, when it is imported, with a ``DeprecationWarning`` naming the
new place, and then reads every name from the new module, so code written against the old path keeps working
(and sees the same objects) until flexpack :data:`REMOVED_IN`.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

from flexpack.errors import REMOVED_IN  # noqa: F401  (flexpack.training.loop reads it here)

# frames a warning skips to reach the importing line: this package's shims and the import system
_SKIP = ("<frozen importlib", os.path.dirname(importlib.__file__), __file__.removesuffix("deprecated.py"))


def moved(old: str, new: ModuleType) -> Callable[[str], Any]:
    """Warn that module ``old`` moved to ``new`` (pointing at the importing line) and return the module
    ``__getattr__`` that reads each name of ``old`` from ``new``."""
    # the old module's own file, wherever it lives (without its suffix: Python 3.12's prefix test never matches a
    # prefix as long as the whole file name)
    shim = os.path.splitext(sys._getframe(1).f_code.co_filename)[0]
    warnings.warn(f"{old} is deprecated: it moved to {new.__name__}; import that instead (the old path goes in "
                  f"flexpack {REMOVED_IN})", DeprecationWarning, skip_file_prefixes=(*_SKIP, shim))

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):  # the import system's questions are the shim's own
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        return getattr(new, name)

    return __getattr__
