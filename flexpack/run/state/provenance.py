"""Whether flexpack wrote a folder or a file: the run marker, a run of an earlier version, the logs.

- ``.flexpack-run`` is a regular file (never a symbolic link or a folder) holding
  ``{"format": "flexpack-run-v1", "run_id": <32 hex digits>, "created": <UTC time>}``. An empty,
  unparsable or other file under that name is not a marker, and the folder is not taken for a run.
  (``{"flexpack_run": 1}``, the marker of the version that introduced it, is still one.)
- A folder without a marker is a run of an earlier version only with the whole structure every
  start of flexpack writes: ``config.json`` that loads as a flexpack config, ``config_history.jsonl``
  whose lines are flexpack's start records, ``metrics.jsonl`` (if any) of flexpack's lines, a
  ``train.lock`` (if any) that is a lock, and ``checkpoints/`` (if any) holding checkpoint folders
  with manifests and the temporaries of interrupted saves. Top-level keys alone prove nothing.
- ``metrics.jsonl`` is cut back at a resume; it may be only when each line is flexpack's: a JSON
  object with an integer ``step``, or the start of one (``{"step": ...`` cut short by a kill).
  Any other line means someone else wrote the file, and it is refused by name, not rewritten.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import stat
import uuid
from pathlib import Path
from typing import Any

from flexpack.run.state import manifest

MARKER = ".flexpack-run"
MARKER_FORMAT = "flexpack-run-v1"
_EARLIER_MARKER = {"flexpack_run": 1}
_MAX_SMALL = 1 << 16  # a marker or a lock is a line; a larger file under the name is someone else's
_START_KEYS = {"start_step", "time", "host", "world_size", "changed", "config"}
_LINE_START = '{"step": '  # how every line flexpack appends to metrics.jsonl begins (json.dumps of {"step": ...})
_CHECKPOINT_ENTRY = re.compile(r"^(step_\d{8}|\.(tmp|old|trash)-step_\d{8})$")


def marker_text() -> str:
    """The content of a new marker: a run id of its own and the format version."""
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return json.dumps({"format": MARKER_FORMAT, "run_id": uuid.uuid4().hex, "created": created}) + "\n"


def _kind_problem(path: Path) -> str | None:
    """Why ``path`` is not a regular file (a symbolic link, a folder, a device, missing), or None."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "is missing"
    if stat.S_ISLNK(st.st_mode):
        return f"is a symbolic link (to {os.readlink(path)})"
    if stat.S_ISDIR(st.st_mode):
        return "is a folder"
    return None if stat.S_ISREG(st.st_mode) else "is not a regular file"


def _small_file(path: Path) -> str:
    """The text of a small regular file; ValueError saying what ``path`` is instead."""
    why = _kind_problem(path)
    if why:
        raise ValueError(why)
    size = path.stat().st_size
    if size == 0:
        raise ValueError("is empty")
    if size > _MAX_SMALL:
        raise ValueError(f"holds {size} bytes")
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise ValueError("is not text") from None


def marker_problem(path: str | os.PathLike) -> str | None:
    """Why the file at ``path`` is not a run marker flexpack wrote (e.g. ``"is empty"``), or None."""
    try:
        text = _small_file(Path(path))
    except ValueError as exc:
        return str(exc)
    try:
        data = json.loads(text)
    except ValueError:
        return "is not JSON"
    if data == _EARLIER_MARKER:
        return None
    if not (isinstance(data, dict) and data.get("format") == MARKER_FORMAT and isinstance(data.get("run_id"), str)
            and re.fullmatch(r"[0-9a-f]{32}", data["run_id"])):
        return f"holds no {MARKER_FORMAT} run id"
    return None


def metrics_problem(path: str | os.PathLike) -> str | None:
    """Why ``metrics.jsonl`` at ``path`` is not flexpack's (naming the first foreign line), or None
    (also when there is no such file)."""
    path = Path(path)
    if not os.path.lexists(path):
        return None
    why = _kind_problem(path)
    if why:
        return f"{path} {why}"
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        return f"{path} is not text"
    for number, line in enumerate(text.splitlines(), 1):
        if not _metrics_line(line):
            return f"{path}: line {number} ({line[:60]!r}) is not a line flexpack writes"
    return None


def _metrics_line(line: str) -> bool:
    try:
        rec = json.loads(line)
    except ValueError:  # a write cut short by a kill: the start of one of flexpack's lines
        return bool(line) and (line.startswith(_LINE_START) or _LINE_START.startswith(line))
    return isinstance(rec, dict) and type(rec.get("step")) is int


def _jsonl(path: Path, ok: Any) -> str | None:
    """Why the lines of ``path`` are not all ``ok`` (a torn last line allowed), or None."""
    lines = path.read_text().splitlines()
    if not lines:
        return f"{path.name} is empty"
    for number, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except ValueError:
            if number == len(lines):
                continue  # cut short by a kill
            return f"{path.name} line {number} is not JSON"
        if not ok(rec):
            return f"{path.name} line {number} is not a line flexpack writes"
    return None


def earlier_run_problem(run: Path) -> str | None:
    """Why ``run`` (no marker) is not a run folder of an earlier flexpack version (see the module doc), or None."""
    from flexpack.run.config import load_config

    for name in ("config.json", "config_history.jsonl"):
        why = _kind_problem(run / name)
        if why:
            return f"{name} {why}"
    try:  # the weights' origin is not read: a moved model.pretrained does not make the folder foreign
        load_config(run / "config.json", ['model.pretrained=""'])
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        return f"config.json is not a flexpack config ({str(exc)[:200]})"
    why = _jsonl(run / "config_history.jsonl", lambda r: isinstance(r, dict) and set(r) == _START_KEYS
                 and type(r["start_step"]) is int and isinstance(r["config"], dict))
    if why:
        return why
    why = metrics_problem(run / "metrics.jsonl")
    if why:
        return why
    if os.path.lexists(run / "train.lock") and not is_lock(run / "train.lock"):
        return "train.lock is not a lock flexpack writes"
    ckpts = run / "checkpoints"
    if os.path.lexists(ckpts):
        if ckpts.is_symlink() or not ckpts.is_dir():
            return "checkpoints is not a folder"
        steps = []
        for p in sorted(ckpts.iterdir()):
            if not _CHECKPOINT_ENTRY.match(p.name) or p.is_symlink() or not p.is_dir():
                return f"checkpoints/{p.name} is not a checkpoint folder flexpack writes"
            steps += [p] if p.name.startswith("step_") else []
        whys = [manifest.problem(p, content=False) for p in steps]
        if steps and all(whys):
            return f"checkpoints/ holds no checkpoint with a valid manifest ({whys[-1]})"
    return None


def is_lock(path: Path) -> bool:
    """Whether ``path`` is a ``train.lock`` as flexpack writes it (``{"pid", "host", ...}``)."""
    try:
        holder = json.loads(_small_file(path))
    except ValueError:
        return False
    return isinstance(holder, dict) and {"pid", "host"} <= set(holder)
