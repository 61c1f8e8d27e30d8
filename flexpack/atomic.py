"""Atomic file writes: write under a temporary name in the same folder, then rename."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` when the block succeeds.

    Readers never see a half-written file under the final name, and a failed write leaves an
    existing file untouched and no temporary behind. The temporary is an ordinary file the
    caller creates (``open``, ``save_file``, ``savefig``), so it gets the usual permissions
    (``tempfile.mkstemp`` would make it private, 0600).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
