"""Atomic file writes: write under a temporary name in the same folder, then rename; and why a write failed."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` when the block succeeds.

    Readers never see a half-written file under the final name, and a failed write leaves an
    existing file untouched and no temporary behind. The caller creates the temporary (``open``,
    ``save_file``, ``savefig``); before the rename it gets an ordinary file's mode, ``0666`` minus
    the umask (0644 usually), whatever the writer used: safetensors' ``save_file`` creates its
    file private (0600), which would keep others sharing a latent cache from reading it.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        if tmp.is_file():
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _umask() -> int:
    """The process umask (read without changing it where Linux allows)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (no other thread writes files meanwhile)
    os.umask(mask)
    return mask


def remove_dead_temporaries(folder: str | os.PathLike[str], pattern: str) -> list[Path]:
    """Delete ``folder/<pattern>`` entries whose name ends in ``-PID`` of a process no longer running
    here (what a ``kill -9`` of an export or ``make-dataset`` leaves); returns them."""
    import shutil

    gone = []
    for p in Path(folder).glob(pattern):
        pid = p.name.rpartition("-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            gone.append(p)
    return gone


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def write_failure(exc: BaseException) -> str | None:
    """Why a write failed, when ``exc`` or what caused it is the file system's: an ``OSError`` (a full disk,
    a quota, a file-size limit, no permission), or a library's error wrapping one (safetensors'
    ``IoError(...)``, torch's short write "unexpected pos"). None for anything else: a bug or a data
    problem keeps its own message."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError):
            return e.strerror or str(e)
        first = (str(e).splitlines() or [""])[0]
        code = re.search(r"\(os error (\d+)\)|code: (\d+)", first)  # Rust's io::Error, as safetensors words it
        if code:
            return os.strerror(int(code.group(1) or code.group(2)))
        if "IoError" in first or "I/O error" in first or "unexpected pos" in first:
            return f"{type(e).__name__}: {first[:200]}"
        e = e.__cause__ or e.__context__
    return None
