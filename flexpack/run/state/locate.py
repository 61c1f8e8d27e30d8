"""Which checkpoint a command reads: :func:`pick_checkpoint`, the newest intact checkpoint of a run
folder (or a checkpoint folder itself); every damaged newer one is said on stderr with why, so a user
sees which step is used; :func:`load_newest` loads it, taking the newest again if a training run prunes
it meanwhile. ``export``, ``verify --checkpoint`` and ``sample`` find a run's weights here."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def pick_checkpoint(run: Path, command: str) -> Path:
    """The newest intact checkpoint of a run folder or of its ``checkpoints/`` folder (or ``run`` itself when
    it is a checkpoint folder); each damaged newer one is said on stderr with why (``command: warning: ...``)."""
    from flexpack.run.state import checkpoint

    if (run / checkpoint.MANIFEST).is_file() or (run / "state").is_dir():
        why = checkpoint.problem(run)
        if why is not None:
            raise ValueError(why)
        return run
    root = run if run.name == "checkpoints" and any(run.glob("step_*")) else run / "checkpoints"
    if not root.is_dir():
        raise FileNotFoundError(f"{run}: no checkpoints/ folder; not a flexpack run folder (runtime.out_dir of a train "
                                "run) nor a checkpoint folder")
    damaged: list[str] = []

    def report(why: str) -> None:
        damaged.append(why)
        print(f"{command}: warning: {why}; using the checkpoint before it", file=sys.stderr)

    found = checkpoint.latest(root, on_damaged=report)
    if found is None:
        if damaged:
            raise ValueError(f"{root}: no usable checkpoint, all {len(damaged)} are damaged (newest: {damaged[0]})")
        raise FileNotFoundError(f"{root}: no complete checkpoint")
    return found


def load_newest(run: Path, command: str, load: Callable[[Path], T], attempts: int = 3) -> tuple[Path, T]:
    """``(checkpoint, load(checkpoint))`` for the newest intact checkpoint of ``run`` (:func:`pick_checkpoint`);
    when a training run prunes it while it is read, the newest is taken again, said on stderr."""
    for attempt in range(attempts):
        found = pick_checkpoint(run, command)
        try:
            return found, load(found)
        except (FileNotFoundError, ValueError):
            if found.exists() or attempt == attempts - 1:
                raise
            print(f"{command}: {found} was pruned while reading it; taking the newest again", file=sys.stderr)
    raise AssertionError("unreachable")  # the last attempt returns or raises
