"""A pickle reader that builds plain data and the few classes it is given, and changes nothing else.

Why an allow-list of globals is not enough: it stops code from running, but ``BUILD`` sets
attributes on whatever object is on the stack, an allowed *class* or function included
(``Metadata.__getstate__ = ...``, ``PosixPath.iterdir = ...``, ``PosixPath._str = ...`` would reach
every later use of that class in the process), and ``REDUCE`` of an allowed callable allocates what
its argument asks (``bytearray(6_000_000_000)`` from 35 bytes). :class:`RestrictedUnpickler` runs the
standard library's pure-Python unpickler with a rule per opcode:

- ``GLOBAL`` / ``STACK_GLOBAL``: only the names of ``allowed``, which maps ``(module, name)`` to the
  object returned in its place (a callable of the caller's that checks its arguments, a class, a
  constant);
- ``REDUCE`` / ``NEWOBJ`` / ``NEWOBJ_EX``: only on a callable of ``allowed`` (``NEWOBJ``: on a class
  of ``records``); an instance of a record class made this way is *fresh*;
- ``BUILD``: only on a fresh record instance: its ``__setstate__``, else a dict of plain names that
  goes into the instance's ``__dict__`` (no slot state, no ``setattr``);
- ``APPEND(S)`` / ``SETITEM(S)`` / ``DICT``: only into a list / dict (no allowed callable returns
  one, so every list or dict is one this file made), with keys of flat types (str, int, a record
  holding only those or a ``torch.Size``): hashing a nested key recurses in C without a limit;
- persistent ids, the extension registry, ``INST`` / ``OBJ`` (protocol 0/1 instances), sets and
  out-of-band buffers: refused.

The input is read whole into memory before the first opcode, so no opcode can ask for more bytes
than the file holds; no allowed callable grows its input (the caller's callables check their
sizes), so what a load builds is bounded by the size of the file. A refusal is a
:class:`pickle.UnpicklingError` naming the opcode or global and what it would have touched.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from collections.abc import Callable, Mapping
from typing import Any

import torch

_REFUSED = (pickle.PERSID, pickle.BINPERSID, pickle.EXT1, pickle.EXT2, pickle.EXT4, pickle.INST, pickle.OBJ,
            pickle.EMPTY_SET, pickle.ADDITEMS, pickle.FROZENSET, pickle.NEXT_BUFFER, pickle.READONLY_BUFFER)


def _name(obj: Any) -> str:
    """What an object is, for a message (never its repr: a crafted object may be nested too deep to print)."""
    if isinstance(obj, type) or callable(obj):
        return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
    return f"a {type(obj).__module__}.{type(obj).__qualname__}"


class RestrictedUnpickler(pickle._Unpickler):  # the pure-Python one: its opcodes can be replaced one by one
    """``RestrictedUnpickler(data, allowed=..., records=...).load()``; see the module doc."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes, *, allowed: Mapping[tuple[str, str], Any], records: frozenset[type]) -> None:
        super().__init__(io.BytesIO(data), fix_imports=False, encoding="utf-8")
        self._allowed, self._records = allowed, records
        self._callables = {id(v) for v in allowed.values() if callable(v)}
        self._fresh: dict[int, Any] = {}  # id -> record instance made by this load (held: ids stay unique)

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except (KeyError, TypeError):
            raise pickle.UnpicklingError(f"refuses to build {module}.{name} (not what this file may hold)") from None

    def _made(self, func: Any, obj: Any) -> Any:
        if func in self._records and type(obj) is func:
            self._fresh[id(obj)] = obj
        return obj

    def _call(self, func: Any, args: Any, kwargs: dict[str, Any] | None = None, *, new: bool = False) -> Any:
        if id(func) not in self._callables or (new and func not in self._records):
            raise pickle.UnpicklingError(f"refuses to call {_name(func)} (not an allowed constructor)")
        if type(args) is not tuple or (kwargs is not None and type(kwargs) is not dict):
            raise pickle.UnpicklingError(f"arguments of {_name(func)} are not a tuple")
        kwargs = kwargs or {}
        return self._made(func, func.__new__(func, *args, **kwargs) if new else func(*args, **kwargs))

    def load_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._call(self.stack[-1], args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._call(self.stack[-1], args, new=True)

    def load_newobj_ex(self) -> None:
        kwargs, args = self.stack.pop(), self.stack.pop()
        self.stack[-1] = self._call(self.stack[-1], args, kwargs, new=True)

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if self._fresh.get(id(inst)) is not inst:
            raise pickle.UnpicklingError(f"refuses to set attributes of {_name(inst)} (only of an object this "
                                         "file made)")
        setstate = getattr(type(inst), "__setstate__", None)
        if setstate is not None:
            setstate(inst, state)
            return
        if type(state) is tuple and len(state) == 2 and state[1] is None:
            state = state[0]
        if state is None:
            return
        if type(state) is not dict or not all(type(k) is str and not k.startswith("__") for k in state):
            raise pickle.UnpicklingError(f"state of {_name(inst)} is not a table of field names")
        inst.__dict__.update(state)

    def _key(self, key: Any) -> Any:
        flat = (str, int, bytes, type(None), torch.Size)
        if type(key) in flat or (self._fresh.get(id(key)) is key and all(type(v) in flat for v in vars(key).values())):
            return key
        raise pickle.UnpicklingError(f"refuses {_name(key)} as a dict key")

    def _container(self, kind: type) -> Any:
        target = self.stack[-1]
        if type(target) is not kind:
            raise pickle.UnpicklingError(f"refuses to add items to {_name(target)} (only to a {kind.__name__})")
        return target

    def load_append(self) -> None:
        value = self.stack.pop()
        self._container(list).append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._container(list).extend(items)

    def load_setitem(self) -> None:
        value, key = self.stack.pop(), self.stack.pop()
        self._container(dict)[self._key(key)] = value

    def load_setitems(self) -> None:
        items = self._pairs()
        target = self._container(dict)
        for i in range(0, len(items), 2):
            target[self._key(items[i])] = items[i + 1]

    def load_dict(self) -> None:
        items = self._pairs()
        self.append({self._key(items[i]): items[i + 1] for i in range(0, len(items), 2)})

    def _pairs(self) -> list[Any]:
        items = self.pop_mark()
        if len(items) % 2:
            raise pickle.UnpicklingError("a dict with a key and no value")
        return items

    def refuse(self) -> None:
        raise pickle.UnpicklingError("uses an opcode checkpoint metadata never holds")

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.APPEND[0]] = load_append
    dispatch[pickle.APPENDS[0]] = load_appends
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.DICT[0]] = load_dict
    for _op in _REFUSED:
        dispatch[_op[0]] = refuse
    del _op


def opcode_name(code: bytes) -> str:
    """``b"b"`` -> ``"BUILD"`` (for tests and messages)."""
    return pickletools.code2op[code.decode("latin-1")].name


def checked(func: Callable[..., Any], *, max_args: int, max_chars: int) -> Callable[..., Any]:
    """``func`` for the allow-list: called with at most ``max_args`` str/int arguments of at most
    ``max_chars`` characters in all (a path of many references to one long string would otherwise be
    the file's size times itself)."""
    def call(*args: Any) -> Any:
        if len(args) > max_args or not all(type(a) in (str, int) for a in args) or \
                sum(len(a) for a in args if type(a) is str) > max_chars:
            raise pickle.UnpicklingError(f"{func.__name__}: more than {max_args} arguments or {max_chars} characters, "
                                         "or arguments other than text and numbers")
        return func(*args)

    call.__name__ = call.__qualname__ = func.__name__
    call.__module__ = __name__
    return call
