"""What makes a checkpoint folder complete and intact: its ``manifest.json``.

The manifest is written last, after every other file is on disk, and lists each file with its
size (``files``) and the CRC-32 of its content (``crc32``, hex; :func:`zlib.crc32`, stdlib, a
few GB/s). :func:`problem` checks sizes, then contents, then that the small files parse as the
data they should be (JSON, checkpoint metadata through the restricted unpickler): a truncated
shard, a flipped byte, a garbage ``.metadata`` or ``train_state.json`` each make the folder
damaged, and :func:`flexpack.run.state.checkpoint.latest` falls back to the one before, loudly.
Manifests of earlier versions (sizes only) are still accepted; their contents go unchecked.
Every listed file must lie inside the folder: no ``..``, no absolute name, no symbolic link (a
shard linked to another run's would load that run's weights under this checkpoint's name).

A content check reads every byte of the checkpoint once per process; the answer is cached by
the manifest's modification time, so finding and loading the same checkpoint reads it once.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
_CHUNK = 16 << 20
_verified: dict[tuple[str, int], str | None] = {}


def crc32_file(path: str | os.PathLike) -> str:
    """CRC-32 of a file's bytes as 8 hex digits."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def describe(folder: Path, names: list[str] | None = None) -> dict[str, Any]:
    """``{"files": {name: size}, "crc32": {name: hex}}`` of the files under ``folder`` (all of
    them, or the relative ``names``)."""
    if names is None:
        names = [str(p.relative_to(folder)) for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST]
    return {"files": {n: (folder / n).stat().st_size for n in names},
            "crc32": {n: crc32_file(folder / n) for n in names}}


def _content_problem(path: Path, files: dict[str, int], crcs: dict[str, str]) -> str | None:
    for name, want in crcs.items():
        if name in files and crc32_file(path / name) != want:
            return f"{path}: {name} has other content than the manifest's checksum says (damaged on disk?)"
    for name in ("train_state.json", "config.json"):
        if name in files:
            try:
                data = json.loads((path / name).read_text())
            except (ValueError, UnicodeDecodeError) as exc:
                return f"{path}: {name} is not valid JSON ({exc})"
            if name == "train_state.json" and not (isinstance(data, dict) and isinstance(data.get("step"), int)):
                return f"{path}: {name} has no integer 'step'"
    if "state/.metadata" in files:
        from flexpack.run.state.safeload import read_metadata_file

        try:
            read_metadata_file(path / "state" / ".metadata")
        except ValueError as exc:
            return str(exc)
    return None


def problem(path: str | os.PathLike, *, content: bool = True) -> str | None:
    """Why ``path`` is not a complete, intact checkpoint (one line), or None when it is.
    ``content=False`` checks the manifest and the sizes only (no file is read)."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        crcs = manifest.get("crc32", {})
        if not isinstance(files, dict) or not isinstance(crcs, dict):
            raise TypeError("'files' and 'crc32' must be tables")
    except FileNotFoundError:
        if (path / "model.pt").is_file():
            return f"{path}: a checkpoint of the earlier full-state format (model.pt), which this version does not read"
        if (path / "state").exists() or (path / "train_state.json").exists() or path.name.startswith(".tmp-"):
            return f"{path}: not a complete checkpoint (no {MANIFEST}: its save did not finish)"
        return f"{path}: not a checkpoint folder (no {MANIFEST}, no state/)"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        return f"{path}/{MANIFEST}: unreadable ({exc})"
    for name, size in files.items():
        if Path(name).is_absolute() or ".." in Path(name).parts:  # a manifest names files inside its folder only
            return f"{path}/{MANIFEST}: lists {name!r}, outside the checkpoint folder"
        f = path / name
        if f.is_symlink() or (f.exists() and not f.resolve().is_relative_to(path.resolve())):
            # a link into another run would load that run's weights under this checkpoint's name
            return f"{path}: {name} leads outside the checkpoint folder (a symbolic link); a checkpoint's files are " \
                   "its own"
        if not f.is_file():
            return f"{path}: {name} is missing"
        if f.stat().st_size != size:
            return f"{path}: {name} has {f.stat().st_size} bytes, the manifest says {size} (truncated?)"
    if not content:
        return None
    key = (str(path.resolve()), (path / MANIFEST).stat().st_mtime_ns)
    if key not in _verified:
        _verified[key] = _content_problem(path, files, crcs)
    return _verified[key]
