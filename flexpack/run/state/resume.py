"""Resuming a run from its newest checkpoint: find it, check it fits, load it.

What a resume can honour and what it cannot:

- Another world size: yes. DCP re-shards model and optimizer, and the sampler re-plans the rest
  of the epoch over the new ranks (every episode of the epoch once, see
  :mod:`flexpack.packing.batch_sampler`).
- Another schedule, LR, logging or checkpoint setting: yes (recorded in ``config_history.jsonl``).
- Another order of the epoch (``data.mode``, ``data.max_tokens``, ``data.seed``, ...): no — one
  line naming each value, the checkpoint's and the new one, and how to go on.
- Another ``optim.states`` or ``optim.offload``: no — the optimizer's states are of another kind
  (:func:`check_optim`, before anything loads; a checkpoint without the record is float32 AdamW, no offload).
- Another model family, preset or shape: no — one line naming each key, the checkpoint's value and the new
  one (:func:`check_model`, from the checkpoint's config and the model config it records, before any weights
  load, ``model.pretrained``'s included); a checkpoint without that record is compared tensor by tensor
  once the model is built (:func:`check_shapes`).
- Other LoRA options (``[lora]``, on or off): no — one line naming each (:func:`check_lora`).

The dataset's action normalization statistics are saved with each checkpoint (a mixture's also per entry); a
resume keeps the checkpoint's (the weights learned under them) and warns if the dataset's have changed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from flexpack.data.normalization import ActionStats
from flexpack.parallel.parallelize import world
from flexpack.run.config import TrainConfig
from flexpack.run.resolve import config_family, lora_record, model_config_of
from flexpack.run.state import checkpoint
from flexpack.run.state.runfolder import config_changes
from flexpack.run.state.trained import LORA_KEY, MODEL_KEY, model_record

if TYPE_CHECKING:
    from flexpack.data.dataset import LatentEpisodeDataset

# config keys that fix the order of an epoch (and so the sampler state's meaning), per data.mode
ORDER_KEYS = {
    "pack": ("mode", "max_tokens", "crop", "seed", "segments", "action_steps", "stride", "cameras"),
    "pad": ("mode", "batch_size", "pool_factor", "pad_multiple", "seed", "segments", "stride", "cameras"),
}


def find(cfg: TrainConfig, rank: int = 0, model_cfg: Any = None) -> Path | None:
    """The run folder's newest complete, intact checkpoint; each damaged newer one is reported in one
    line. Rank 0 reads the contents (checksums) and tells the other ranks which one it took. ``model_cfg``: the
    run's resolved model config (the shape a resume compares; default: resolved here)."""
    run, problems = Path(cfg.runtime.out_dir), []

    def damaged(why: str) -> None:
        problems.append(why)
        if rank == 0:
            print(f"warning: {why}; using the checkpoint before it", file=sys.stderr)

    found = checkpoint.latest(run / "checkpoints", on_damaged=damaged) if rank == 0 else None
    if world()[1] > 1:  # one content check, not one per rank
        box = [found, problems]
        dist.broadcast_object_list(box, src=0)
        found, problems = box
    if found is None and problems:  # never restart from scratch over a run's checkpoints unasked
        raise ValueError(f"{run / 'checkpoints'}: no usable checkpoint, all {len(problems)} are damaged (newest: "
                         f"{problems[0]}); train into another runtime.out_dir, or move the damaged step_* folders "
                         "out of it to start over there")
    if found is not None and not cfg.checkpoint.resume:
        raise ValueError(f"{run}: holds checkpoint {found.name} but checkpoint.resume is false; "
                         "choose another runtime.out_dir (or set checkpoint.resume = true)")
    if found is not None:
        check_model(found, cfg, model_cfg)
        check_lora(found, cfg)
    return found


OPTIM_KEY = "optim"  # train_state.json's extra: {"states", "offload"} of the optimizer the states are of
OPTIM_DEFAULTS = {"states": "float32", "offload": "none"}  # a checkpoint written before the record


def optim_extra(optim: Any) -> dict[str, Any]:
    """A checkpoint's ``extra`` recording ``optim.states`` and ``optim.offload`` (an ``OptimConfig``)."""
    return {OPTIM_KEY: {k: getattr(optim, k) for k in OPTIM_DEFAULTS}}


