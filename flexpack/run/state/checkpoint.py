"""Checkpoints: sharded through ``torch.distributed.checkpoint`` (DCP); a folder appears atomically.

Layout of ``RUN/checkpoints/step_00000040/``::

    state/            DCP checkpoint of {"model", "optim"}: each rank writes its own shards
                      (``__<rank>_0.distcp``), rank 0 the ``.metadata``; no full-state gather
                      and, with ``optim.ema_decay``, {"ema"} (the averages, sharded alike)
    rng.pt            rank 0's torch CPU (and CUDA) RNG state
    train_state.json  {"step", "sampler" (its state_dict), "world_size", "extra", and what the model's
                      family records beside the weights (``ModelFamily.weights_record``, checked on load by
                      its ``check_weights``; wanva: "action_positions", its action tokens' RoPE rule)}
    config.json       the run's config at this step (a resume compares against it)
    manifest.json     written last: every file above with its size and CRC-32 (:mod:`.manifest`)

A checkpoint is valid only when ``manifest.json`` exists and every file it lists has its size and
content, and its small files parse (:func:`problem`): :func:`latest` skips (and reports) a damaged
one and takes the one before. Everything a load reads is data: JSON, ``weights_only`` and the
allow-listed metadata unpickler of :mod:`flexpack.run.state.safeload`. Pruning renames an old
checkpoint to ``.trash-step_…`` before deleting it, so a kill cannot leave half a checkpoint
under a checkpoint's name; :func:`remove_temporary` clears trash at the next start. Saving is collective
(every rank calls :meth:`Checkpointer.save`): shards go into ``.tmp-step_…``, rank 0 adds the
small files and the manifest, then renames the folder — an interrupted save never becomes a
checkpoint, and :func:`remove_temporary` clears its leftovers. With ``async_save`` the shards are
staged to CPU memory at once and written by a background thread (``dcp.async_save``); the
manifest and rename follow when the next save starts or :meth:`Checkpointer.wait` is called.

Loading lets DCP re-shard: a checkpoint written by N ranks loads into M ranks, or into a plain
single-process model without any process group (``flexpack verify --checkpoint RUN``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from flexpack.atomic import atomic_path
from flexpack.errors import UserError
from flexpack.models.registry import family_of
from flexpack.parallel.parallelize import world
from flexpack.run.checks import check_state_shapes
from flexpack.run.state import manifest, torch_file
from flexpack.run.state.finite import check_finite
from flexpack.run.state.manifest import MANIFEST, problem  # noqa: F401  (public here too)
from flexpack.run.state.optim_state import is_offloaded, load_offload_state, offload_state
from flexpack.run.state.safeload import UnsafeCheckpointError, load_state, read_metadata_file

NONFINITE = "no step or sample can use them: take an earlier checkpoint (move this step_* folder aside)"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_TEMPORARY = re.compile(r"^\.(tmp|old|trash)-step_\d{8}")
# what a checkpoint folder holds: a manifest-less step_* made only of these is a pruning cut short
_OWN = {"state", "rng.pt", "train_state.json", "config.json", MANIFEST}


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Checkpoint folders under ``root`` that were completed (have a manifest), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest(root: str | os.PathLike, on_damaged: Callable[[str], None] | None = None, *,
           content: bool = True) -> Path | None:
    """The newest valid checkpoint under ``root``; each damaged newer one is passed to ``on_damaged``.
    ``content=False``: sizes only (see :func:`problem`)."""
    candidates = [p for p in Path(root).iterdir() if _STEP_DIR.match(p.name)] if Path(root).is_dir() else []
    for path in sorted(candidates, key=lambda p: p.name, reverse=True):
        why = problem(path, content=content)
        if why is None:
            return path
        if on_damaged is not None:
            on_damaged(why)
    return None


def remove_temporary(root: str | os.PathLike) -> list[Path]:
    """Delete the ``.tmp-step_*`` / ``.old-step_*`` folders of interrupted saves, the
    ``.trash-step_*`` of interrupted pruning, and ``step_*`` folders without a manifest that hold
    nothing but checkpoint files (a pruning by an earlier version cut short: its manifest went
    first); returns them. A folder holding any other file is left alone."""
    root = Path(root)
    if not root.is_dir():
        return []
    gone = [p for p in root.iterdir() if _TEMPORARY.match(p.name) and p.is_dir()]
    valid = list_checkpoints(root)
    # pruning takes the oldest: only a manifest-less folder older than a complete checkpoint can be one
    gone += [p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir() and not (p / MANIFEST).exists()
             and valid and p.name < valid[-1].name
             and {c.name for c in p.iterdir()} <= _OWN and not _foreign_in_state(p / "state")]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def _foreign_in_state(state: Path) -> bool:
    """Whether ``state/`` holds anything DCP does not write (``.metadata``, ``__R_N.distcp``)."""
    if not state.is_dir():
        return state.exists()
    return any(not (c.name == ".metadata" or re.match(r"^__\d+_\d+\.distcp$", c.name)) for c in state.iterdir())


def prune(root: str | os.PathLike, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints: each older one is renamed to ``.trash-step_…`` (atomic:
    it stops being a checkpoint at once) and then deleted; a kill in between leaves only trash."""
    for path in list_checkpoints(root)[:-keep]:
        trash = path.with_name(f".trash-{path.name}")
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)


