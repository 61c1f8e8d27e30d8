"""What a ``torch.distributed.checkpoint`` ``.metadata`` file may hold, and what it may point at.

:func:`parse` reads the pickle with :class:`~flexpack.run.state.restricted_pickle.RestrictedUnpickler`
and exactly the globals DCP's ``FileSystemWriter`` writes into it (listed from real checkpoints of
one process and of two FSDP ranks; float8 training adds none, since ``TensorProperties`` records a
dtype, not a tensor class): the metadata dataclasses and ``_StorageInfo`` (the only classes whose
fresh instances take state), ``torch.Size``, torch dtypes, a layout by name, a memory format by
number and the ``PosixPath`` of ``StorageMeta.checkpoint_id`` (read as text).

:func:`problem` then checks the result against the folder it came from, before anything is
allocated or opened from it:

- its shape: a ``Metadata`` of tensor / bytes entries with sizes, chunks inside their tensor, and
  storage entries ``MetadataIndex -> _StorageInfo``;
- every storage path is a shard name DCP writes (``__<rank>_<n>.distcp``) of a regular file in
  the same folder, no symbolic link, its ``offset + length`` within the file, no transforms
  (flexpack writes none; an unknown one could inflate what is read);
- no tensor is larger than the shard files beside it: a size in the metadata is what
  ``read_tensors`` allocates (``torch.empty``), and stored tensors are never smaller than the
  bytes they hold, so the shards' total size caps every allocation.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint.filesystem import _StorageInfo

from flexpack.run.state.restricted_pickle import RestrictedUnpickler, checked

SHARD = re.compile(r"^__\d+_\d+\.distcp$")
RECORDS = frozenset({md.Metadata, md.TensorStorageMetadata, md.BytesStorageMetadata, md.ChunkStorageMetadata,
                     md.TensorProperties, md.MetadataIndex, md.StorageMeta, _StorageInfo})
_LAYOUTS = MappingProxyType({str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)})
_FORMATS = (torch.contiguous_format, torch.channels_last, torch.preserve_format)


def _get_layout(name: str) -> torch.layout:
    """A layout from its name (``torch.serialization._get_layout``'s job, without its process-wide cache)."""
    return _LAYOUTS[name]


def _mem_format(code: int) -> md._MEM_FORMAT_ENCODING:
    return md._MEM_FORMAT_ENCODING(code)


def _posix_path(*parts: str) -> str:
    return str(PurePosixPath(*parts))


ALLOWED = MappingProxyType({
    **{(c.__module__, c.__name__): c for c in RECORDS},
    ("torch", "Size"): torch.Size,  # an immutable type
    **{("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)},  # immutable constants
    ("torch.serialization", "_get_layout"): checked(_get_layout, max_args=1, max_chars=64),
    (md.__name__, "_MEM_FORMAT_ENCODING"): checked(_mem_format, max_args=1, max_chars=0),
    ("pathlib", "PosixPath"): checked(_posix_path, max_args=4096, max_chars=4096),
})


def parse(data: bytes) -> Any:
    """The object a ``.metadata`` file's bytes hold, built under the rules of the restricted unpickler."""
    return RestrictedUnpickler(data, allowed=ALLOWED, records=RECORDS).load()


def _size(value: Any, what: str) -> tuple[int, ...]:
    if type(value) is not torch.Size or any(n < 0 for n in value):
        raise ValueError(f"{what} is not a size")
    return tuple(value)


def _tensor(fqn: str, entry: Any, cap: int) -> None:
    p = entry.properties
    if not (type(p) is md.TensorProperties and isinstance(p.dtype, torch.dtype) and p.layout is torch.strided
            and p.memory_format in _FORMATS and type(p.requires_grad) is bool and type(p.pin_memory) is bool):
        raise ValueError(f"entry {fqn!r} has no tensor properties of a strided tensor")
    size = _size(entry.size, f"the size of entry {fqn!r}")
    nbytes = math.prod(size) * p.dtype.itemsize
    if nbytes > cap:
        raise ValueError(f"entry {fqn!r} claims {list(size)} {p.dtype} ({nbytes} bytes), more than the {cap} bytes "
                         "of shard files beside it")
    if type(entry.chunks) is not list:
        raise ValueError(f"entry {fqn!r} has no list of chunks")
    for chunk in entry.chunks:
        if type(chunk) is not md.ChunkStorageMetadata:
            raise ValueError(f"entry {fqn!r} has a chunk that is not a chunk")
        offsets, sizes = _size(chunk.offsets, f"a chunk offset of {fqn!r}"), _size(chunk.sizes, f"a chunk of {fqn!r}")
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o + s > n for o, s, n in zip(offsets, sizes, size)):
            raise ValueError(f"entry {fqn!r} has a chunk {list(offsets)}+{list(sizes)} outside its size {list(size)}")


def _shards(folder: Path) -> dict[str, int]:
    """Sizes of the shard files in ``folder`` that are regular files (not symbolic links)."""
    out = {}
    with os.scandir(folder) as entries:
        for e in entries:
            if SHARD.match(e.name) and e.is_file(follow_symlinks=False):
                out[e.name] = e.stat(follow_symlinks=False).st_size
    return out


def _storage(index: Any, info: Any, folder: Path, shards: dict[str, int]) -> None:
    if type(index) is not md.MetadataIndex or type(index.fqn) is not str:
        raise ValueError("a storage entry has no item name")
    if type(info) is not _StorageInfo:
        raise ValueError(f"the storage of {index.fqn!r} is not a storage entry")
    path = info.relative_path
    if type(path) is not str or not SHARD.match(path):
        shown = path if type(path) is str else type(path).__name__
        raise ValueError(f"the storage of {index.fqn!r} is {shown[:200]!r}, not a shard file of this folder "
                         "(__RANK_N.distcp)")
    if path not in shards:
        full = folder / path
        if full.is_symlink():
            raise ValueError(f"{path} is a symbolic link (to {os.readlink(full)}); a checkpoint reads only its own "
                             "files")
        raise ValueError(f"{path}, which holds {index.fqn!r}, is missing")
    if info.transform_descriptors:
        raise ValueError(f"the storage of {index.fqn!r} names transforms, which flexpack never writes")
    if not (type(info.offset) is int and type(info.length) is int and 0 <= info.offset
            and 0 <= info.length <= shards[path] - info.offset):
        raise ValueError(f"the storage of {index.fqn!r} lies outside {path} ({shards[path]} bytes)")


def _plain(value: Any, kinds: tuple[type, ...]) -> bool:
    return type(value) in kinds


def problem(meta: Any, folder: str | os.PathLike) -> str | None:
    """Why ``meta`` (from :func:`parse`) is not metadata of the shards in ``folder``, or None."""
    folder = Path(folder)
    if type(meta) is not md.Metadata:
        return f"holds {type(meta).__module__}.{type(meta).__qualname__}, not checkpoint metadata"
    if folder.is_symlink():
        return f"{folder} is a symbolic link (to {os.readlink(folder)}); a checkpoint reads only its own files"
    try:
        shards = _shards(folder)
        cap = sum(shards.values())
        if type(meta.storage_data) is not dict:
            raise ValueError("has no table of storage entries")
        for index, info in meta.storage_data.items():
            _storage(index, info, folder, shards)
        entries = meta.state_dict_metadata
        if type(entries) is not dict:
            raise ValueError("has no table of entries")
        for fqn, entry in entries.items():
            if type(fqn) is not str:
                raise ValueError("has an entry without a name")
            if type(entry) is md.TensorStorageMetadata:
                _tensor(fqn, entry, cap)
            elif type(entry) is not md.BytesStorageMetadata:
                raise ValueError(f"entry {fqn!r} is neither a tensor nor bytes")
        planner = meta.planner_data
        if planner is not None and not (type(planner) is dict and all(
                _plain(k, (str,)) and _plain(v, (tuple, list)) and all(_plain(x, (str, int)) for x in v)
                for k, v in planner.items())):
            raise ValueError("has planner data other than names")
        sm = meta.storage_meta
        if sm is not None and not (type(sm) is md.StorageMeta and all(
                _plain(getattr(sm, k, None), (str, type(None))) for k in ("checkpoint_id", "save_id", "load_id"))
                and type(sm.modules) is list and all(_plain(m, (str,)) for m in sm.modules)):
            raise ValueError("has storage facts other than names")
        if not _plain(meta.version, (str, type(None))):
            raise ValueError("has a version that is not text")
    except ValueError as exc:
        return str(exc)
    except (AttributeError, TypeError, OverflowError) as exc:  # a field missing or of another type
        return f"is not checkpoint metadata ({type(exc).__name__})"
    return None
