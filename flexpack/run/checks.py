"""Checks a run passes before any data or model work, worded in config keys.

:func:`preflight` runs at the top of ``train``: ``--stop-after``, non-finite numbers anywhere in
the config, the device, the memory a step needs (on the CPU: :mod:`flexpack.run.cpu_memory`) and the run
folder. Each failure is one :class:`~flexpack.errors.UserError`
line naming the config key (``runtime.device``) as the user writes it in TOML or ``--set``.
The device and number checks that need no system state run when the config is loaded
(:func:`~flexpack.run.config_parse.check_device_string`, :func:`~flexpack.run.config_parse.check_finite`).
"""

from __future__ import annotations

import argparse
import os
import re
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flexpack.errors import UserError
from flexpack.run.config_parse import check_device_string, check_finite
from flexpack.run.resolve import model_config_of

if TYPE_CHECKING:
    import torch

    from flexpack.packing.geometry import TokenGeometry
    from flexpack.run.config import TrainConfig


def resolve_device(spec: str) -> torch.device:  # torch imported lazily
    """The device ``runtime.device`` names on this rank, made current.

    ``auto``: ``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu``. ``cuda`` means
    ``cuda:LOCAL_RANK`` (torchrun's one GPU per rank); ``cuda:N`` is taken as given.
    """
    import torch

    check_device_string(spec)
    local = int(os.environ.get("LOCAL_RANK", 0))
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError(f"runtime.device = {spec!r} but CUDA is not available here (torch {torch.__version__}, "
                        f"built for CUDA {torch.version.cuda}); set runtime.device = 'cpu' or 'auto'")
    index = local if spec == "cuda" else int(spec.split(":")[1])
    count = torch.cuda.device_count()
    if index >= count:
        why = f"LOCAL_RANK={local}" if spec == "cuda" else f"{spec!r}"
        raise UserError(f"runtime.device = {spec!r} asks for GPU {index} ({why}) but {count} GPU(s) are visible")
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


def check_out_dir(path: str | os.PathLike) -> Path:
    """``runtime.out_dir`` can hold the run: not a file, and a folder this process can create and
    write to (probed with a real file: permission bits say nothing for root or on network mounts).
    Folders made for the probe are removed again: a run that fails later leaves nothing behind."""
    run = Path(path)
    for p in [run, *run.parents]:
        if p.exists() and not p.is_dir():
            what = "is a file" if p == run else f"is below {p}, which is a file"
            raise UserError(f"runtime.out_dir = {str(path)!r} {what}; choose a folder")
    made = [p for p in [run, *run.parents] if not p.exists()]
    try:
        run.mkdir(parents=True, exist_ok=True)
        probe = run / f".write-test-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"runtime.out_dir = {str(path)!r} is not writable: {exc.strerror or exc}") from exc
    finally:
        for p in made:  # deepest first
            with suppress(OSError):
                p.rmdir()
    return run


def positive_int(text: str) -> int:
    """argparse type for step counts such as ``--stop-after``: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of steps, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (a number of optimizer steps), got {value}")
    return value


def preflight(cfg: TrainConfig, stop_after: int | None = None, model_cfg: Any = None) -> torch.device:
    """Everything about ``cfg`` that can fail without data or a model; returns the device. ``model_cfg``: its
    resolved model config (default: resolved here)."""
    # 0 is a library use (build, load, take no step: tests and tools); the CLI asks for >= 1
    if stop_after is not None and (isinstance(stop_after, bool) or not isinstance(stop_after, int) or stop_after < 0):
        raise UserError(f"--stop-after must be an integer >= 1, got {stop_after!r}")
    from flexpack.parallel.parallelize import world

    check_finite(cfg)
    device = resolve_device(cfg.runtime.device)
    model_cfg = model_config_of(cfg) if model_cfg is None else model_cfg
    check_memory_ceiling(cfg, device, model_cfg)
    from flexpack.run.cpu_memory import check_cpu_memory

    check_cpu_memory(cfg, device, world()[1], model_cfg)  # a CPU step that cannot fit: refused now, not OOM-killed
    if world()[0] == 0:  # only rank 0 writes into the run folder (and one prober avoids mkdir/rmdir races)
        check_out_dir(cfg.runtime.out_dir)  # whose folder it is: runfolder.claim, next in train
    return device


def device_memory(device: torch.device) -> int:
    """Total bytes of ``device`` (host RAM for the CPU)."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_memory_ceiling(cfg: TrainConfig, device: torch.device, model_cfg: Any = None) -> None:
    """Pack mode: refuse a ``data.max_tokens`` that cannot fit, before any data or model work. The
    bound is deliberately loose: one hidden state (``dim`` values per token, in the run's dtype) of
    one micro-batch, a small part of what a step keeps, must fit the device's total memory."""
    if cfg.data.mode != "pack":
        return
    dim = (model_config_of(cfg) if model_cfg is None else model_cfg).dim
    per_value = 2 if cfg.runtime.dtype == "bfloat16" else 4
    need, have = cfg.data.max_tokens * dim * per_value, device_memory(device)
    if need > have:
        raise UserError(f"data.max_tokens = {cfg.data.max_tokens} cannot fit: one hidden state of a micro-batch alone "
                        f"({dim} values per token) needs {need / 2**30:.1f} GiB, more than the {have / 2**30:.1f} GiB "
                        f"of {device}; lower data.max_tokens")