def _barrier() -> None:
    if world()[1] > 1:
        dist.barrier()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns on every single-process call that no process group exists; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, ema: Any = None,
           saved: dict[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    """Sharded (DTensor) state dicts under FSDP, plain ones otherwise, keyed by parameter name;
    ``ema`` (:class:`~flexpack.training.ema.EMA`) adds its averages, sharded like the parameters.
    torchao's ``CPUOffloadOptimizer`` through :mod:`.optim_state` (to load: the parameters whose
    states ``saved``, the checkpoint's :func:`tensor_shapes`, holds)."""
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    elif is_offloaded(optimizer):
        names = None if saved is None else {k.removeprefix("optim.state.").rsplit(".", 1)[0] for k in saved
                                            if k.startswith("optim.state.")}
        state = {"model": get_model_state_dict(model), "optim": offload_state(model, optimizer, names)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    if ema is not None:
        state["ema"] = ema.state_dict()
    return state


class Checkpointer:
    """Writes ``root/step_…`` checkpoints (collective), keeping the newest ``keep``; see the module doc."""

    def __init__(self, root: str | os.PathLike, *, keep: int | None = None, async_save: bool = False) -> None:
        self.root, self.keep, self.async_save = Path(root), keep, async_save
        self._pending: tuple[Future, Path, Path, dict[str, Any]] | None = None
        self._group = None
        if async_save and world()[1] > 1:  # the writer thread's collectives must not share the loop's group
            self._group = dist.new_group(backend="gloo")

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
             sampler_state: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
             config: dict[str, Any] | None = None, ema: Any = None) -> Path:
        """Checkpoint ``step``; returns its folder (complete on return, or after :meth:`wait` if async)."""
        self.wait()
        rank, size = world()
        final = step_dir(self.root, step)
        tmp = final.with_name(f".tmp-{final.name}")
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "state").mkdir(parents=True)
        _barrier()
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state()
        small = {"rng": rng, "config": config,
                 "train_state": {"step": step, "sampler": sampler_state, "world_size": size, "extra": extra or {}}}
        fam = family_of(model)
        if fam is not None and fam.weights_record is not None:  # e.g. wanva's action RoPE rule (checked by load)
            small["train_state"].update(fam.weights_record(model))
        state = _state(model, optimizer, ema)
        with _quiet(), self._no_half_checkpoint(tmp, final):
            if self.async_save:
                future = dcp.async_save(state, checkpoint_id=tmp / "state", process_group=self._group)
                self._pending = (future, tmp, final, small)
                # checksum this rank's shards in the writer's thread as soon as they are written, not on the
                # training thread at the next save
                future.add_done_callback(lambda f: _checksum_when_written(f, tmp, small))
            else:
                dcp.save(state, checkpoint_id=tmp / "state")
                self._finish(tmp, final, small)
        return final

    @contextlib.contextmanager
    def _no_half_checkpoint(self, tmp: Path, final: Path) -> Iterator[None]:
        """Any failure of a save (disk full, quota, read-only, a file-size limit, torch's own
        "unexpected pos" when a write comes up short) removes its temporary folder and becomes one
        line saying that the newest checkpoint is unchanged."""
        try:
            yield
        except (Exception, dcp.api.CheckpointException) as exc:  # DCP's is a BaseException
            causes = _failures(exc) or [exc]
            cause = next((e for e in causes if isinstance(e, OSError)), causes[0])
            shutil.rmtree(tmp, ignore_errors=True)
            newest = latest(self.root, content=False)
            kept = f"{newest} is still the newest checkpoint" if newest else "no checkpoint was written yet"
            what = cause.strerror if isinstance(cause, OSError) and cause.strerror else \
                f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
            raise UserError(f"{final}: cannot write the checkpoint ({what}); nothing was "
                            f"replaced, {kept}; free space under {self.root} (or choose another runtime.out_dir) "
                            "and run again to resume") from exc

    def wait(self) -> Path | None:
        """Complete a pending asynchronous save (collective); returns its folder."""
        if self._pending is None:
            return None
        future, tmp, final, small = self._pending
        self._pending = None
        with self._no_half_checkpoint(tmp, final):
            future.result()
            self._finish(tmp, final, small)
        return final

    def _finish(self, tmp: Path, final: Path, small: dict[str, Any]) -> None:
        """All shards are written: each rank checksums its own shards, rank 0 adds the small files,
        the manifest last, and renames."""
        _barrier()
        rank, size = world()
        sums = small.get("sums") or _own_shard_sums(tmp)
        if size > 1:
            gathered: list[Any] = [None] * size
            dist.all_gather_object(gathered, sums)
        else:
            gathered = [sums]
        if rank == 0:
            torch.save(small["rng"], tmp / "rng.pt")
            _write(tmp / "train_state.json", small["train_state"])
            if small["config"] is not None:
                _write(tmp / "config.json", small["config"])
            for name in ("rng.pt", "train_state.json", "config.json"):  # DCP syncs its own files
                if (tmp / name).is_file():
                    with open(tmp / name, "rb+") as f:
                        os.fsync(f.fileno())  # on disk before the manifest says the folder is complete
            done = {n for g in gathered for n in g["files"]}
            rest = [str(p.relative_to(tmp)) for p in sorted(tmp.rglob("*")) if p.is_file()
                    and str(p.relative_to(tmp)) not in done]
            entries = [*gathered, manifest.describe(tmp, rest)]
            body = {key: dict(sorted((n, v) for e in entries for n, v in e[key].items())) for key in ("files", "crc32")}
            with atomic_path(tmp / MANIFEST) as m:
                m.write_text(json.dumps(body, indent=2) + "\n")
            if final.exists():  # re-saving a step: move the old one aside first (rename needs a free name)
                old = final.with_name(f".old-{final.name}")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            if self.keep is not None:
                prune(self.root, self.keep)
        _barrier()