def check_optim(path: Path, cfg: TrainConfig) -> None:
    """Refuse, in one line and before anything loads, a resume whose ``optim.states`` / ``optim.offload``
    differ from the checkpoint's: its optimizer states are of that kind."""
    recorded = {**OPTIM_DEFAULTS, **((json.loads((path / "train_state.json").read_text()).get("extra") or {})
                                     .get(OPTIM_KEY) or {})}
    diff = [(k, recorded[k], getattr(cfg.optim, k)) for k in OPTIM_DEFAULTS if recorded[k] != getattr(cfg.optim, k)]
    if diff:
        what = ", ".join(f"optim.{k} is {a!r} there and {b!r} now" for k, a, b in diff)
        fix = " ".join(f"--set optim.{k}={json.dumps(a)}" for k, a, _ in diff)
        raise ValueError(f"cannot resume from {path}: {what} (its optimizer states are of that kind); "
                         f"resume with {fix}, or train into a new runtime.out_dir")


def step_of(path: Path) -> int:
    return int(json.loads((path / "train_state.json").read_text())["step"])


def _saved_config(path: Path) -> dict[str, Any] | None:
    f = path / "config.json"
    return json.loads(f.read_text()) if f.is_file() else None


def check_order(path: Path, saved: dict[str, Any] | None, cfg: TrainConfig) -> None:
    if saved is None:
        return
    now = cfg.to_dict()["data"]
    keys = ORDER_KEYS[saved["data"]["mode"]]
    diff = [(k, saved["data"].get(k), now.get(k)) for k in keys
            if json.dumps(saved["data"].get(k)) != json.dumps(now.get(k))]
    if diff:
        what = ", ".join(f"data.{k} is {a!r} there and {b!r} now" for k, a, b in diff)
        fix = " ".join(f"--set data.{k}={json.dumps(a)}" for k, a, _ in diff)
        raise ValueError(f"cannot resume from {path}: {what} (the epoch's order depends on it); "
                         f"resume with {fix}, or train into a new runtime.out_dir")


# fields that shape tensors though no checkpoint of the family decides them (WanVA's action stream)
SHAPE_EXTRA = ("action_channels",)


def _field(fam: Any, key: str) -> str:
    """The model config field a ``model.overrides`` key sets (its own name, or the field of an alias)."""
    alias = fam.aliases.get(key, key)
    return alias if isinstance(alias, str) else alias.field


def _set_by(cfg: TrainConfig, name: str) -> str:
    """The config key that gives the resolved model field ``name`` its value now."""
    fam = config_family(cfg)
    for key in cfg.model.overrides:
        if _field(fam, key) == name:
            return f"model.overrides.{key}"
    return "model.pretrained" if cfg.model.pretrained and name in fam.shape_fields else "model.preset"


def check_model(path: Path, cfg: TrainConfig, model_cfg: Any = None) -> None:
    """Refuse, in one line and before any weights load, a resume whose model has another family, preset or
    shape than the checkpoint's: each key with the checkpoint's value and the new one. The shape is the
    resolved model config's (``model.pretrained``'s config.json included) against the one the checkpoint
    records; a checkpoint written without that record compares the ``model.overrides`` of shape fields."""
    saved = _saved_config(path)
    model = (saved or {}).get("model") or {}
    fam = config_family(cfg)
    parts = [f"model.{k} is {model[k]!r} there and {getattr(cfg.model, k)!r} now" for k in ("family", "preset")
             if k in model and model[k] != getattr(cfg.model, k)]
    recorded = (json.loads((path / "train_state.json").read_text()).get("extra") or {}).get(MODEL_KEY)
    if not parts and recorded is not None:
        now = model_record(model_config_of(cfg) if model_cfg is None else model_cfg)
        names = [*fam.shape_fields, *(n for n in SHAPE_EXTRA if n in recorded and n not in fam.shape_fields)]
        parts = [f"model.{n} is {recorded.get(n)!r} there and {now.get(n)!r} now ({_set_by(cfg, n)})"
                 for n in names if recorded.get(n) != now.get(n)]
    elif not parts:  # an older checkpoint: its shape fields as model.overrides set them
        shape = set(fam.shape_fields) | set(SHAPE_EXTRA)
        old, new = (dict(o) for o in (model.get("overrides") or {}, cfg.model.overrides))
        parts = [f"model.overrides.{k} is {old.get(k)!r} there and {new.get(k)!r} now" for k in sorted(old | new)
                 if old.get(k) != new.get(k) and _field(fam, k) in shape]
    if parts:
        raise ValueError(f"cannot resume from {path}: its model has another shape or family ({'; '.join(parts)}); "
                         "its weights are of its own model: resume with the checkpoint's model values, or train "
                         "into another runtime.out_dir")


