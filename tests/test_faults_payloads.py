"""Loading a checkpoint changes nothing but its own result: crafted ``.metadata`` that would set class
attributes (``Metadata.__getstate__``, ``PosixPath.iterdir``, ``PosixPath._str``), function attributes or
shared constants through BUILD, allocate gigabytes from a few bytes, or read files outside the checkpoint
(``..``, absolute paths, symbolic links into another run). Each payload family: refused in one line naming
the file, the process's classes unchanged, and a checkpoint written afterwards still saves and loads."""

from __future__ import annotations

import io
import json
import pathlib
import pickle
import resource
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.serialization
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint.filesystem import _StorageInfo

from flexpack.run.model import build_model
from flexpack.run.state import checkpoint, manifest, torch_file
from flexpack.run.state.safeload import SafePlanner, UnsafeCheckpointError, read_metadata_file
from helpers import run_cli, tiny_config

MD = md.__name__
WATCHED = (md.Metadata, md.TensorStorageMetadata, md.BytesStorageMetadata, md.ChunkStorageMetadata,
           md.TensorProperties, md.MetadataIndex, md.StorageMeta, _StorageInfo, pathlib.PurePath, pathlib.Path,
           pathlib.PurePosixPath, pathlib.PosixPath)


def _state() -> dict:
    """What a payload would change: the attributes of every class it can name, the enum's members, torch's
    layout lookup and its cache."""
    out = {c: dict(vars(c)) for c in WATCHED}
    out["enum"] = [dict(vars(m)) for m in md._MEM_FORMAT_ENCODING]
    out["layout"] = (torch.serialization._get_layout, dict(vars(torch.serialization._get_layout)))
    return out