def _own_shard_sums(tmp: Path) -> dict[str, Any]:
    """Sizes and CRC-32s of the shards this rank wrote (``state/__<rank>_*.distcp``)."""
    mine = sorted((tmp / "state").glob(f"__{world()[0]}_*.distcp"))
    return manifest.describe(tmp, [str(p.relative_to(tmp)) for p in mine])


def _checksum_when_written(future: Future, tmp: Path, small: dict[str, Any]) -> None:
    """Done-callback of an asynchronous save: its shards' checksums, read while they are still cached."""
    try:
        if future.exception() is None:
            small["sums"] = _own_shard_sums(tmp)
    except Exception:  # noqa: BLE001 (the main thread computes them at wait() instead)
        small.pop("sums", None)


def _failures(exc: BaseException) -> list[BaseException]:
    """The per-rank exceptions a ``CheckpointException`` carries (``{rank: exception}``)."""
    failures = getattr(exc, "failures", None) or {}
    out = []
    for e in failures.values():  # (exception, stack summary) pairs in torch 2.x; bare exceptions earlier
        e = e[0] if isinstance(e, tuple) and e else e
        if isinstance(e, BaseException):
            out.append(e)
    return out


def _write(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def save(root: str | os.PathLike, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
         sampler_state: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
         keep: int | None = None, config: dict[str, Any] | None = None, ema: Any = None) -> Path:
    """Write checkpoint ``step`` synchronously (collective); keep the newest ``keep``. Returns its folder."""
    return Checkpointer(root, keep=keep).save(step, model, optimizer, sampler_state=sampler_state, extra=extra,
                                              config=config, ema=ema)


def tensor_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Global shape of every tensor in the checkpoint (``model.<name>``, ``optim.state.<name>.<key>``)."""
    meta = read_metadata_file(Path(path) / "state" / ".metadata")
    return {k: tuple(v.size) for k, v in meta.state_dict_metadata.items() if hasattr(v, "size")}


def has_ema(path: str | os.PathLike) -> bool:
    """Whether the checkpoint holds EMA averages (trained with ``optim.ema_decay`` > 0)."""
    return any(k.startswith("ema.") for k in tensor_shapes(path))


def read_tensors(path: str | os.PathLike, part: str = "model") -> dict[str, torch.Tensor]:
    """One part of a checkpoint (``"model"`` or ``"ema"``) as full CPU tensors by parameter name,
    in their saved dtypes (no process group, no model needed)."""
    meta = read_metadata_file(Path(path) / "state" / ".metadata")
    prefix = f"{part}."
    shapes = {k.removeprefix(prefix): v for k, v in meta.state_dict_metadata.items()
              if k.startswith(prefix) and hasattr(v, "size")}
    state = {part: {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in shapes.items()}}
    with _quiet():
        load_state(state, Path(path) / "state")
    check_finite(state, str(path), NONFINITE, collective=False)  # full tensors, read by one process or each alike
    return state[part]


def read_ema(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The EMA averages as full float32 CPU tensors by parameter name (no process group needed)."""
    return read_tensors(path, "ema")


def shape_mismatches(path: str | os.PathLike, model: torch.nn.Module) -> list[tuple[str, tuple | None, tuple]]:
    """(parameter, shape in the checkpoint or None if absent, shape in ``model``) for each that differs."""
    saved = tensor_shapes(path)
    out = []
    for name, value in get_model_state_dict(model).items():
        got = saved.get(f"model.{name}")
        if got != tuple(value.shape):
            out.append((name, got, tuple(value.shape)))
    return out


def load(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
    ema: Any = None,
) -> dict[str, Any]:
    """Load a checkpoint folder into ``model`` (sharded or not, any rank count) and ``optimizer``;
    return its train_state. Collective under a process group; works without one. ``ema`` gets
    the saved averages, or restarts at the loaded weights where the checkpoint has none."""
    path = Path(path)
    why = problem(path)
    if why is not None:
        raise ValueError(why)
    fam = family_of(model)
    if fam is not None and fam.check_weights is not None:  # what the family's checkpoints record beside the weights
        fam.check_weights(json.loads((path / "train_state.json").read_text()), model, str(path))
    shapes = tensor_shapes(path)
    # DCP fills only the keys the model asks for: a checkpoint of another shape must fail here, in one line
    saved = {k.removeprefix("model."): SimpleNamespace(shape=v) for k, v in shapes.items() if k.startswith("model.")}
    check_state_shapes(path / "state", saved, model)
    if optimizer is not None and not any(k.startswith("optim.") for k in shapes):
        raise ValueError(f"{path}: holds no optimizer state; load the model alone (optimizer=None)")
    has_ema = any(k.startswith("ema.") for k in shapes)
    state = _state(model, optimizer, ema if has_ema else None, saved=shapes)
    with _quiet():
        load_state(state, path / "state")
    check_finite(state, str(path), NONFINITE)  # the first NaN / inf weight named, before any step or sample
    if ema is not None:
        ema.load_state_dict(state["ema"] if has_ema else None)
    if optimizer is None or is_offloaded(optimizer):
        set_model_state_dict(model, state["model"])
        if optimizer is not None:
            load_offload_state(model, optimizer, state["optim"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if restore_rng and (path / "rng.pt").is_file():
        raw = (path / "rng.pt").read_bytes()
        try:
            torch_file.check_tensors(raw)  # byte tensors only: weights_only alone allocates ByteStorage(n) for any n
            rng = torch.load(io.BytesIO(raw), weights_only=True)
        except Exception as exc:  # weights_only refuses code; a refusal is the file's problem, in one line
            why = str(exc) if isinstance(exc, ValueError) else type(exc).__name__
            raise UnsafeCheckpointError(f"{path / 'rng.pt'}: not plain tensor data ({why}); "
                                        "nothing in it was run") from None
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return json.loads((path / "train_state.json").read_text())  # parsed by problem() above

