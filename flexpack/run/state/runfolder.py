"""The run folder (``runtime.out_dir``): one owner at a time, a metrics log that matches the weights,
and a record of every start.

- ``.flexpack-run`` marks a folder as a run folder: a regular file with a run id and the format
  version (:mod:`~flexpack.run.state.provenance`); an empty file, a folder, a symbolic
  link or other content under that name is refused, naming it. ``train`` adopts an
  ``runtime.out_dir`` that is missing, empty or marked, or a run of an earlier version: the whole
  structure flexpack writes (a ``config.json`` that loads as a flexpack config, its start
  records in ``config_history.jsonl``, flexpack's lines in ``metrics.jsonl``, checkpoint folders
  with manifests), announced on stderr and then marked. Any other folder with files is refused in
  one line naming them; ``runtime.adopt_dir = true`` (``train --force``) adds a run to it, but only
  when none of its files has a name the run writes (``metrics.jsonl``, ``config.json``,
  ``checkpoints``, ...): a file flexpack did not write is never changed.
- ``train.lock`` holds the PID and host of the ``train`` that owns the folder. A second ``train``
  is refused with a message naming the holder; a lock left by a dead process on this host (its
  PID no longer runs) is taken over with a warning. Under ``torchrun`` only rank 0 takes it.
- ``metrics.jsonl`` is cut back to the step a run resumes from (or emptied when it starts from
  scratch), atomically: steps trained after the last checkpoint by a killed run are replayed,
  and their lines must not appear twice. A line that is not flexpack's (someone else wrote into
  the file) stops the run, naming the file and line, before anything is cut.
- ``config.json`` is the config of the first start and never rewritten; every start (the first
  included) appends ``{"start_step", "time", "host", "world_size", "changed", "config"}`` to
  ``config_history.jsonl``, ``changed`` listing the keys that differ from the previous start.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

from flexpack.atomic import atomic_path, pid_alive
from flexpack.errors import UserError
from flexpack.run.state.provenance import (
    MARKER,
    earlier_run_problem,
    is_lock,
    marker_problem,
    marker_text,
    metrics_problem,
)

LOCK = "train.lock"
# names a run writes into its folder: a foreign file under one of them would be cut, read or replaced
OWN_NAMES = (LOCK, MARKER, "metrics.jsonl", "config.json", "config_history.jsonl", "checkpoints", "tb", "profile",
             "wandb", "samples", "metrics.png")


def mark(run: str | os.PathLike) -> None:
    """Write the run marker (atomically) if it is not there; refuse one that is not flexpack's."""
    path = Path(run) / MARKER
    if not os.path.lexists(path):
        with atomic_path(path) as tmp:
            tmp.write_text(marker_text())
    elif why := marker_problem(path):
        raise UserError(f"{path} {why}: not a run marker flexpack wrote; move it away or choose another "
                        "runtime.out_dir")


def claim(run: str | os.PathLike, *, adopt: bool = False) -> None:
    """Refuse a ``runtime.out_dir`` that is not flexpack's (see the module doc); marks one it adopts."""
    run = Path(run)
    if not run.is_dir():
        return
    for name in ("checkpoints", "tb", "profile"):
        if (run / name).exists() and not (run / name).is_dir():
            raise UserError(f"runtime.out_dir = '{run}' holds a file named {name!r} where the run keeps a folder; "
                            "move it away or choose another runtime.out_dir")
    names = sorted(p.name for p in run.iterdir() if not p.name.startswith(".write-test-"))
    if not names:
        return
    if MARKER in names:
        if why := marker_problem(run / MARKER):
            raise UserError(f"runtime.out_dir = '{run}' holds {MARKER}, which {why}: not a run marker flexpack "
                            "wrote, so this is not taken for a run folder; move it away or choose another "
                            "runtime.out_dir")
        if why := metrics_problem(run / "metrics.jsonl"):  # a resume cuts it back: only flexpack's lines may go
            raise UserError(f"runtime.out_dir = '{run}': {why}; flexpack changes nothing it did not write: move "
                            "the file away or choose another runtime.out_dir")
        return
    if names == [LOCK] and is_lock(run / LOCK):  # the lock of an earlier version's run that wrote nothing else
        mark(run)
        return
    earlier = earlier_run_problem(run) if "config.json" in names or "config_history.jsonl" in names else "no config"
    if earlier is None:
        print(f"note: {run} is a run of an earlier flexpack version (no {MARKER}; its config.json, "
              f"config_history.jsonl, metrics.jsonl and checkpoints are flexpack's): adopting it and writing "
              f"{run / MARKER}", file=sys.stderr)
        mark(run)
        return
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    why = f" (not a run of an earlier flexpack version: {earlier})" if earlier != "no config" else ""
    if not adopt:
        raise UserError(f"runtime.out_dir = '{run}' holds files flexpack did not write ({shown}){why}; train into a "
                        "new or empty folder, or set runtime.adopt_dir = true (train --force) to add the run beside "
                        "them")
    clash = [n for n in names if n in OWN_NAMES]
    if clash:
        raise UserError(f"runtime.out_dir = '{run}' holds {', '.join(clash)}, which flexpack did not write and the run "
                        f"would change{why}; move them away or choose another runtime.out_dir (runtime.adopt_dir "
                        "changes nothing flexpack did not write)")
    mark(run)


