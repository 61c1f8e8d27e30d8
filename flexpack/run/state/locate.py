"""Which checkpoint a command reads: :func:`pick_checkpoint`, the newest intact checkpoint of a run
folder (or a checkpoint folder itself); every damaged newer one is said on stderr with why, so a user
sees which step is used. ``export``, ``verify --checkpoint`` and ``sample`` find a run's weights here."""

from __future__ import annotations

import sys
from pathlib import Path


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
