"""A config's nested dicts into its dataclasses (:func:`from_dict`: unknown keys and wrong types refused,
naming the key) and ``section.key=value`` overrides (:func:`apply_overrides`: values parsed as TOML, a bare
word a string), and the checks of config values that need no system state (:func:`check_finite`,
:func:`check_device_string`). What the dataclasses are is :mod:`flexpack.run.config`'s."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tomllib
import types
import typing
from typing import Any, Sequence

from flexpack.errors import UserError

_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


def check_type(value: Any, tp: Any, where: str) -> Any:
    """``value`` converted to ``tp`` (lists → tuples, ints → floats) or a ValueError naming ``where``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in (a for a in args if a is not type(None)):
            try:
                return check_type(value, a, where)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0])
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):  # a table of a list of tables ([[data.datasets]])
        return value if isinstance(value, tp) else from_dict(tp, value, f"{where}.")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where} must be a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(check_type(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ValueError(f"{where} must have {len(args)} entries, got {value!r}")
        return tuple(check_type(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a table, got {value!r}")
        return dict(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} must be a finite number, got {value!r}")
    if tp in (int, float, str, bool) and not (isinstance(value, tp) and not (tp is int and isinstance(value, bool))):
        raise ValueError(f"{where} must be {tp.__name__}, got {value!r}")
    return value


def from_dict(cls: type, data: dict[str, Any], where: str = "") -> Any:
    """Build the dataclass ``cls`` from a nested dict, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or cls.__name__} must be a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        names = ", ".join(f"{where}{k}" for k in unknown)
        raise ValueError(f"unknown config key(s) {names} "
                         f"(known in {where.rstrip('.') or 'the top level'}: {sorted(known)})")
    kw = {}
    for name, value in data.items():
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kw[name] = from_dict(tp, value, f"{where}{name}.")
        else:
            kw[name] = check_type(value, tp, f"{where}{name}")
    return cls(**kw)


def parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word: a string


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``["schedule.steps=40", ...]`` applied to a nested dict (a copy)."""
    out = json.loads(json.dumps(data))
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r} is not KEY=VALUE (e.g. schedule.steps=40)")
        *parents, leaf = key.strip().split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {p!r} is not a table")
        node[leaf] = parse_value(text.strip())
    return out


def check_finite(node: Any, where: str = "") -> None:
    """Every float in a config tree (dataclasses, dicts, tuples) is finite: NaN slips through
    every ``<= 0`` check and a NaN ``optim.grad_clip`` trains NaN weights for a whole run."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            check_finite(getattr(node, f.name), f"{where}.{f.name}" if where else f.name)
    elif isinstance(node, dict):
        for k, v in node.items():
            check_finite(v, f"{where}.{k}" if where else str(k))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            check_finite(v, f"{where}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        raise UserError(f"{where} must be a finite number, got {node!r}")


def check_device_string(spec: str) -> None:
    """``runtime.device`` is ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (nothing else reaches torch)."""
    if not isinstance(spec, str) or not _DEVICE.match(spec):
        raise UserError(f"runtime.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {spec!r}")
