"""Which exceptions are the user's to fix, and how the command line reports them; names that moved.

A *user error* is one a user can act on without reading code: a config key or value, a file, an
episode. The command line prints it as ``flexpack CMD: error: <one line>`` and exits 2; anything
else is a bug and keeps its traceback (``flexpack --debug CMD`` shows tracebacks for both).

User errors are:

- :class:`UserError`, raised where a message has been written for the user;
- the dataset's :class:`~flexpack.data.problems.DatasetProblemError` records (file, episode, kind);
- an ``OSError`` of a full or read-only place (``ENOSPC``, ``EDQUOT``, ``EFBIG``, ``EROFS``), wherever
  it is raised: the disk, not the code, is what the user fixes;
- ``ValueError`` and the file-system ``OSError`` kinds (missing file, not a directory, no
  permission, ...) *raised by flexpack's own code*: the project's convention is that user input
  is checked with a ``ValueError`` naming the value. The same types raised inside torch or
  another library are taken as bugs of the caller (a shape flexpack should have checked), so
  they keep their traceback.

A name that moved keeps its old path for one minor version (``CHANGELOG.md`` lists them): its old module sets
``__getattr__ = moved_names(__name__, {name: new module})``, and reading the name warns with a
``DeprecationWarning`` naming the new place (at the reading line), then returns it from the new module, imported
only then (the new module may import the old). Whole modules that moved are
:func:`flexpack.training.deprecated.moved`'s.
"""

from __future__ import annotations

import errno
import importlib
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

_PACKAGE = Path(__file__).resolve().parent
_OS_USER = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, FileExistsError)
_FULL = {errno.ENOSPC, errno.EFBIG, errno.EROFS, getattr(errno, "EDQUOT", errno.ENOSPC)}


class UserError(ValueError):
    """A problem with the user's input, worded for the user: one line, exit status 2."""


def _raised_in_flexpack(exc: BaseException) -> bool:
    files = re.findall(r'File "([^"]+)"', str(exc)) if "Original Traceback" in str(exc) else []
    if not files:  # not re-raised from a DataLoader worker: the innermost frame of its own traceback
        tb = exc.__traceback__
        while tb is not None:
            files.append(tb.tb_frame.f_code.co_filename)
            tb = tb.tb_next
    return bool(files) and _PACKAGE in Path(files[-1]).resolve().parents


def is_user_error(exc: BaseException) -> bool:
    """True when ``exc`` is the user's to fix (see the module docstring)."""
    if isinstance(exc, UserError):
        return True
    # by name, so that classifying an error never imports the data wing (and torch with it)
    if isinstance(exc, OSError) and exc.errno in _FULL:
        return True
    if any(c.__name__ == "DatasetProblemError" and c.__module__ == "flexpack.data.problems" for c in type(exc).__mro__):
        return True
    return isinstance(exc, (ValueError, *_OS_USER)) and _raised_in_flexpack(exc)


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line.

    An exception re-raised from a DataLoader worker carries the worker's whole traceback in its
    message; its last line (``Type: message``) is the original message.
    """
    text = str(exc) if not isinstance(exc, OSError) or not exc.filename else _os_message(exc)
    if "Original Traceback" in text:
        last = [line for line in text.splitlines() if line.strip()][-1]
        text = re.sub(r"^[\w.]+: ", "", last.strip())
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return "; ".join(lines) if lines else type(exc).__name__


def _os_message(exc: OSError) -> str:
    return f"{exc.filename}: {exc.strerror or exc}"


REMOVED_IN = "0.3"


def moved_names(module: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``module``, whose ``names`` moved each to the module it maps to."""

    def __getattr__(name: str) -> Any:
        new = names.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} is deprecated: it moved to {new}; import it from there (the old path goes "
                      f"in flexpack {REMOVED_IN})", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new), name)

    return __getattr__
