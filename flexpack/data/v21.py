"""Read-only access to a LeRobot **v2.1** dataset folder (lerobot 0.3.x, what upstream LingBot-VA pins).

lerobot 0.6 reads only v3, and its converter (``lerobot.scripts.convert_dataset_v21_to_v30``) rewrites the
folder in place (moving the original to ``DIR_old``). A user's bundle must never change, and a bundle's items
need only the metadata and the ``action`` column, so this module reads them directly: ``meta/info.json``
(``codebase_version``, ``chunks_size``, ``data_path``, ``features``, ``fps``), ``meta/episodes.jsonl`` (one
JSON object per line: ``episode_index``, ``tasks``, ``length`` and, in post-training bundles,
``action_config``) and the episode's parquet file through pyarrow, one column at a time. Nothing is written.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"


def info_of(root: str | os.PathLike) -> dict[str, Any]:
    """``ROOT/meta/info.json`` as a dict; ValueError naming the file when it is missing or not JSON."""
    path = Path(root) / "meta" / "info.json"
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file (a LeRobot dataset has meta/info.json)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot be read as JSON ({exc})") from None
    if not isinstance(info, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(info).__name__}")
    return info


def version_of(info: dict[str, Any]) -> str:
    return str(info.get("codebase_version", ""))


def is_v21(root: str | os.PathLike) -> bool:
    """Whether ``root`` is a LeRobot v2.x dataset (``meta/episodes.jsonl`` beside a v2 ``info.json``)."""
    try:
        info = info_of(root)
    except ValueError:
        return False
    return version_of(info).startswith("v2") and (Path(root) / "meta" / "episodes.jsonl").is_file()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every JSON object of a ``.jsonl`` file; ValueError naming the file and line of a bad one."""
    out = []
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not a JSON object ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
        out.append(row)
    return out


@dataclass(frozen=True)
class Segment21:
    """One ``action_config`` entry of an episode: video frames ``[start, end)`` and its text."""

    episode: int
    segment: int  # position in the episode's action_config
    start: int
    end: int
    text: str


@dataclass
class Dataset21:
    """A LeRobot v2.1 dataset's metadata, read once; parquet columns on demand."""

    root: Path
    info: dict[str, Any]
    episodes: dict[int, dict[str, Any]] = field(default_factory=dict)  # episode_index -> episodes.jsonl row

    @classmethod
    def open(cls, root: str | os.PathLike) -> "Dataset21":
        root = Path(root)
        info = info_of(root)
        if not version_of(info).startswith("v2"):
            raise ValueError(f"{root / 'meta' / 'info.json'}: codebase_version {version_of(info)!r} is not v2.x")
        rows = read_jsonl(root / "meta" / "episodes.jsonl")
        episodes: dict[int, dict[str, Any]] = {}
        for n, row in enumerate(rows, 1):
            ep = row.get("episode_index")
            if isinstance(ep, bool) or not isinstance(ep, int) or ep < 0:
                raise ValueError(f"{root / 'meta' / 'episodes.jsonl'}:{n}: episode_index must be an integer >= 0, "
                                 f"got {ep!r}")
            if ep in episodes:
                raise ValueError(f"{root / 'meta' / 'episodes.jsonl'}:{n}: episode {ep} is listed twice")
            episodes[ep] = row
        if not episodes:
            raise ValueError(f"{root / 'meta' / 'episodes.jsonl'}: the dataset has no episodes")
        return cls(root, info, dict(sorted(episodes.items())))

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def fps(self) -> float:
        return float(self.info.get("fps", 0) or 0)

    def chunk_of(self, episode: int) -> int:
        size = int(self.info.get("chunks_size", 1000) or 1000)
        return episode // size

    def data_file(self, episode: int) -> Path:
        template = str(self.info.get("data_path", DEFAULT_DATA_PATH))
        return self.root / template.format(episode_chunk=self.chunk_of(episode), episode_index=episode)

    def feature_width(self, key: str) -> int:
        """Columns of feature ``key`` (the product of its shape); ValueError naming info.json when absent."""
        feats = self.info.get("features", {})
        if key not in feats:
            raise ValueError(f"{self.root / 'meta' / 'info.json'}: no feature {key!r} (features {sorted(feats)})")
        return int(np.prod(feats[key].get("shape", [1])))

    def length(self, episode: int) -> int:
        return int(self.episodes[episode].get("length", 0))

    def segments(self, episode: int) -> list[Segment21]:
        """The episode's ``action_config`` entries, each checked: integers ``0 <= start < end <= length``."""
        row = self.episodes[episode]
        where = f"{self.root / 'meta' / 'episodes.jsonl'}: episode {episode}"
        configs = row.get("action_config")
        if configs is None:
            raise ValueError(f"{where} has no action_config (upstream post-training bundles list an episode's "
                             "segments there)")
        if not isinstance(configs, list):
            raise ValueError(f"{where}: action_config must be a list, got {type(configs).__name__}")
        n, out = self.length(episode), []
        for j, c in enumerate(configs):
            s, e = (c.get("start_frame"), c.get("end_frame")) if isinstance(c, dict) else (None, None)
            if any(isinstance(v, bool) or not isinstance(v, int) for v in (s, e)):
                raise ValueError(f"{where}: action_config[{j}] needs integer start_frame and end_frame, got {c!r}")
            if not 0 <= s < e or (n and e > n):
                raise ValueError(f"{where}: action_config[{j}] frames [{s}, {e}) do not fit the episode's "
                                 f"{n} frames")
            out.append(Segment21(episode, j, s, e, str(c.get("action_text", "") or "")))
        return out

    def column(self, episode: int, key: str) -> np.ndarray:
        """Column ``key`` of the episode's parquet file as float64 ``(T, D)``; one line naming the file when
        it is missing, unreadable or lacks the column."""
        import pyarrow.parquet as pq

        path = self.data_file(episode)
        try:
            table = pq.read_table(path, columns=[key])
        except FileNotFoundError:
            raise ValueError(f"{path}: no such file (episode {episode} of {self.root})") from None
        except KeyError:
            raise ValueError(f"{path}: no column {key!r}") from None
        except Exception as exc:  # pyarrow's errors: ArrowInvalid, OSError, ...
            if "No match for FieldRef" in str(exc) or "not in schema" in str(exc):
                raise ValueError(f"{path}: no column {key!r}") from None
            raise ValueError(f"{path}: cannot be read as parquet ({type(exc).__name__}: {exc})") from None
        values = table.column(key).to_pylist()
        try:
            arr = np.asarray(values, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(f"{path}: column {key!r} is not numeric rows of one width") from None
        return arr.reshape(len(values), -1)
