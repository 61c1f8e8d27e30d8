"""The ``torch.save`` files a checkpoint holds besides its tensor shards, read as data of a known shape.

``torch.load(weights_only=True)`` runs no code, but its allow-list builds more than a checkpoint
needs, and some of it allocates what a number in the file asks: ``bytearray(n)``,
``torch.ByteStorage(n)``, ``torch.FloatTensor(n)``, a quantized tensor of any size. A few bytes
can ask for gigabytes. So before anything is built the pickle inside the archive goes through
:class:`~flexpack.run.state.restricted_pickle.RestrictedUnpickler`:

- :func:`plain_data` (DCP's non-tensor items: optimizer hyperparameters, step counts): no global at
  all, only numbers, text, lists, tuples and dicts; the parsed value is the result.
- :func:`check_tensors` (``rng.pt``: generator states as byte tensors): only
  ``torch._utils._rebuild_tensor_v2`` over byte storages of the archive (each no larger than its
  record) and an empty ``OrderedDict`` of hooks; ``torch.load(weights_only=True)`` then reads it.

The archive itself is checked first: every entry stored uncompressed (no zip bomb), none larger
than the archive. A file that does not pass is a ``ValueError`` naming it (the caller words it).
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections.abc import Mapping
from typing import Any

from flexpack.run.state.restricted_pickle import RestrictedUnpickler


def _archive(raw: bytes) -> tuple[zipfile.ZipFile, str]:
    """The zip archive of a ``torch.save`` file and the folder name inside it (``archive/``, ``rng/``)."""
    try:
        z = zipfile.ZipFile(io.BytesIO(raw))
    except zipfile.BadZipFile:
        raise ValueError("not a torch.save archive") from None
    for info in z.infolist():
        if info.compress_type != zipfile.ZIP_STORED or info.file_size > len(raw):
            raise ValueError(f"archive entry {info.filename[:100]!r} is compressed or larger than the file")
    pickles = [i.filename for i in z.infolist() if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
    if len(pickles) != 1:
        raise ValueError("no single data.pkl in the archive")
    return z, pickles[0].split("/")[0]


def _parse(data: bytes, allowed: Mapping[tuple[str, str], Any]) -> Any:
    try:
        return RestrictedUnpickler(data, allowed=allowed, records=frozenset()).load()
    except Exception as exc:  # UnpicklingError, EOFError, a wrong argument type: all data problems
        raise ValueError(f"{type(exc).__name__}: {str(exc)[:200]}") from None


def plain_data(raw: bytes) -> Any:
    """The value of a ``torch.save`` file holding only plain data (no tensor, no class)."""
    z, folder = _archive(raw)
    return _parse(z.read(f"{folder}/data.pkl"), {})


class _Stand:
    """What the storage type ``torch.ByteStorage`` and a storage of the archive stand as while the pickle
    is checked: nothing that can be called or built."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what


_BYTE_STORAGE = _Stand("torch.ByteStorage")


def _rebuild_tensor_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
                       *metadata: Any) -> None:
    flat = (offset, *size, *stride) if type(size) is tuple and type(stride) is tuple else (None,)
    storage_ok = type(storage) is _Stand and storage.what == "storage"
    if not storage_ok or not all(type(n) is int and n >= 0 for n in flat) or hooks != {} \
            or type(requires_grad) is not bool or len(metadata) > 1:
        raise pickle.UnpicklingError("_rebuild_tensor_v2 of something other than a byte storage, sizes, strides")


def _empty_hooks() -> dict:
    return {}


class _TensorScan(RestrictedUnpickler):
    """A scan of a tensor archive's pickle: byte storages by persistent id, each no larger than its record."""

    dispatch = dict(RestrictedUnpickler.dispatch)
    dispatch[pickle.BINPERSID[0]] = pickle._Unpickler.dispatch[pickle.BINPERSID[0]]

    def __init__(self, data: bytes, z: zipfile.ZipFile, folder: str) -> None:
        allowed = {("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
                   ("collections", "OrderedDict"): _empty_hooks, ("torch", "ByteStorage"): _BYTE_STORAGE}
        super().__init__(data, allowed=allowed, records=frozenset())
        self._z, self._folder = z, folder

    def persistent_load(self, pid: Any) -> _Stand:
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage" and pid[1] is _BYTE_STORAGE
                and type(pid[2]) is str and type(pid[4]) is int):
            raise pickle.UnpicklingError("a persistent id other than a byte storage of the archive")
        try:
            record = self._z.getinfo(f"{self._folder}/data/{pid[2]}").file_size
        except KeyError:
            raise pickle.UnpicklingError(f"storage {pid[2][:50]!r} is not in the archive") from None
        if not 0 <= pid[4] <= record:
            raise pickle.UnpicklingError(f"storage {pid[2][:50]!r} claims {pid[4]} bytes, its record holds {record}")
        return _Stand("storage")


def check_tensors(raw: bytes) -> None:
    """Raise ValueError unless the ``torch.save`` file ``raw`` holds only byte tensors in plain containers."""
    z, folder = _archive(raw)
    try:
        _TensorScan(z.read(f"{folder}/data.pkl"), z, folder).load()
    except Exception as exc:  # noqa: BLE001 (every failure of the scan is the file's)
        raise ValueError(f"{type(exc).__name__}: {str(exc)[:200]}") from None
