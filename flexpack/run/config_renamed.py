"""Keys that ``[runtime]`` once held, at their place now (:data:`RENAMED`): a config's nested dicts and
``--set`` overrides upgraded, with a note on stderr where the user wrote the old name
(:mod:`flexpack.run.config`'s :func:`~flexpack.run.config.load_config` calls both)."""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence

from flexpack.run.config_parse import parse_value

# keys that [runtime] once held -> their place now (section.key); one table for every reader of a config:
# a TOML file, --set, and the config.json of a run, checkpoint or export made before the split
RENAMED = {
    "activation_checkpointing": "parallel.activation_checkpointing",
    "compile": "parallel.compile",
    "activation_memory_budget": "parallel.activation_memory_budget",
    "float8": "parallel.float8",
    "profile_steps": "profile.steps",
    "profile_warmup": "profile.warmup",
    "peak_tflops": "profile.peak_tflops",
    "log_every": "log.every",
    "progress": "log.progress",
    "tensorboard": "log.tensorboard",
    "wandb": "log.wandb",
    "wandb_project": "log.wandb_project",
    "wandb_entity": "log.wandb_entity",
    "wandb_tags": "log.wandb_tags",
    "eval_every": "validation.every",
    "sample_every": "sample.every",
    "sample_steps": "sample.steps",
    "sample_episodes": "sample.episodes",
    "sample_cuts": "sample.cuts",
    "sample_horizon": "sample.horizon",
    "sample_plots": "sample.plots",
    "sample_draws": "sample.draws",
    "sample_min_context": "sample.min_context",
    "sample_ema": "sample.ema",
}


def _note(old: str, new: str) -> None:
    print(f"config: {old} is now {new}", file=sys.stderr)


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # true and 1 differ here


def upgrade(data: dict[str, Any], *, notes: bool) -> dict[str, Any]:
    """``data`` (a config as nested dicts) with every key of :data:`RENAMED` moved from ``[runtime]`` to its
    place now, a note on stderr for each where ``notes``; a key given under both names with two values is an
    error naming both."""
    runtime = data.get("runtime")
    if not isinstance(runtime, dict) or not set(runtime) & set(RENAMED):
        return data
    out = {**data, "runtime": {k: v for k, v in runtime.items() if k not in RENAMED}}
    for old, value in runtime.items():
        if old not in RENAMED:
            continue
        section, key = RENAMED[old].split(".")
        if not isinstance(out.get(section, {}), dict):
            raise ValueError(f"{section} must be a table, got {out[section]!r}")
        table = out[section] = dict(out.get(section, {}))
        if key in table and not _same(table[key], value):
            raise ValueError(f"runtime.{old} = {value!r} and {RENAMED[old]} = {table[key]!r} are one setting "
                             f"(its old and new name) with two values; keep {RENAMED[old]}")
        table[key] = value
        if notes:
            _note(f"runtime.{old}", RENAMED[old])
    return out


def upgrade_overrides(overrides: Sequence[str]) -> list[str]:
    """``overrides`` with the keys of :data:`RENAMED` (``runtime.OLD=value``) named as now, a note on
    stderr for each; an old and a new name of one key with two values is an error naming both."""
    out, given = [], {}
    for item in overrides:
        key, sep, text = item.partition("=")
        section, _, leaf = key.strip().partition(".")
        new = RENAMED.get(leaf) if section == "runtime" and sep else None
        if new is not None:
            _note(key.strip(), new)
            item = f"{new}={text}"
        name = item.partition("=")[0].strip()
        earlier = given.get(name)
        if earlier is not None and earlier[0] != key.strip() and not _same(parse_value(earlier[1].strip()),
                                                                          parse_value(text.strip())):
            raise ValueError(f"--set {earlier[0]}={earlier[1].strip()} and --set {key.strip()}={text.strip()} are "
                             f"one setting (its old and new name) with two values; keep {name}")
        given[name] = (key.strip(), text)
        out.append(item)
    return out