def check_lora(path: Path, cfg: TrainConfig) -> None:
    """Refuse, in one line and before any weights load, a resume whose LoRA options (``[lora]``) differ from those
    the checkpoint records (``extra.lora``; none recorded: trained without LoRA)."""
    saved = (json.loads((path / "train_state.json").read_text()).get("extra") or {}).get(LORA_KEY)
    now = lora_record(cfg)
    if saved == now:
        return
    if saved is None or now is None:
        what = (f"it was trained without LoRA and lora.rank = {cfg.lora.rank} now" if saved is None else
                f"it was trained with LoRA (lora.rank = {saved.get('rank')!r}) and lora.rank = 0 now")
    else:
        what = ", ".join(f"lora.{k} is {saved.get(k)!r} there and {v!r} now" for k, v in now.items()
                         if saved.get(k) != v)
    raise ValueError(f"cannot resume from {path}: {what}; resume with the checkpoint's [lora] values, or train "
                     "into another runtime.out_dir")


def check_shapes(path: Path, saved: dict[str, Any] | None, cfg: TrainConfig, model: torch.nn.Module) -> None:
    bad = checkpoint.shape_mismatches(path, model)
    if not bad:
        return
    name, there, here = bad[0]
    example = f"e.g. {name} {there} there vs {here} now" if there is not None else f"e.g. {name} not in it"
    values = ""
    if saved is not None:
        changed = config_changes(saved["model"], cfg.to_dict()["model"])
        values = "; " + ", ".join(f"model.{k} is {a!r} there and {b!r} now" for k, (a, b) in changed.items())
    raise ValueError(f"cannot resume from {path}: its model has another shape ({len(bad)} tensors differ, "
                     f"{example}){values}; resume with the checkpoint's model values or choose another runtime.out_dir")


def _data_changes(saved: dict[str, Any] | None, cfg: TrainConfig) -> str:
    """``"data.root is 'a' there and 'b' now; "`` for the data values that choose the episodes."""
    if saved is None:
        return ""
    now = cfg.to_dict()["data"]
    keys = ("root", "latents_dir", "cameras", "val_fraction", "val_episodes", "segments")
    diff = [f"data.{k} is {saved['data'].get(k)!r} there and {now.get(k)!r} now" for k in keys
            if json.dumps(saved["data"].get(k)) != json.dumps(now.get(k))]
    return "; ".join(diff) + ("; " if diff else "")


STATS_KEY = "action_normalizer"  # train_state.json's extra: the action statistics the weights are trained with
# train_state.json's extra of a mixture run: one record per [[data.datasets]] entry, in config order ({"name", "mode",
# "low", "high"} over the model's action space, or null for an entry without items in the training split); checkpoints
# written before it carry only STATS_KEY (the entries' shared statistics, or null where they differ)
ENTRY_STATS_KEY = "entry_normalizers"


def normalizer_state(dataset: LatentEpisodeDataset) -> ActionStats | None:
    """The action statistics ``dataset`` normalizes with (None: a dataset without a normalizer)."""
    n = getattr(dataset, "normalizer", None)
    return None if n is None else ActionStats.of(n)


def stats_extra(stats: ActionStats | None, dataset: Any = None) -> dict[str, Any]:
    """A checkpoint's ``extra`` holding ``stats`` (``{"mode", "low", "high"}``, or null without actions) and, for a
    mixture ``dataset`` (``[[data.datasets]]``), every entry's own statistics (:data:`ENTRY_STATS_KEY`)."""
    extra = {STATS_KEY: None if stats is None else stats.to_json()}
    entries = getattr(dataset, "entry_normalizers", None)
    if entries is not None:
        extra[ENTRY_STATS_KEY] = [None if n is None else {"name": name, **ActionStats.of(n).to_json()}
                                  for name, n in zip(dataset.names, entries)]
    return extra


