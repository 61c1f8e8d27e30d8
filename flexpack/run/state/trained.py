"""What a run was trained with, against the config a command is given.

:func:`run_config` finds the config a checkpoint was trained with (the one place export, verify and sample
read it from).

``verify --checkpoint RUN`` and ``sample --checkpoint RUN`` load a trained model; a config that describes
another model, mask, objective or token geometry would check (or sample) something that was never trained.
:func:`check_trained` compares the keys that decide what was trained (:func:`trained_values`) and refuses a
disagreement in one line naming each key, both values and both files. Keys that say where the data is or how
to run (``data.root``, ``runtime`` to ``sample``, ``model.pretrained``, the attention backend) may differ.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flexpack.errors import UserError
from flexpack.run.state import checkpoint as ckpt
from flexpack.run.state.runfolder import config_changes

if TYPE_CHECKING:
    from flexpack.run.config import TrainConfig

# data keys that shape what the model saw: cameras (video tokens), action steps per frame (action tokens),
# the latent stride and what one item is. How items are batched (data.mode, max_tokens, batch_size) may
# differ: packed equals per-episode whatever the budget; the action statistics travel with the checkpoint,
# which sampling and export check against the dataset's on their own.
DATA_KEYS = ("cameras", "action_steps", "stride", "segments")
HOW_TO_RUN = ("attn_backend", "activation_checkpointing")  # WanVAConfig fields that say how, not what


def trained_values(cfg: TrainConfig) -> dict[str, Any]:
    """The parts of a :class:`~flexpack.run.config.TrainConfig` that decide what a run trains: the
    resolved model (every WanVA field but how it runs, the mask and chunk, any further model key such as a
    family), the whole objective, and the data keys of :data:`DATA_KEYS`."""
    d = cfg.to_dict()
    model = {k: v for k, v in d["model"].items() if k not in ("overrides", "pretrained", "preset")}
    how = HOW_TO_RUN + cfg.model.model_family().sampling_fields  # the family's sampling knobs say how, not what
    wan = {k: v for k, v in dataclasses.asdict(cfg.model.resolved()).items() if k not in how}
    data = {k: d["data"][k] for k in DATA_KEYS if k in d["data"]}
    return {"model": {**model, **wan}, "objective": d["objective"], "data": data}


def differences(given: Any, trained: Any) -> dict[str, list[Any]]:
    """``{"model.mask": [given, trained], ...}`` for every trained key on which the two configs differ."""
    return config_changes(trained_values(given), trained_values(trained))


def check_trained(given: Any, trained: Any, *, given_from: str, trained_from: str | Path, command: str) -> None:
    """One line (``UserError``) when ``given`` (from ``given_from``: a file, ``--set`` values) disagrees with
    what ``trained`` (read from ``trained_from``) trained; nothing when they agree."""
    diff = differences(given, trained)
    if not diff:
        return
    shown = "; ".join(f"{k} = {a!r}, trained {b!r}" for k, (a, b) in list(diff.items())[:4])
    more = f" (and {len(diff) - 4} more)" if len(diff) > 4 else ""
    raise UserError(f"{given_from} disagrees with what {trained_from} was trained with: {shown}{more}; {command} "
                    f"checks the trained model: leave the config out to use the run's own, or make it agree")


def run_config(run: str | os.PathLike, checkpoint: str | os.PathLike | None = None) -> Path:
    """The config file that says what ``checkpoint`` (default: the run's newest intact one) was trained
    with: the checkpoint's own ``config.json`` (a run started over with another model keeps its first
    config.json), else the run's ``config.json``; ``run`` may also be a checkpoint folder (then its own
    config, else its run's) or an export folder (``flexpack_config.json``). One place for every command
    that reads a trained run's config (export, verify, sample)."""
    run = Path(run)
    if (run / "flexpack_config.json").is_file():  # an export: its config.json is the diffusers one
        return run / "flexpack_config.json"
    if (run / "train_state.json").is_file():  # a checkpoint folder itself
        checkpoint = run if checkpoint is None else checkpoint
        run = run.parent.parent if run.parent.name == "checkpoints" else run
    if checkpoint is None:  # sizes only (a content check reads every shard); weights are checked where loaded
        checkpoint = ckpt.latest(run / "checkpoints", content=False)
    for folder in ((Path(checkpoint),) if checkpoint is not None else ()) + (run,):
        if (folder / "config.json").is_file():
            return folder / "config.json"
    raise FileNotFoundError(f"{run}: no config.json in it{' nor in ' + str(checkpoint) if checkpoint else ''}; "
                            "not a flexpack run, checkpoint or export folder")
