"""Files of a run folder read for a report (``export``'s model card): regular files inside the run, bounded.

A report reads what a run wrote (``metrics.jsonl``, ``samples/**/metrics.json``), but a run folder
shared on a cluster holds what anyone put there: a ``metrics.json`` linked to ``/dev/zero`` or to a
file of another project, a FIFO that blocks a read forever, a file of many gigabytes. So a report
file must be a regular file (opened without following a link, checked again on the open handle),
must lie inside the run folder once resolved, and is read up to :data:`LIMIT` bytes (``tail``: the
last :data:`LIMIT` bytes, from the first whole line). Anything else is a ``ValueError`` saying why;
the report leaves the file out and says so.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

LIMIT = 16 << 20  # bytes: a sample's metrics.json is kilobytes; the last 16 MiB of metrics.jsonl hold its last losses


def report_text(path: Path, run: Path, *, tail: bool = False, limit: int = LIMIT) -> str:
    """The text of the report file ``path`` of the run folder ``run`` (see the module doc)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # NONBLOCK: a FIFO must not stall the open
    except OSError as exc:  # ELOOP: a symbolic link
        kind = f"a symbolic link (to {os.readlink(path)})" if path.is_symlink() else exc.strerror
        raise ValueError(f"{path} is {kind}, not a file the run wrote") from None
    if not path.resolve().is_relative_to(run.resolve()):  # a linked folder on the way
        os.close(fd)
        raise ValueError(f"{path} leads outside the run folder {run}")
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if st.st_size > limit and not tail:
            raise ValueError(f"{path} holds {st.st_size} bytes, more than a report reads ({limit})")
        if st.st_size > limit:
            f.seek(st.st_size - limit)
            data = f.read(limit)
            data = data[data.find(b"\n") + 1:]  # from the first whole line
        else:
            data = f.read(limit)
    return data.decode("utf-8", errors="replace")


def report_files(folder: Path, name: str) -> Iterator[Path]:
    """Every ``name`` under ``folder``, walking no symbolic link (a linked folder is not the run's)."""
    if folder.is_symlink() or not folder.is_dir():
        return
    for root, _, files in os.walk(folder, followlinks=False):
        if name in files:
            yield Path(root) / name