def _restore(before: dict) -> None:
    """Put back what a payload that got through changed (a broken check must not break every later test)."""
    for c in WATCHED:
        for k in set(vars(c)) - set(before[c]):
            delattr(c, k)
        for k, v in before[c].items():
            if vars(c).get(k) is not v:
                setattr(c, k, v)
    for member, saved in zip(md._MEM_FORMAT_ENCODING, before["enum"]):
        member.__dict__.update(saved)
    torch.serialization._get_layout.__dict__.update(before["layout"][1])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A run folder with one real checkpoint of the tiny model (no training: written by checkpoint.save)."""
    run = tmp_path_factory.mktemp("payloads") / "run"
    cfg = tiny_config(run / "no-data", run)
    torch.manual_seed(0)
    model = build_model(cfg)
    checkpoint.save(run / "checkpoints", 2, model, torch.optim.AdamW(model.parameters()), config=cfg.to_dict(),
                    sampler_state={}, extra={})
    return run


def _copy(ckpt: Path, tmp_path: Path) -> tuple[Path, Path]:
    run = tmp_path / "run"
    shutil.copytree(ckpt, run, symlinks=True)
    return run, run / "checkpoints" / "step_00000002"


def _text(s: str) -> bytes:
    b = s.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(b)]) + b


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _set_attrs(target: bytes, name: str, value: bytes) -> bytes:
    """Opcodes that BUILD ``target`` with the slot state ``{name: value}`` (``setattr``), then drop it."""
    return target + pickle.NONE + pickle.EMPTY_DICT + _text(name) + value + pickle.SETITEM + pickle.TUPLE2 \
        + pickle.BUILD + pickle.POP


def _with_side_effect(real: bytes, ops: bytes) -> bytes:
    """The real metadata, preceded by ``ops``: the file still loads as good metadata when ``ops`` go through."""
    assert real[:2] == pickle.PROTO + b"\x04"
    return real[:2] + ops + real[2:]


def _remanifest(folder: Path) -> None:
    (folder / manifest.MANIFEST).write_text(json.dumps(manifest.describe(folder)))


def _saves_and_loads(tmp_path: Path) -> None:
    """After a refusal the process still writes checkpoints it can read, and prunes them."""
    cfg = tiny_config(tmp_path / "no-data", tmp_path / "after")
    model = build_model(cfg)
    root = tmp_path / "after" / "checkpoints"
    for step in (1, 2, 3):
        checkpoint.save(root, step, model, None, config=cfg.to_dict(), keep=1)
    assert [p.name for p in checkpoint.list_checkpoints(root)] == ["step_00000003"]
    assert checkpoint.problem(root / "step_00000003") is None
    assert checkpoint.tensor_shapes(root / "step_00000003")["model.patch_embed.weight"]


def _line(err: str, command: str) -> str:
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines[-1].startswith(f"flexpack {command}: error: "), err
    return lines[-1]


SIDE_EFFECTS = {
    # every checkpoint written afterwards would pickle as a bare tuple: unreadable, so the next load falls back
    "Metadata.__getstate__": _set_attrs(_global(MD, "Metadata"), "__getstate__", _global("torch", "Size")),
    # pruning would list nothing (checkpoint.keep=1 kept 7)
    "PosixPath.iterdir": _set_attrs(_global("pathlib", "PosixPath"), "iterdir", _global("torch", "Size")),
    # every path of the process would print as this one
    "PosixPath._str": _set_attrs(_global("pathlib", "PosixPath"), "_str", _text("/elsewhere")),
    # a shared enum member, a function's attribute: no class, still the whole process's
    "memory format member": _set_attrs(_global(MD, "_MEM_FORMAT_ENCODING") + pickle.BININT1 + b"\x00"
                                       + pickle.TUPLE1 + pickle.REDUCE, "_value_", pickle.BININT1 + b"\x07"),
    "_get_layout.cache": _set_attrs(_global("torch.serialization", "_get_layout"), "cache", pickle.EMPTY_DICT
                                    + _text("torch.strided") + _global("torch", "Size") + pickle.SETITEM),
}


@pytest.mark.parametrize("family", list(SIDE_EFFECTS))
def test_build_on_anything_but_a_fresh_instance_is_refused_and_changes_nothing(capsys, ckpt, tmp_path, family):
    run, folder = _copy(ckpt, tmp_path)
    meta = folder / "state" / ".metadata"
    meta.write_bytes(_with_side_effect(meta.read_bytes(), SIDE_EFFECTS[family]))
    _remanifest(folder)  # a crafted checkpoint comes with a manifest that fits
    before = _state()
    try:
        read_metadata_file(meta)
        message = None
    except UnsafeCheckpointError as exc:
        message = str(exc)
    finally:
        changed = _state() != before
        _restore(before)
    assert not changed, f"{family} got through"
    assert message is not None and message.startswith(f"{meta}: not readable as checkpoint metadata "
                                                       "(UnpicklingError: refuses") and "\n" not in message
    code, err = run_cli(capsys, "export", str(run), str(tmp_path / "exp"))
    line = _line(err, "export")
    assert code == 2 and "no usable checkpoint" in line and str(meta) in line and "nothing in it was run" in line
    assert _state() == before
    _saves_and_loads(tmp_path)


def test_metadata_holds_exactly_the_globals_dcp_writes(ckpt):
    """The allow-list is what a real checkpoint uses: every global it names is used, and nothing else."""
    from flexpack.run.state.dcp_metadata import ALLOWED

    seen = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    Recorder(open(ckpt / "checkpoints" / "step_00000002" / "state" / ".metadata", "rb")).load()
    assert seen <= set(ALLOWED)
    dtypes = {k for k, v in ALLOWED.items() if isinstance(v, torch.dtype)}
    assert set(ALLOWED) - dtypes == seen - dtypes  # no unused class, function or constant besides dtypes
    for module, name in [("builtins", "bytearray"), ("builtins", "set"), ("collections", "OrderedDict"),
                         ("torch.distributed.checkpoint.planner", "WriteItemType"), ("builtins", "getattr")]:
        assert (module, name) not in ALLOWED


def test_allocations_are_refused_before_they_happen(capsys, ckpt, tmp_path):
    run, folder = _copy(ckpt, tmp_path)
    meta = folder / "state" / ".metadata"
    # 35 bytes asking for 6 GB
    six_gb = pickle.PROTO + b"\x04" + _global("builtins", "bytearray") + pickle.LONG1 + b"\x05" \
        + (6_000_000_000).to_bytes(5, "little") + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP
    assert len(six_gb) <= 40
    rss, before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, _state()
    meta.write_bytes(six_gb)
    with pytest.raises(UnsafeCheckpointError, match=r"refuses to build builtins.bytearray"):
        read_metadata_file(meta)
    # a path joined from 100 references to one 200-character text: 20,000 characters from 400 bytes
    bomb = (pickle.PROTO + b"\x04" + _text("x" * 200) + pickle.MEMOIZE + pickle.POP + _global("pathlib", "PosixPath")
            + pickle.MARK + (pickle.BINGET + b"\x00") * 100 + pickle.TUPLE + pickle.REDUCE + pickle.STOP)
    meta.write_bytes(bomb)
    with pytest.raises(UnsafeCheckpointError, match=r"_posix_path: more than 4096 arguments or 4096 characters"):
        read_metadata_file(meta)
    # a tensor entry larger than every shard file together: refused before read_tensors allocates it
    shutil.rmtree(folder)
    shutil.copytree(ckpt / "checkpoints" / "step_00000002", folder)
    real = read_metadata_file(meta)
    entry = real.state_dict_metadata["model.patch_embed.weight"]
    entry.size = torch.Size([1_000_000, 1_000_000])
    entry.chunks = [md.ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=entry.size)]
    meta.write_bytes(pickle.dumps(real))
    _remanifest(folder)
    with pytest.raises(UnsafeCheckpointError, match=r"entry 'model.patch_embed.weight' claims \[1000000, 1000000\] "
                                                     r"torch.float32 \(4000000000000 bytes\), more than the \d+ bytes"):
        checkpoint.read_tensors(folder)
    code, err = run_cli(capsys, "export", str(run), str(tmp_path / "exp"))
    assert code == 2 and "claims [1000000, 1000000]" in _line(err, "export")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 500_000  # KiB: nothing near 6 GB or 4 TB
    assert _state() == before


@pytest.mark.parametrize("where", ["../../../other/checkpoints/step_00000002/state/__0_0.distcp", "/etc/passwd",
                                   "__0_0.distcp/../__0_0.distcp"])
def test_storage_paths_leaving_the_checkpoint_are_refused(capsys, ckpt, tmp_path, where):
    run, folder = _copy(ckpt, tmp_path)
    shutil.copytree(ckpt, tmp_path / "other", symlinks=True)
    meta = folder / "state" / ".metadata"
    real = read_metadata_file(meta)
    real.storage_data = {k: _StorageInfo(where, v.offset, v.length, v.transform_descriptors)
                         for k, v in real.storage_data.items()}
    meta.write_bytes(pickle.dumps(real))
    _remanifest(folder)
    before = _state()
    why = checkpoint.problem(folder)
    assert why is not None and f"is {where!r}, not a shard file of this folder" in why
    with pytest.raises(UnsafeCheckpointError, match="not a shard file of this folder"):
        checkpoint.read_tensors(folder)  # no manifest check on this path: the metadata check alone refuses it
    code, err = run_cli(capsys, "export", str(run), str(tmp_path / "exp"))
    assert code == 2 and "not a shard file of this folder" in _line(err, "export")
    assert _state() == before


def test_a_shard_linked_to_another_runs_weights_is_refused(capsys, ckpt, tmp_path):
    run, folder = _copy(ckpt, tmp_path)
    before = _state()
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    theirs = other / "checkpoints" / "step_00000002" / "state" / "__0_0.distcp"
    tensors = checkpoint.read_tensors(theirs.parent.parent)
    shard = folder / "state" / "__0_0.distcp"
    shard.unlink()
    shard.symlink_to(theirs)
    _remanifest(folder)  # sizes and checksums of the linked file: intact as far as the old checks went
    why = checkpoint.problem(folder)
    assert why == (f"{folder}: state/__0_0.distcp leads outside the checkpoint folder (a symbolic link); a "
                   "checkpoint's files are its own")
    with pytest.raises(UnsafeCheckpointError, match=r"__0_0.distcp is a symbolic link \(to .*other.*\); a "
                                                    r"checkpoint reads only its own files"):
        checkpoint.read_tensors(folder)
    code, err = run_cli(capsys, "export", str(run), str(tmp_path / "exp"))
    assert code == 2 and "leads outside the checkpoint folder" in _line(err, "export")
    assert tensors  # the other run is untouched and still reads
    # a whole state/ folder linked elsewhere is refused the same way
    shutil.rmtree(folder / "state")
    (folder / "state").symlink_to(theirs.parent)
    assert "leads outside the checkpoint folder" in checkpoint.problem(folder)
    assert _state() == before


class _Reduce:
    """Pickles as ``func(*args)`` (what a crafted file would hold)."""

    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_non_tensor_items_and_rng_state_allocate_nothing_a_number_asks_for(ckpt, tmp_path):
    """``torch.load(weights_only=True)`` builds ``bytearray(n)`` and ``torch.ByteStorage(n)`` for any n."""
    planner = SafePlanner()
    planner._source = "state"
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="optim.param_groups.0.lr"))
    for payload, refused in [(_Reduce(bytearray, 6_000_000_000), "bytearray"),
                             (_Reduce(torch.FloatStorage, 1_500_000_000), "torch.FloatStorage"),
                             ({"lr": torch.zeros(3)}, "torch._utils._rebuild_tensor_v2")]:
        with pytest.raises(UnsafeCheckpointError, match=rf"optim.param_groups.0.lr is not plain data \(.*{refused}"):
            planner.load_bytes(item, io.BytesIO(_saved(payload)))
    good = {"lr": 1e-3, "betas": (0.9, 0.99), "params": [0, 1], "fused": None, "amsgrad": False}
    assert torch_file.plain_data(_saved(good)) == good  # what optimizer hyperparameters are: read as they were

    run, folder = _copy(ckpt, tmp_path)
    model = build_model(tiny_config(tmp_path / "no-data", run))
    for payload, refused in [({"cpu": _Reduce(torch.ByteStorage, 1_000_000_000)}, "refuses to call"),
                             ({"cpu": _Reduce(bytearray, 6_000_000_000)}, "refuses to build __builtin__.bytearray"),
                             ({"cpu": torch.zeros(3)}, "refuses to build torch.FloatStorage")]:
        (folder / "rng.pt").write_bytes(_saved(payload))
        _remanifest(folder)
        with pytest.raises(UnsafeCheckpointError, match=rf"rng.pt: not plain tensor data \(.*{refused}"):
            checkpoint.load(folder, model)
    (folder / "rng.pt").write_bytes(_saved({"cpu": torch.get_rng_state()}))
    _remanifest(folder)
    assert checkpoint.load(folder, model)["step"] == 2