class RunLock:
    """``with RunLock(run):`` owns ``run`` for the block (see the module doc); a no-op if ``active`` is false."""

    def __init__(self, run: str | os.PathLike, *, active: bool = True) -> None:
        self.path, self.active, self.held = Path(run) / LOCK, active, False
        self.made: list[Path] = []  # folders the lock created, removed again if a run leaves them empty

    def __enter__(self) -> "RunLock":
        if self.active:
            self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def acquire(self) -> None:
        missing = [p for p in [self.path.parent, *self.path.parent.parents] if not p.exists()]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.made = missing  # deepest first
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        for _ in range(3):  # a stale lock is removed and the create retried
            try:
                _create_whole(self.path, json.dumps(me) + "\n")
            except FileExistsError:
                holder = self._holder()
                if holder is None:
                    continue  # released between our open and read
                pid, host = holder.get("pid"), holder.get("host")
                if holder.get("unreadable"):  # locks are written whole (below): no live train owns a torn one
                    print(f"warning: {self.path}: replacing an unreadable lock file ({host}); locks are written "
                          "whole, so no running train holds it", file=sys.stderr)
                    self.path.unlink(missing_ok=True)
                    continue
                if host == me["host"] and isinstance(pid, int) and not pid_alive(pid):
                    print(f"warning: {self.path}: taking over the lock of PID {pid} on {host}, which is no longer "
                          f"running (a killed train, started {holder.get('since', '?')}): "
                          f"{stale_cause(pid, holder.get('since'))}; "
                          f"{last_logged(self.path.parent)}", file=sys.stderr)
                    self.path.unlink(missing_ok=True)
                    continue
                raise ValueError(f"{self.path.parent}: in use by train PID {pid} on host {host} (since "
                                 f"{holder.get('since', '?')}); stop it or choose another runtime.out_dir "
                                 f"(delete {self.path} if that process is gone)")
            self.held = True
            return
        raise ValueError(f"{self.path}: could not take the lock (it keeps reappearing)")

    def _holder(self) -> dict[str, Any] | None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            holder = json.loads(text)
            if isinstance(holder, dict):
                return holder
        except ValueError:
            pass
        return {"pid": None, "host": f"? (contents {text[:40]!r})", "unreadable": True}

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False
            for folder in self.made:  # a run that failed before writing anything leaves no folder behind
                try:
                    folder.rmdir()
                except OSError:
                    break


def stale_cause(pid: int, since: str | None = None) -> str:
    """Why the ``train`` of PID ``pid`` left its lock: every orderly end (done, an error, Ctrl-C or SIGTERM with its
    checkpoint) releases it and says why on stderr, so a lock left behind means the process got no chance to: a
    signal it cannot catch (SIGKILL) or a crash in native code. The kernel log names an out-of-memory kill where
    this user may read it (``dmesg``); ``since``: when the lock was taken (ISO 8601), so that a kill of an earlier
    process of the same PID is not taken for this one's."""
    line = _oom_kill_line(pid, since)
    if line:
        return f"the kernel's out-of-memory killer ended it (kernel log: {line!r}); lower data.max_tokens or use a " \
               "machine with more memory"
    return ("it ended without an exit line or releasing its lock: killed by a signal, possibly the kernel's "
            "out-of-memory killer (see `dmesg`; the kernel log is not readable here or names no kill of it) or a "
            "scheduler's hard limit, or a crash in native code")


