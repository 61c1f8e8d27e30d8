"""What several commands share, defined once: the ``--set`` flag, the config argument, and how that
argument becomes a :class:`~flexpack.run.config.TrainConfig`.

The config argument of ``train``, ``verify``, ``sample`` and ``config show`` is a TOML/JSON file or a
folder holding a config:

- a run folder (``runtime.out_dir`` of ``flexpack train``: its ``.flexpack-run`` marker and
  ``config.json``): the config its newest checkpoint was trained with (``checkpoints/step_N/config.json``),
  else the one of its first start (``config.json``), with ``runtime.out_dir`` set to the folder, so
  ``flexpack train RUN`` resumes that run wherever it now lies;
- a checkpoint folder (``RUN/checkpoints/step_N``): its ``config.json``;
- an ``flexpack export`` folder: its ``flexpack_config.json`` (its ``config.json`` is the diffusers one).

``--set`` overrides apply after that, the last one of a key winning. Nothing here imports torch or the
library when a parser is built: ``flexpack CMD --help`` stays quick (``tests/test_cli.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flexpack.run.config import TrainConfig

EXPORT_CONFIG = "flexpack_config.json"


def add_set(parser: argparse.ArgumentParser, *, of: str = "the config", example: str = "schedule.steps=40") -> None:
    """The one ``--set KEY=VALUE`` flag (repeatable; into ``args.overrides``)."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override a value of {of}, e.g. --set {example} (repeatable; the last of a key wins)")


def add_config(parser: argparse.ArgumentParser, *, folders: str = "a run folder (its config)",
               optional: bool = False) -> None:
    """The positional config argument (into ``args.config``): a TOML/JSON file or ``folders``."""
    parser.add_argument("config", type=Path, nargs="?" if optional else None, default=None,
                        help=f"TOML or JSON config (configs/tiny_cpu.toml, ...), or {folders}")


def is_run_folder(path: Path) -> bool:
    """A folder ``flexpack train`` wrote: its run marker and ``config.json``."""
    from flexpack.run.state.runfolder import MARKER

    return (path / MARKER).is_file() and (path / "config.json").is_file()


def config_source(path: Path) -> tuple[Path, tuple[str, ...]]:
    """The config file a command reads for ``path`` (a file, or a folder as the module doc says) and the
    overrides the folder implies (a run folder: its own ``runtime.out_dir``)."""
    path = Path(path)
    if not path.is_dir():
        return path, ()
    if is_run_folder(path):
        from flexpack.run.state.trained import run_config

        found = run_config(path)  # its newest checkpoint's config: every restart's changes included
        first = path / "config.json"
        if found != first and first.read_bytes() != found.read_bytes():
            print(f"config {found} (the run's current one; {first} is its first start's)", file=sys.stderr)
        return found, (f"runtime.out_dir={json.dumps(str(path))}",)
    if (path / EXPORT_CONFIG).is_file():
        return path / EXPORT_CONFIG, ()
    if (path / "train_state.json").is_file() and (path / "config.json").is_file():  # a checkpoint folder
        return path / "config.json", ()
    raise ValueError(f"{path}: a folder, but not a run folder (.flexpack-run and config.json), a checkpoint folder "
                     f"(train_state.json and config.json) nor an export folder ({EXPORT_CONFIG}); pass a TOML or JSON "
                     "config file or one of those")


def load(path: Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """The config of a config argument (``None``: the defaults) with ``--set`` ``overrides`` applied."""
    from flexpack.run.config import load_config

    if path is None:
        return load_config(None, overrides)
    file, implied = config_source(path)
    return load_config(file, [*implied, *overrides])
