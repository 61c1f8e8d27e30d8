"""Checkpoints are data, never code: the readers every checkpoint load goes through.

``torch.distributed.checkpoint`` (DCP) unpickles two things with plain :mod:`pickle`: the
``state/.metadata`` index (``FileSystemReader.read_metadata``) and every non-tensor item of the
state dict (``DefaultLoadPlanner.load_bytes``, ``torch.load(weights_only=False)``). A crafted
pickle in either runs any code at load time. :class:`SafeReader` unpickles the metadata with
:class:`MetadataUnpickler`, which builds only DCP's own metadata dataclasses, torch dtypes,
sizes and layouts and plain containers; :class:`SafePlanner` loads the non-tensor items with
``weights_only=True``. Tensor shards are read by DCP with ``weights_only=True`` already; the other
files of a checkpoint are JSON (``train_state.json``, ``config.json``, ``manifest.json``) or
``weights_only`` (``rng.pt``). A file that does not pass is :class:`UnsafeCheckpointError`,
one line naming the file.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from flexpack.errors import UserError

_DCP = "torch.distributed.checkpoint"
_ALLOWED: dict[str, frozenset[str]] = {
    f"{_DCP}.metadata": frozenset({"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                   "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
                                   "MetadataIndex", "StorageMeta"}),
    f"{_DCP}.filesystem": frozenset({"_StorageInfo"}),
    f"{_DCP}.planner": frozenset({"LoadItemType", "WriteItemType"}),
    "torch": frozenset({"Size", "strided", "sparse_coo", "contiguous_format", "channels_last", "preserve_format"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a layout from its name
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),  # StorageMeta.checkpoint_id
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "tuple", "list", "dict", "slice", "bytearray"}),
}


class UnsafeCheckpointError(UserError):
    """A checkpoint file that is not plain data (or not readable as such)."""


class MetadataUnpickler(pickle.Unpickler):
    """Builds only the classes of :data:`_ALLOWED` and torch dtypes; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refuses to build {module}.{name} (not checkpoint metadata)")


def read_metadata_file(path: str | os.PathLike) -> Any:
    """The DCP ``.metadata`` at ``path`` through :class:`MetadataUnpickler`; one line on any failure."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            meta = MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise
    except Exception as exc:  # UnpicklingError, EOFError, a truncated or random file: all data problems
        raise UnsafeCheckpointError(f"{path}: not readable as checkpoint metadata ({type(exc).__name__}: {exc}); "
                                    "nothing in it was run") from None
    if type(meta).__name__ != "Metadata" or not isinstance(getattr(meta, "state_dict_metadata", None), dict):
        raise UnsafeCheckpointError(f"{path}: holds a {type(meta).__name__}, not checkpoint metadata")
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
    """Non-tensor items (optimizer hyperparameters, step counts) load with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            raise UnsafeCheckpointError(f"{getattr(self, '_source', 'a checkpoint shard')}: item "
                                        f"{read_item.dest_index.fqn} is not plain data ({type(exc).__name__}); "
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
