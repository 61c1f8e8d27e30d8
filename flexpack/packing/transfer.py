"""Layouts between host and device: copies that do not block, and the host copy a device layout keeps.

Host-side code (token expansion, segment counts, episode runs, text checks) needs a layout's values
on the CPU. Reading them back from a GPU copy waits for the GPU to reach that point of its queue,
once per read, every step; so a layout copied to the device keeps the CPU layout it came from
(:class:`HostCopy`), and :func:`on_host` returns that instead of reading the device.
"""

from __future__ import annotations

import weakref
from dataclasses import fields, replace
from typing import Any, Sequence, TypeVar

import torch
from torch import Tensor

_L = TypeVar("_L")


def to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """``t`` on ``device``; host to CUDA goes through page-locked memory with ``non_blocking=True``,
    so the host queues the copy and goes on (a pageable or blocking copy waits for the GPU to reach
    it, one stall per tensor). The source must not change afterwards: layouts never do."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)
    return t.to(device)


def _tensors(obj: Any) -> list[Tensor]:
    return [getattr(obj, f.name) for f in fields(obj) if isinstance(getattr(obj, f.name), Tensor)]


class HostCopy:
    """The CPU layout a device layout was copied from (a layout's ``host`` field).

    It answers only for the very tensors it was copied to (held as weak references) and the same
    plain fields: a layout changed by ``dataclasses.replace`` gets no stale values, while a tree map that leaves the
    tensors as they are (FSDP2 moving a module's inputs to its device) keeps it. Neither a
    dataclass nor a tensor, so such maps carry it along untouched; not pickled."""

    __slots__ = ("layout", "_refs")

    def __init__(self, layout: Any, device_tensors: Sequence[Tensor]) -> None:
        self.layout, self._refs = layout, tuple(weakref.ref(t) for t in device_tensors)

    def of(self, obj: Any) -> Any:
        """The host layout if ``obj`` holds the tensors this copy was made for (and the same plain
        values: mode, token counts, runs), else None."""
        tensors = _tensors(obj)
        if len(tensors) != len(self._refs) or any(r() is not t for r, t in zip(self._refs, tensors)):
            return None
        plain = [f.name for f in fields(obj)
                 if f.name not in ("host", "frames") and not isinstance(getattr(obj, f.name), Tensor)]
        return self.layout if all(getattr(obj, n) == getattr(self.layout, n) for n in plain) else None

    def __reduce__(self) -> tuple:
        return (_no_host, ())


def _no_host() -> None:
    return None


def with_host(device_layout: _L, host_layout: Any) -> _L:
    """``device_layout`` carrying ``host_layout`` (its CPU copy, same values) for :func:`on_host`."""
    return replace(device_layout, host=HostCopy(host_layout, _tensors(device_layout)))


def on_host(layout: _L) -> _L:
    """``layout`` with CPU tensors: its valid host copy, itself (CPU tensors), or — a device layout
    without one, e.g. built on the device or changed there — a copy read back, which waits for the GPU."""
    host = layout.host.of(layout) if layout.host is not None else None
    if host is not None:
        return host
    if _tensors(layout)[0].device.type == "cpu":
        return layout if layout.host is None else replace(layout, host=None)
    frames = {"frames": layout.frames.on_host()} if hasattr(layout, "frames") else {}  # a TokenLayout's frames
    return replace(layout, host=None, **frames, **{f.name: getattr(layout, f.name).cpu() for f in fields(layout)
                                                  if isinstance(getattr(layout, f.name), Tensor)})


def moved(layout: _L, device: torch.device | str) -> _L:
    """``layout``'s tensors on ``device`` (:func:`to_device`) with a :class:`HostCopy` of its CPU
    layout where one is known, or its CPU layout for ``device = "cpu"`` (read back only without one)."""
    device = torch.device(device)
    if device.type == "cpu":
        return on_host(layout)
    known = layout.host is not None or _tensors(layout)[0].device.type == "cpu"
    host = on_host(layout) if known else None  # a valid host copy, or the layout itself on the CPU
    out = replace(layout, host=None, **{f.name: to_device(getattr(layout, f.name), device) for f in fields(layout)
                                        if isinstance(getattr(layout, f.name), Tensor)})
    return with_host(out, host) if host is not None else out
