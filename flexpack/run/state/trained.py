"""What a run was trained with, against the config a command is given.

:func:`run_config` finds the config a checkpoint was trained with (the one place export, verify and sample
read it from); :func:`recorded_model` the model config its weights record, so a command builds the shape the
weights have (a run fine-tuned from a checkpoint of another width than its preset) without reading
``model.pretrained`` again (:func:`pinned`).

``verify --checkpoint RUN`` and ``sample --checkpoint RUN`` load a trained model; a config that describes
another model, mask, objective or token geometry would check (or sample) something that was never trained.
:func:`check_trained` compares the keys that decide what was trained (:func:`trained_values`) and refuses a
disagreement in one line naming each key, both values and both files. Keys that say where the data is or how
to run (``data.root``, ``runtime`` to ``sample``, ``model.pretrained``, the attention backend) may differ.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from flexpack.errors import UserError
from flexpack.run.resolve import config_family, model_config_of
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
MODEL_KEY = "model_config"  # train_state.json's extra: the resolved model config of the weights (model_record)
LORA_KEY = "lora"  # train_state.json's extra: the LoRA options of the weights (run/lora.py: lora_record), null: none


def saved_lora(checkpoint: str | os.PathLike) -> dict[str, Any] | None:
    """The LoRA options a checkpoint folder records (``train_state.json``'s ``extra.lora``,
    :func:`~flexpack.run.lora.lora_record`); None: trained without LoRA (or before LoRA existed)."""
    state = _json(Path(checkpoint) / "train_state.json")
    return (state.get("extra") or {}).get(LORA_KEY)


def trained_values(cfg: TrainConfig) -> dict[str, Any]:
    """The parts of a :class:`~flexpack.run.config.TrainConfig` that decide what a run trains: the
    resolved model (every WanVA field but how it runs, the mask and chunk, any further model key such as a
    family), the whole objective, and the data keys of :data:`DATA_KEYS`."""
    d = cfg.to_dict()
    model = {k: v for k, v in d["model"].items()
             if k not in ("overrides", "pretrained", "preset", "recorded", "recorded_from")}
    how = HOW_TO_RUN + config_family(cfg).sampling_fields  # the family's sampling knobs say how, not what
    wan = {k: v for k, v in dataclasses.asdict(model_config_of(cfg)).items() if k not in how}
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


def _folders(run: Path, checkpoint: str | os.PathLike | None, content: bool = False) -> tuple[Path, Path | None]:
    """(the run folder, the checkpoint that says what it trained: ``checkpoint``, ``run`` itself when it is a
    checkpoint folder, else the run's newest one, intact by sizes (``content``: and checksums), or None)."""
    if (run / "train_state.json").is_file():  # a checkpoint folder itself
        checkpoint = run if checkpoint is None else checkpoint
        run = run.parent.parent if run.parent.name == "checkpoints" else run
    if checkpoint is None:  # by default sizes only (a content check reads every shard)
        checkpoint = ckpt.latest(run / "checkpoints", content=content)
    return run, None if checkpoint is None else Path(checkpoint)


def run_config(run: str | os.PathLike, checkpoint: str | os.PathLike | None = None) -> Path:
    """The config file that says what ``checkpoint`` (default: the run's newest intact one) was trained
    with: the checkpoint's own ``config.json`` (a run started over with another model keeps its first
    config.json), else the run's ``config.json``; ``run`` may also be a checkpoint folder (then its own
    config, else its run's) or an export folder (``flexpack_config.json``). One place for every command
    that reads a trained run's config (export, verify, sample)."""
    run = Path(run)
    if (run / "flexpack_config.json").is_file():  # an export: its config.json is the diffusers one
        return run / "flexpack_config.json"
    run, checkpoint = _folders(run, checkpoint)
    for folder in ((checkpoint,) if checkpoint is not None else ()) + (run,):
        if (folder / "config.json").is_file():
            return folder / "config.json"
    raise FileNotFoundError(f"{run}: no config.json in it{' nor in ' + str(checkpoint) if checkpoint else ''}; "
                            "not a flexpack run, checkpoint or export folder")


class ModelRecord(NamedTuple):
    """The model config trained weights record: ``fields`` (field -> value, as JSON has them) read from ``where``."""

    fields: dict[str, Any]
    where: Path


def model_record(model_cfg: Any) -> dict[str, Any]:
    """A resolved model config (a family's config dataclass) as a checkpoint records it (JSON values)."""
    return json.loads(json.dumps(dataclasses.asdict(model_cfg)))


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not readable as JSON ({exc})") from None


def recorded_model(source: str | os.PathLike) -> ModelRecord | None:
    """The model config the weights at ``source`` record: a checkpoint's (``train_state.json``'s
    ``extra.model_config``, every field), a run folder's newest checkpoint's, or an export's (the diffusers
    format: ``action_stream.json``'s ``wanva_config``; another format: its ``config.json`` as the family reads a
    checkpoint's, the shape fields and the family's checkpoint defaults it holds). A run's checkpoint is its newest
    intact one, as the weights are loaded. None for a checkpoint written before the record."""
    from flexpack.models.registry import family

    source = Path(source)
    if (source / "flexpack_config.json").is_file():  # an export
        stream = source / "action_stream.json"  # the diffusers format: its WanVA config whole
        if stream.is_file():
            return ModelRecord(dict(_json(stream)["wanva_config"]), stream)
        fam = family(_json(source / "flexpack_config.json").get("model", {}).get("family", "wanva"))
        if fam.read_checkpoint_config is None or fam.checkpoint_files is None:
            return None
        try:
            _, found = fam.checkpoint_files(str(source))
        except ValueError as exc:
            raise ValueError(f"{source}: not an export of the {fam.name} family ({exc})") from None
        if found is None:
            return None
        raw = _json(Path(found))
        try:
            read = fam.read_checkpoint_config(raw)
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{found}: not a checkpoint config of the {fam.name} family: {exc}") from None
        values = model_record(read)
        names = [*fam.shape_fields, *(n for n in fam.checkpoint_defaults if n in raw)]
        return ModelRecord({n: values[n] for n in names}, Path(found))
    _, checkpoint = _folders(source, None, content=True)  # the one the weights come from (the check is cached)
    if checkpoint is None or not (checkpoint / "train_state.json").is_file():
        return None
    where = checkpoint / "train_state.json"
    found = (_json(where).get("extra") or {}).get(MODEL_KEY)
    return None if found is None else ModelRecord(dict(found), where)


def pinned(cfg: TrainConfig, record: ModelRecord | None) -> TrainConfig:
    """``cfg`` of the model the weights record, ``cfg`` itself without a record: ``model.recorded`` holds the
    record's fields (its shape fields and the family's checkpoint defaults replace the preset's where
    ``model.overrides`` does not set them: :func:`flexpack.run.resolve.base_model_config`) and ``model.pretrained``
    is cleared (the weights come from the checkpoint)."""
    if record is None:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, pretrained="", recorded=dict(record.fields),
                                                              recorded_from=str(record.where)))