def saved_entry_stats(state: dict[str, Any], where: str | Path, *, entries: int,
                      width: int | None = None) -> list[ActionStats | None] | None:
    """A mixture checkpoint's per-entry statistics (``entries`` of them, each checked), or None where it records
    none; a list of another length is one line (the checkpoint's config has another number of entries)."""
    saved = (state.get("extra") or {}).get(ENTRY_STATS_KEY)
    if saved is None:
        return None
    if not isinstance(saved, list) or len(saved) != entries:
        n = len(saved) if isinstance(saved, list) else type(saved).__name__
        raise ValueError(f"{where} (extra.{ENTRY_STATS_KEY}): {n} records for the {entries} entries of "
                         "data.datasets; resume or export with the checkpoint's data.datasets")
    return [None if rec is None else ActionStats.from_json(rec, f"{where} (extra.{ENTRY_STATS_KEY}[{k}])",
                                                           width=width)
            for k, rec in enumerate(saved)]


def saved_stats(state: dict[str, Any], where: str | Path, *, width: int | None = None) -> ActionStats | None:
    """The action statistics of a checkpoint's ``train_state.json`` (``state``, read from ``where``), checked
    (:meth:`~flexpack.data.normalization.ActionStats.from_json`); None where it carries none."""
    saved = (state.get("extra") or {}).get(STATS_KEY)
    return None if saved is None else ActionStats.from_json(saved, f"{where} (extra.{STATS_KEY})", width=width)


def _restore_entry_normalizers(path: Path, dataset: Any, state: dict[str, Any], rank: int) -> None:
    """A mixture's per-entry statistics from the checkpoint (where it records them) kept on ``dataset``."""
    now = getattr(dataset, "entry_normalizers", None)
    if now is None:
        return
    where = path / "train_state.json"
    width = next((len(n.low) for n in now if n is not None), None)
    saved = saved_entry_stats(state, where, entries=len(now), width=width)
    if saved is None:
        return
    kept = [s if s is not None and n is not None else None for s, n in zip(saved, now)]
    if any(s is not None and ActionStats.of(n) != s for s, n in zip(kept, now)) and rank == 0:
        print(f"warning: the action statistics of data.datasets entries differ from those saved in {path}; "
              "keeping the checkpoint's (the weights were trained with them)", file=sys.stderr)
    dataset.entry_normalizers = [None if s is None else s.normalizer() for s in kept]


def _restore_normalizer(path: Path, dataset: LatentEpisodeDataset, saved: Any, rank: int) -> None:
    """Keep the checkpoint's action statistics (``saved``: its ``extra.action_normalizer`` as read) on ``dataset``."""
    if saved is None or getattr(dataset, "normalizer", None) is None:
        return
    stats = ActionStats.from_json(saved, f"{path / 'train_state.json'} (extra.{STATS_KEY})",
                                  width=len(dataset.normalizer.low))
    if normalizer_state(dataset) != stats:
        if rank == 0:
            print(f"warning: the dataset's action statistics differ from those saved in {path}; "
                  "keeping the checkpoint's (the weights were trained with them)", file=sys.stderr)
        dataset.normalizer = stats.normalizer()


def restore(path: Path, cfg: TrainConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            data: Any, rank: int = 0, ema: Any = None) -> dict[str, Any]:
    """Check ``path`` fits ``cfg``, load model, optimizer, EMA, RNG, sampler and normalizer
    (collective); returns its train_state."""
    saved = _saved_config(path)
    check_order(path, saved, cfg)
    check_shapes(path, saved, cfg, model)
    state = checkpoint.load(path, model, optimizer, ema=ema)
    try:
        data.sampler.load_state_dict(state["sampler"])
    except ValueError as exc:  # say which data value moved, not only the sampler's fingerprint
        raise ValueError(f"cannot resume from {path}: {_data_changes(saved, cfg)}the epoch's episodes differ from the "
                         f"checkpoint's ({exc}); resume on the dataset it was trained on, or train into a new "
                         "runtime.out_dir") from None
    _restore_normalizer(path, data.dataset, (state.get("extra") or {}).get(STATS_KEY), rank)
    _restore_entry_normalizers(path, data.dataset, state, rank)
    return state