def _oom_kill_line(pid: int, since: str | None = None) -> str | None:
    """The kernel log's line of an out-of-memory kill of ``pid`` after ``since`` (None where there is none or the
    log is closed to this user). Its ``[seconds since boot]`` stamps are placed with the boot time of /proc/stat."""
    import re
    import subprocess

    try:
        text = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    after = None
    try:
        boot = next(int(x.split()[1]) for x in Path("/proc/stat").read_text().splitlines() if x.startswith("btime "))
        after = datetime.datetime.fromisoformat(since).timestamp() - boot if since else None
    except (OSError, ValueError, StopIteration, IndexError):
        pass  # no boot time or no start time: any kill of this PID counts
    hits = []
    for line in text.splitlines():
        if not re.search(rf"Kill(?:ed)? process {pid}\b", line):
            continue
        stamp = re.match(r"\s*\[\s*(\d+(?:\.\d+)?)\]", line)
        if after is not None and stamp is not None and float(stamp[1]) < after:
            continue  # an earlier process of the same PID
        hits.append(line.strip())
    return hits[-1] if hits else None


def last_logged(run: Path) -> str:
    """The last step ``metrics.jsonl`` of the run folder ``run`` holds, as a clause of the stale-lock warning."""
    path = run / "metrics.jsonl"
    step = None
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                step = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                pass  # a line cut short by the kill
    return f"its last logged step was {step} ({path})" if step is not None else f"it logged no step ({path})"


def _create_whole(path: Path, text: str) -> None:
    """Create ``path`` with ``text`` atomically: written under a temporary name, then hard-linked
    to ``path`` (fails with FileExistsError if it exists); a full disk leaves no empty lock."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links: an exclusive create (not atomic, but exclusive)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(text)
    finally:
        tmp.unlink(missing_ok=True)


def cut_metrics(run: str | os.PathLike, step: int) -> int:
    """Keep only ``metrics.jsonl`` lines of steps ``<= step`` (atomically); returns lines removed.
    A file holding a line flexpack does not write is refused (UserError), never rewritten."""
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        return 0
    if why := metrics_problem(path):
        raise UserError(f"{why}; flexpack changes nothing it did not write: move the file away or choose another "
                        "runtime.out_dir")
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            keep = int(json.loads(line)["step"]) <= step
        except (ValueError, KeyError, TypeError):
            keep = False  # a line cut short by a kill
        if keep:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        with atomic_path(path) as tmp:
            tmp.write_text("".join(line + "\n" for line in kept))
    return dropped


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list[Any]]:
    """``{"schedule.steps": [40, 80], ...}`` for every key whose value differs."""
    a, b = _flat(json.loads(json.dumps(old))), _flat(json.loads(json.dumps(new)))
    return {k: [a.get(k), b.get(k)] for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


def record_start(
    run: str | os.PathLike, config: dict[str, Any], *, start_step: int, world_size: int
) -> dict[str, list]:
    """Write ``config.json`` on the first start, append this start to ``config_history.jsonl``;
    returns the keys changed since the previous start."""
    run = Path(run)
    run.mkdir(parents=True, exist_ok=True)
    first, history = run / "config.json", run / "config_history.jsonl"
    if not first.is_file():
        with atomic_path(first) as tmp:
            tmp.write_text(json.dumps(config, indent=2) + "\n")
    try:
        previous = json.loads(first.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{first}: not readable as JSON ({exc}); it is the run's first config, written by flexpack: "
                        "restore it, or train into another runtime.out_dir") from None
    if history.is_file():
        for line in history.read_text().splitlines():
            try:
                previous = json.loads(line)["config"]
            except (ValueError, KeyError):
                pass  # a line cut short by a kill
    from flexpack.run.config import upgrade

    # a start before the config's sections were split: its keys at their new place (not a change)
    changed = config_changes(upgrade(previous, notes=False), config)
    rec = {"start_step": start_step, "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": socket.gethostname(), "world_size": world_size, "changed": changed, "config": config}
    with open(history, "a") as f:  # append-only: one line per start
        f.write(json.dumps(rec) + "\n")
    return changed
