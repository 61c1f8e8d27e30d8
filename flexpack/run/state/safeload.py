"""Checkpoints are data, never code, and loading one changes nothing but its own result.

``torch.distributed.checkpoint`` (DCP) unpickles two things with plain :mod:`pickle`: the
``state/.metadata`` index (``FileSystemReader.read_metadata``) and every non-tensor item of the
state dict (``DefaultLoadPlanner.load_bytes``, ``torch.load(weights_only=False)``). A crafted
pickle in either runs any code at load time. :class:`SafeReader` reads the metadata with
:func:`read_metadata_file`: the restricted unpickler of
:mod:`~flexpack.run.state.restricted_pickle` with exactly the globals DCP metadata holds
(:mod:`~flexpack.run.state.dcp_metadata`), which sets attributes only of objects the file
made itself (no ``BUILD`` on a class, a function or a shared constant), then checks that every
storage path is a shard file of the same folder (no ``..``, absolute path or symbolic link) and
that no tensor it declares is larger than the shard files: a size is checked before anything is
allocated from it. :class:`SafePlanner` reads the non-tensor items as plain data, and
``rng.pt`` is checked to hold byte tensors only (:mod:`~flexpack.run.state.torch_file`:
``weights_only`` alone would allocate ``torch.ByteStorage(n)`` for any ``n`` in the file).
Tensor shards are read by DCP with ``weights_only=True`` (their storages are records of the
shard: no larger than the file); the other files of a checkpoint are JSON (``train_state.json``,
``config.json``, ``manifest.json``). A file that does not pass is :class:`UnsafeCheckpointError`,
one line naming the file.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from flexpack.errors import UserError
from flexpack.run.state import dcp_metadata, torch_file


class UnsafeCheckpointError(UserError):
    """A checkpoint file that is not plain data (or not readable as such)."""


def _text(exc: BaseException) -> str:
    """An exception's message, short (a crafted object in it may be too deep or too long to print whole)."""
    try:
        return str(exc)[:300]
    except Exception:  # noqa: BLE001 (RecursionError, a failing __repr__: the type says enough)
        return ""


def read_metadata_file(path: str | os.PathLike) -> Any:
    """The DCP ``.metadata`` at ``path`` through the restricted unpickler, checked against the shard
    files beside it (:mod:`~flexpack.run.state.dcp_metadata`); one line on any failure."""
    path = Path(path)
    if path.is_symlink():
        raise UnsafeCheckpointError(f"{path}: a symbolic link (to {os.readlink(path)}); a checkpoint reads only its "
                                    "own files")
    data = path.read_bytes()  # whole, before the first opcode: no opcode can ask for more than the file holds
    try:
        meta = dcp_metadata.parse(data)
    except Exception as exc:  # UnpicklingError, EOFError, a truncated or random file: all data problems
        raise UnsafeCheckpointError(f"{path}: not readable as checkpoint metadata ({type(exc).__name__}: "
                                    f"{_text(exc)}); nothing in it was run or changed") from None
    why = dcp_metadata.problem(meta, path.parent)
    if why is not None:
        raise UnsafeCheckpointError(f"{path}: {why}; nothing was read from it")
    return meta


class SafeReader(dcp.FileSystemReader):
    """A ``FileSystemReader`` whose metadata goes through :func:`read_metadata_file`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        meta = read_metadata_file(Path(self._get_metadata_path(rank)))
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta


class SafePlanner(DefaultLoadPlanner):
    """Non-tensor items (optimizer hyperparameters, step counts) are plain data: numbers, text, lists,
    tuples, dicts (:func:`~flexpack.run.state.torch_file.plain_data`; no global, nothing allocated
    from a number in the file)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch_file.plain_data(value.getvalue())
        except ValueError as exc:
            raise UnsafeCheckpointError(f"{getattr(self, '_source', 'a checkpoint shard')}: item "
                                        f"{read_item.dest_index.fqn} is not plain data ({exc}); "
                                        "nothing in it was run") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # what DCP's own planner uses

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load_state(state: dict[str, Any], folder: str | os.PathLike) -> None:
    """``dcp.load(state, folder)`` through :class:`SafeReader` and :class:`SafePlanner`."""
    planner = SafePlanner()
    planner._source = str(folder)  # named in its error
    try:
        dcp.load(state, storage_reader=SafeReader(str(folder)), planner=planner)
    except (Exception, dcp.api.CheckpointException) as exc:  # DCP wraps each rank's error in a BaseException
        causes = [f[0] if isinstance(f, tuple) else f for f in (getattr(exc, "failures", None) or {}).values()]
        cause = next((c for c in causes if isinstance(c, BaseException)), exc)
        if isinstance(cause, UserError):
            raise cause from None
        if isinstance(cause, pickle.UnpicklingError) or "weights_only" in str(cause).lower():
            raise UnsafeCheckpointError(f"{folder}: a shard holds something other than tensors and plain values "
                                        f"({type(cause).__name__}); nothing in it was run") from None
        raise