@contextmanager
def config_terms(cfg: TrainConfig) -> Iterator[None]:
    """Re-word the data library's hints in config keys: the dataset takes ``action_dim`` from the
    model's ``action_channels``, which the user sets as ``model.overrides.action_channels``, and
    ``normalize`` from ``data.normalize``."""
    try:
        yield
    except ValueError as exc:
        text = str(exc)
        m = re.search(r"the dataset has (\d+) action columns, more than action_dim=(\d+)", text)
        if m is not None:
            raise UserError(f"{cfg.data.root}: the dataset has {m[1]} action columns but the model has "
                            f"model.overrides.action_channels = {m[2]}; raise model.overrides.action_channels "
                            f"to at least {m[1]}") from exc
        if "pass normalize=False" in text:
            raise UserError(f"{cfg.data.root}: "
                            + text.replace("pass normalize=False", "set data.normalize = false")) from exc
        raise


def check_token_budget(cfg: TrainConfig, dataset: Any, geometry: TokenGeometry) -> None:
    """Pack mode: every item fits ``data.max_tokens`` unless ``data.crop`` cuts it (named by episode).
    ``geometry``: the run's :class:`~flexpack.packing.geometry.TokenGeometry` (its too-long rule)."""
    d, tokens_per_frame = cfg.data, geometry.tokens_per_frame
    if d.max_tokens < tokens_per_frame:
        raise UserError(f"data.max_tokens = {d.max_tokens} is less than one latent frame ({tokens_per_frame} tokens: "
                        f"video patches + data.action_steps); raise data.max_tokens")
    if d.crop:
        return
    lengths = dataset.lengths()
    too_long = geometry.too_long(lengths)
    if not too_long:
        return
    i = max(too_long, key=lambda j: lengths[j])
    need = lengths[i] * tokens_per_frame
    raise UserError(f"{d.root or 'in-memory episodes'}: {_item_name(dataset, i)} has {lengths[i]} latent frames = "
                    f"{need} tokens ({tokens_per_frame} per frame) > data.max_tokens = {d.max_tokens} "
                    f"({len(too_long)} item(s) too long); raise data.max_tokens to at least {need} "
                    "or set data.crop = true")


def _item_name(dataset: Any, i: int) -> str:
    """Item ``i`` of a dataset as a user finds it: its episode (and segment) where the dataset says."""
    items = getattr(dataset, "items", None)
    if items is None:
        return f"episode {i}"
    episode, segment = items[i][0], items[i][1]
    return f"episode {episode}" + ("" if segment is None else
                                   f" segment {segment.segment} (video frames {segment.start}..{segment.stop - 1})")


_WRAPPERS = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.")


def check_state_shapes(file: str | os.PathLike, saved: Mapping[str, Any], model: Any) -> None:
    """One line when a saved model state dict does not fit ``model`` (instead of torch's line per
    tensor): how many tensors differ in shape, with the first ones, and missing / unexpected names.
    Wrapper prefixes (activation checkpointing, ``torch.compile``) are ignored; under FSDP2 the
    shapes compared are the full (unsharded) ones."""
    want = {_WRAPPERS.sub(r"\1", k): tuple(v.shape) for k, v in model.state_dict().items()}
    got = {_WRAPPERS.sub(r"\1", k): tuple(v.shape) for k, v in saved.items()}
    differ = [k for k in want if k in got and want[k] != got[k]]
    missing = [k for k in want if k not in got]
    unexpected = [k for k in got if k not in want]
    if not (differ or missing or unexpected):
        return
    parts = []
    if differ:
        shown = ", ".join(f"{k}: checkpoint {list(got[k])} vs model {list(want[k])}" for k in differ[:3])
        parts.append(f"{len(differ)} tensor(s) differ in shape ({shown}{', ...' if len(differ) > 3 else ''})")
    if missing:
        parts.append(f"{len(missing)} tensor(s) of the model are not in it (e.g. {missing[0]})")
    if unexpected:
        parts.append(f"{len(unexpected)} tensor(s) in it are not in the model (e.g. {unexpected[0]})")
    raise UserError(f"{file}: the checkpoint is of another model shape than the config builds: {'; '.join(parts)}; "
                    "use the model config it was trained with (model.preset / model.overrides)")
