"""Datasets named by a LeRobot repo id (``org/name``), found where lerobot keeps them.

lerobot stores a dataset ``org/name`` under ``HF_LEROBOT_HOME/org/name`` (``lerobot.utils.constants``;
default ``~/.cache/huggingface/lerobot``, the ``HF_LEROBOT_HOME`` environment variable moves it).
:func:`resolve_root` maps a ``data.root`` / ``--dataset`` value to a folder: an existing path is
used as it is; otherwise a value shaped like a repo id is looked up in that cache. Nothing is
downloaded (training nodes are often offline): a dataset missing from the cache is a one-line
error naming where it looked and the command that fetches it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def lerobot_home() -> Path:
    """lerobot's dataset cache folder (read at call time, so a changed HF_LEROBOT_HOME is seen)."""
    if os.environ.get("HF_LEROBOT_HOME"):
        return Path(os.environ["HF_LEROBOT_HOME"]).expanduser()
    from lerobot.utils.constants import HF_LEROBOT_HOME

    return Path(HF_LEROBOT_HOME)


def resolve_root(root: str | os.PathLike) -> Path:
    """The local folder of dataset ``root``: a path, or a repo id in lerobot's cache."""
    path = Path(root).expanduser()
    text = os.fspath(root)
    if path.exists() or not REPO_ID.match(text):
        return path
    cached = lerobot_home() / text
    from flexpack.safenames import inside

    inside(lerobot_home(), cached)  # a repo id names a folder inside the cache, never beside it
    if (cached / "meta" / "info.json").is_file():
        return cached
    raise FileNotFoundError(
        f"{text}: no such folder, and not in the LeRobot cache (looked for {cached}/meta/info.json); download it "
        f"with `hf download {text} --repo-type dataset --local-dir {cached}` (or set HF_LEROBOT_HOME)")
