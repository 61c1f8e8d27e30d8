"""Every training-config key with its value, default and one-line doc, from the dataclasses alone.

One source for the docs: the comment written on a field's line in the dataclass source
(``steps: int = 1000  # optimizer steps of the run``), or, without one, the comment lines right
above the field. They are read with :mod:`tokenize` and :mod:`ast`, so nothing needs to be kept in
sync by hand: ``flexpack config show``, ``flexpack config defaults`` and ``docs/CONFIG.md`` are all
rendered here, and a test fails for a field without a doc.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import json
import math
import textwrap
import tokenize
import typing
from dataclasses import dataclass
from typing import Any

from flexpack.run.config import RENAMED, TrainConfig

REGENERATE = "flexpack config markdown > docs/CONFIG.md"


@dataclass(frozen=True, kw_only=True)
class Key:
    section: str
    name: str
    type: str
    value: Any
    default: Any
    doc: str

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}"


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """``{field: doc}`` of a dataclass: the comment on the field's line, else the comment lines just above."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, alone on its line)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            alone = not tok.line[:tok.start[1]].strip()
            comments[tok.start[0]] = (tok.string.lstrip("#").strip(), alone)
    cls_node = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef))
    docs = {}
    for node in cls_node.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        text, alone = comments.get(node.end_lineno, ("", True))
        if not text or alone:  # no trailing comment: the block of comment lines right above
            above, line = [], node.lineno - 1
            while line in comments and comments[line][1]:
                above.insert(0, comments[line][0])
                line -= 1
            text = " ".join(above)
        docs[node.target.id] = text
    return docs


def _type_name(tp: Any) -> str:
    text = tp.__name__ if isinstance(tp, type) else str(tp)
    return text.replace("typing.", "")


def keys(cfg: TrainConfig | None = None) -> list[Key]:
    """Every leaf key of the config tree, section by section, in the dataclasses' order."""
    from flexpack.run.resolve import checked  # the defaults as a config loads them (model.mask: the family's)

    default = checked(TrainConfig())
    cfg = default if cfg is None else cfg
    out = []
    for section in dataclasses.fields(TrainConfig):
        sec_cls = typing.get_type_hints(TrainConfig)[section.name]
        hints, docs = typing.get_type_hints(sec_cls), field_docs(sec_cls)
        for f in dataclasses.fields(sec_cls):
            out.append(Key(section=section.name, name=f.name, type=_type_name(hints[f.name]),
                           value=getattr(getattr(cfg, section.name), f.name),
                           default=getattr(getattr(default, section.name), f.name), doc=docs.get(f.name, "")))
    return out


def toml_value(v: Any) -> str:
    """``v`` as a TOML literal (None has none: callers write such keys commented out)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"cannot write the non-finite float {v!r} as a config value")
        return repr(v)  # shortest round-trip repr; '1e-08' and '0.0001' are valid TOML floats
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a TOML basic string (same escapes)
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_value(x)}" for k, x in v.items()) + "}"
    if dataclasses.is_dataclass(v):  # an entry of a list of tables (a [[data.datasets]] entry): its set keys
        return toml_value({f.name: getattr(v, f.name) for f in dataclasses.fields(v) if getattr(v, f.name) is not None})
    raise TypeError(f"no TOML form for {type(v).__name__} {v!r}")


def _shown(v: Any) -> str:
    return "unset" if v is None else toml_value(v)


def render_show(cfg: TrainConfig) -> str:
    """The resolved config, one line per key: ``key = value  # doc (default: ...)``; changed keys marked ``*``."""
    rows = [(k, f"{'*' if k.value != k.default else ' '} {k.name} = {_shown(k.value)}") for k in keys(cfg)]
    width = min(max(len(text) for _, text in rows), 48)
    lines, section = [], None
    for k, text in rows:
        if k.section != section:
            lines.append(("\n" if section else "") + f"[{k.section}]")
            section = k.section
        default = "" if k.value == k.default else f" (default: {_shown(k.default)})"
        lines.append(f"{text.ljust(width)}  # {k.doc}{default}")
    lines.append("\n* = differs from the default")
    return "\n".join(lines) + "\n"


def render_defaults() -> str:
    """A complete commented TOML of the defaults; :func:`load_config` reads it back to exactly them.

    Keys whose default is None are commented out: TOML has no null, and leaving a key out is None.
    """
    lines = ["# flexpack training config: every key with its default (flexpack config defaults).",
             "# A config file names only what differs; keys commented out default to unset.", ""]
    section = None
    for k in keys():
        if k.section != section:
            lines += ([""] if section else []) + [f"[{k.section}]"]
            section = k.section
        lines.append(f"# {k.doc}")
        if k.default is None:
            lines.append(f"# {k.name} =   ({k.type}; unset by default)")
        else:
            lines.append(f"{k.name} = {toml_value(k.default)}")
    return "\n".join(lines) + "\n"


def _entry_tables() -> list[str]:
    """A table per list-of-tables key (``[[data.datasets]]``): the keys of one entry."""
    out = []
    for section in dataclasses.fields(TrainConfig):
        sec_cls = typing.get_type_hints(TrainConfig)[section.name]
        for f in dataclasses.fields(sec_cls):
            args = typing.get_args(typing.get_type_hints(sec_cls)[f.name])
            if not (args and dataclasses.is_dataclass(args[0])):
                continue
            cls, docs = args[0], field_docs(args[0])
            hints = typing.get_type_hints(cls)
            out += ["", f"## `[[{section.name}.{f.name}]]` (each entry)", "", "| key | type | default | doc |",
                    "|---|---|---|---|"]
            for e in dataclasses.fields(cls):
                has = e.default is not dataclasses.MISSING
                default = ("required" if not has else "unset" if e.default is None
                           else f"`{_md_cell(toml_value(e.default))}`")
                out.append(f"| `{e.name}` | `{_md_cell(_type_name(hints[e.name]))}` | {default} | "
                           f"{_md_cell(docs.get(e.name, ''))} |")
    return out


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown() -> str:
    """``docs/CONFIG.md``: one table per section (key, type, default, doc)."""
    lines = ["# Training config reference", "",
             f"Generated from the config dataclasses by `{REGENERATE}`; do not edit by hand.",
             "A config file (TOML or JSON) names only what differs from these defaults; `--set section.key=value`",
             "overrides any key. `flexpack config show CONFIG` prints a resolved config, "
             "`flexpack config defaults` a complete TOML.", ""]
    section = None
    for k in keys():
        if k.section != section:
            lines += ([""] if section else []) + [f"## `[{k.section}]`", "", "| key | type | default | doc |",
                                                  "|---|---|---|---|"]
            section = k.section
        default = "unset" if k.default is None else f"`{_md_cell(toml_value(k.default))}`"
        lines.append(f"| `{k.name}` | `{_md_cell(k.type)}` | {default} | {_md_cell(k.doc)} |")
    lines += _entry_tables()
    lines += ["", "## Renamed keys", "",
              "Keys `[runtime]` once held load at their new place: a TOML file or `--set` says so on stderr, an older",
              "run's saved config.json loads quietly.", "", "| old key | key now |", "|---|---|"]
    lines += [f"| `runtime.{old}` | `{new}` |" for old, new in RENAMED.items()]
    return "\n".join(lines) + "\n"
