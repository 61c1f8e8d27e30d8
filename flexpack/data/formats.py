"""Which reader a ``data.root`` takes, and the bundle options' checks.

``lerobot``: a LeRobot v3 dataset with flexpack's latent cache (:class:`~flexpack.data.LatentEpisodeDataset`).
``lingbot-bundle``: an upstream LingBot-VA post-training bundle (:class:`~flexpack.data.bundle.BundleDataset`):
a root holding ``empty_emb.pt``, or a LeRobot v2.1 dataset whose ``latents/chunk-XXX/`` holds ``.pth`` files.
``auto`` (the default) tells them apart by exactly that.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

FORMATS = ("auto", "lerobot", "lingbot-bundle")
BUNDLE = "lingbot-bundle"


def detect(root: str | os.PathLike, format: str = "auto") -> str:
    """``format`` where it names one, else ``lingbot-bundle`` or ``lerobot`` by what ``root`` holds."""
    if format != "auto":
        return format
    root = Path(root)
    if (root / "empty_emb.pt").is_file():
        return BUNDLE
    from flexpack.data.v21 import is_v21

    if is_v21(root) and any((root / "latents").glob("chunk-*/*/*.pth")):
        return BUNDLE
    return "lerobot"


def is_bundle(data: Any) -> bool:
    """Whether a config's data section reads bundles (a mixture of them, or a ``data.root`` that is one)."""
    return bool(getattr(data, "datasets", ())) or (bool(data.root) and detect(data.root, data.format) == BUNDLE)


def check_data_options(data: Any) -> None:
    """The data section's format and bundle options, by value alone (no file is read)."""
    from flexpack.data.bundle import MISSING
    from flexpack.data.bundle_actions import parse_transform
    from flexpack.data.bundle_grid import LAYOUTS

    if data.format not in FORMATS:
        raise ValueError(f"data.format must be one of {FORMATS}, got {data.format!r}")
    if data.camera_layout not in LAYOUTS:
        raise ValueError(f"data.camera_layout must be one of {LAYOUTS}, got {data.camera_layout!r}")
    if data.missing not in MISSING:
        raise ValueError(f"data.missing must be one of {MISSING}, got {data.missing!r}")
    if not 0.0 <= data.cfg_prob <= 1.0:
        raise ValueError(f"data.cfg_prob must be a probability in [0, 1], got {data.cfg_prob!r}")
    parse_transform(data.action_transform)


def read_norm_stat(path: str) -> dict[str, list[float]] | None:
    """``data.norm_stat``'s file as ``{"q01": [...], "q99": [...]}``; None for ``""``."""
    if not path:
        return None
    try:
        stat = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"data.norm_stat = {path!r}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"data.norm_stat = {path!r}: cannot be read as JSON ({exc})") from None
    if not isinstance(stat, dict) or not {"q01", "q99"} <= set(stat):
        raise ValueError(f"data.norm_stat = {path!r}: expected a JSON object with q01 and q99 lists")
    return {"q01": list(stat["q01"]), "q99": list(stat["q99"])}
