"""``BundleDataset``: an upstream LingBot-VA post-training bundle, one item per ``action_config`` segment.

Items follow :class:`~flexpack.data.LatentEpisodeDataset`'s contract (``latent`` (C, F, H, W), ``action`` and
``action_mask`` (Ca, F, A), ``text`` (L, Dt) with ``text_len``, ``episode_index``, ``segment``, ``length``, ...)
plus ``dataset`` (the dataset's folder, relative to the root) and ``frame_ids``, so samplers, collates and the
model never learn where data came from. What an item holds is what upstream's loader gives its model:

* the latent: each camera's ``.pth`` (``flexpack.data.bundle_files``) composed into one grid
  (``flexpack.data.bundle_grid``; camera order = ``cameras``, the family's ``obs_cam_keys``);
* the actions: the segment's parquet rows aligned through ``frame_ids``, scattered to
  ``used_action_channel_ids``, normalized with q01/q99 and masked (``flexpack.data.bundle_actions``);
* the text: the first camera's ``text_emb``, swapped for ``empty_emb.pt`` with probability ``cfg_prob``; the
  draw is a pure function of ``(seed, epoch, item)`` (:meth:`set_epoch`), so a resume, another rank count or a
  DataLoader worker draws the same.

Episodes: bundle episode ids number the ``(dataset, episode)`` pairs in sorted order (``episode_key``), so a
held-out split and the per-episode noise see one id space. Nothing is written under the root; item lengths come
from the latent files' small fields, read memory-mapped once at construction.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flexpack.data import bundle_actions as acts
from flexpack.data import bundle_files as files
from flexpack.data.bundle_grid import compose, grid_of, resolve_layout
from flexpack.data.v21 import Dataset21, Segment21

MISSING = ("error", "skip")


@dataclass(frozen=True)
class BundleItem:
    """One segment of one dataset, with its cameras' latent files (headers read) and layout."""

    dataset: int  # position in BundleDataset.datasets
    episode: int  # the dataset's episode index
    global_episode: int
    seg: Segment21
    heads: tuple[files.SegmentLatent, ...]  # one per camera, in camera order
    layout: str
    ids: acts.FrameIds

    @property
    def frames(self) -> int:
        return self.heads[0].frames


class BundleDataset(torch.utils.data.Dataset):
    def __init__(
        self,
        root: str | os.PathLike,
        *,
        cameras: list[str] | None = None,
        camera_layout: str = "auto",
        action_dim: int = 30,
        action_channels: list[int] | None = None,
        action_steps: int | None = None,
        normalize: bool = True,
        norm_stat: dict[str, list[float]] | None = None,
        action_transform: str = "",
        cfg_prob: float = 0.1,
        seed: int = 0,
        missing: str = "error",
        episodes: list[int] | None = None,
        empty_emb: str | os.PathLike | None = None,
        progress: bool | None = None,
    ) -> None:
        """
        Args:
            root: the bundle's root (or one v2.1 dataset with its latents).
            cameras: camera keys in composition order (default: the first dataset's video features, in order).
            camera_layout: ``"auto"``, ``"width_concat"`` or ``"tshape"`` (``flexpack.data.bundle_grid``).
            action_dim: the model's action space; action_channels: the channel of each action column
                (``used_action_channel_ids``; default 0..D−1); action_steps: the model's steps per latent frame
                (every segment's ``4 × stride`` must equal it; None: not checked).
            norm_stat: ``{"q01": [...], "q99": [...]}`` in the model's action space (upstream's ``norm_stat``);
                None: pooled exact quantiles over every segment's rows of the bundle.
            action_transform: ``""`` or ``"relative_pose:C0,C1,..."`` (``flexpack.data.bundle_actions``).
            cfg_prob: probability an item's text is ``empty_emb.pt``; seed: keys those draws.
            missing: ``"error"``: a segment whose latent file is missing or unreadable is one line naming it;
                ``"skip"``: it is left out and listed in :attr:`skipped`.
            episodes: bundle episode ids to keep (default all).
        """
        self.root = Path(root)
        if missing not in MISSING:
            raise ValueError(f"data.missing = {missing!r}: expected one of {MISSING}")
        if not 0.0 <= cfg_prob <= 1.0:
            raise ValueError(f"data.cfg_prob = {cfg_prob!r}: expected a probability in [0, 1]")
        if not self.root.is_dir():
            raise ValueError(f"{self.root}: no such folder (data.root of a lingbot-bundle)")
        folders = files.find_datasets(self.root)
        if not folders:
            raise ValueError(f"{self.root}: no LeRobot dataset (meta/info.json) under the bundle root")
        self.datasets = [Dataset21.open(f) for f in folders]
        self.names = [str(f.relative_to(self.root)) if f != self.root else f.name for f in folders]
        self.cameras = list(cameras) if cameras else _video_keys(self.datasets[0])
        self.camera_layout, self.action_dim, self.action_steps = camera_layout, action_dim, action_steps
        self.transform = acts.parse_transform(action_transform)
        self.cfg_prob, self.seed, self.epoch, self.missing = float(cfg_prob), int(seed), 0, missing
        self.empty_text = files.empty_embedding(self.root, empty_emb)
        self.episode_key = [(d, e) for d, ds in enumerate(self.datasets) for e in ds.episodes]
        keep = None if episodes is None else set(int(e) for e in episodes)
        if keep is not None and (bad := sorted(keep - set(range(len(self.episode_key))))):
            raise ValueError(f"{self.root}: episodes {bad[:5]} are not in the bundle "
                             f"({len(self.episode_key)} episodes)")
        self.episodes = [g for g in range(len(self.episode_key)) if keep is None or g in keep]
        self.columns = [ds.feature_width("action") for ds in self.datasets]
        self.inverse = [acts.inverse_channels(action_channels if action_channels is not None else range(c),
                                              action_dim, c, str(ds.root / "meta" / "info.json"))
                        for ds, c in zip(self.datasets, self.columns)]
        self.skipped: list[tuple[str, str]] = []  # (where, why)
        every = self._index(progress)  # every episode's: the pooled statistics are the whole bundle's
        self._every = every
        self.items = [it for it in every if keep is None or it.global_episode in keep]
        if not self.items:
            raise ValueError(f"{self.root}: no segment left to train on ({len(self.skipped)} skipped"
                             + (f", {len(every)} outside the episodes asked for)" if keep is not None else ")"))
        check_channels(str(self.root), self.latent_grids)
        self.normalize = normalize
        self.q01, self.q99 = self._stats(norm_stat, every) if normalize else (None, None)

    # ---- construction ----------------------------------------------------------------------------------
    def _index(self, progress: bool | None) -> list[BundleItem]:
        todo = [(g, seg) for g in range(len(self.episode_key)) for seg in self._segments(g)]
        show = sys.stderr.isatty() if progress is None else progress
        bar = _bar(len(todo), f"reading {len(todo)} segment headers of {self.root}") if show else None
        out = []
        for g, seg in todo:
            d, ep = self.episode_key[g]
            where = f"{self.names[d]}: episode {ep} segment {seg.segment} [{seg.start}, {seg.end})"
            try:
                heads = tuple(files.read_header(files.latent_file(self.datasets[d].root, self.datasets[d].chunk_of(ep),
                                                                  cam, ep, seg.start, seg.end)) for cam in self.cameras)
                item = self._item(d, ep, g, seg, heads, where)
            except ValueError as exc:
                if self.missing == "error" or isinstance(exc, files.RefusedFileError):
                    raise ValueError(f"{where}: {exc}") from None
                self.skipped.append((where, str(exc)))
                continue
            finally:
                if bar is not None:
                    bar.update(1)
            out.append(item)
        if bar is not None:
            bar.close()
        return out

    def _segments(self, g: int) -> list[Segment21]:
        d, ep = self.episode_key[g]
        return self.datasets[d].segments(ep)

    def _item(self, d: int, ep: int, g: int, seg: Segment21, heads: tuple[files.SegmentLatent, ...],
              where: str) -> BundleItem:
        frames = {h.frames for h in heads}
        if len(frames) > 1 or len({h.channels for h in heads}) > 1:
            shown = ", ".join(f"{c} {h.frames} frames x {h.channels} channels" for c, h in zip(self.cameras, heads))
            raise ValueError(f"the cameras' latents disagree ({shown})")
        ids = acts.parse_frame_ids(heads[0].frame_ids, str(heads[0].path))
        if ids.latent_frames != heads[0].frames:
            raise ValueError(f"{heads[0].path}: {len(heads[0].frame_ids)} frame_ids make {ids.latent_frames} latent "
                             f"frames, latent_num_frames is {heads[0].frames}")
        if self.action_steps is not None and ids.steps != self.action_steps:
            raise ValueError(f"{heads[0].path}: frame_ids stride {ids.stride} gives {ids.steps} action steps a latent "
                             f"frame, the model takes {self.action_steps} (action_per_frame / data.action_steps)")
        layout = resolve_layout(self.camera_layout, [(h.height, h.width) for h in heads], self.cameras, where)
        return BundleItem(d, ep, g, seg, heads, layout, ids)

    def _rows(self, it: BundleItem) -> np.ndarray:
        ds = self.datasets[it.dataset]
        rows = ds.column(it.episode, "action")
        if rows.shape[0] < it.seg.end:
            raise ValueError(f"{ds.data_file(it.episode)}: episode {it.episode} has {rows.shape[0]} rows, "
                             f"action_config[{it.seg.segment}] ends at frame {it.seg.end}")
        if not np.isfinite(rows[it.seg.start:it.seg.end]).all():
            raise ValueError(f"{ds.data_file(it.episode)}: episode {it.episode} has NaN/Inf actions in "
                             f"[{it.seg.start}, {it.seg.end})")
        return rows[it.seg.start:it.seg.end]

    def _stats(self, norm_stat: dict[str, list[float]] | None,
               every: list[BundleItem]) -> tuple[np.ndarray, np.ndarray]:
        if norm_stat is not None:
            q = [np.asarray(norm_stat.get(k, []), dtype=np.float64).reshape(-1) for k in ("q01", "q99")]
            if any(v.shape != (self.action_dim,) for v in q):
                raise ValueError(f"data.norm_stat: q01 and q99 must each hold {self.action_dim} values (the model's "
                                 f"action space), got {q[0].shape[0]} and {q[1].shape[0]}")
            return q[0], q[1]
        pooled = self.segment_rows(every)
        q01, q99 = np.quantile(pooled, 0.01, axis=0), np.quantile(pooled, 0.99, axis=0)
        return acts.scatter_stats(q01, q99, self.inverse[0])

    def segment_rows(self, every: list[BundleItem] | None = None) -> np.ndarray:
        """Every segment's action rows as its items see them (from the first encoded frame, transformed), over
        the whole bundle: what pooled statistics are computed over, ``(rows, columns)``."""
        if len(set(self.columns)) > 1:
            raise ValueError(f"{self.root}: datasets with {sorted(set(self.columns))} action columns cannot pool one "
                             "statistic; give data.norm_stat (q01/q99 in the model's action space)")
        return np.concatenate([acts.kept_rows(self._rows(it), it.seg.start, it.ids, self.transform, self.where(it))
                               for it in (self._every if every is None else every)])

    @property
    def stride(self) -> int:
        """Video frames per latent frame of the first item's encoding (4 × its frame_ids stride)."""
        return self.items[0].ids.steps

    @property
    def fps(self) -> float:
        return self.datasets[self.items[0].dataset].fps or 30.0

    encoder = "lingbot-bundle"  # pre-extracted Wan2.2 VAE latents; the bundle names no decoder

    @property
    def episode_sources(self) -> tuple[list[str], dict[int, int]] | None:
        """(dataset names, bundle episode id -> dataset) for per-dataset metrics; None for one dataset."""
        if len(self.names) < 2:
            return None
        return list(self.names), {it.global_episode: it.dataset for it in self._every}

    @property
    def channels(self) -> np.ndarray:
        """The model channel of each action "column" of an item: a bundle's items are already in the model's
        action space (scattered at construction), so every channel is its own column."""
        return np.arange(self.action_dim)

    @property
    def normalizer(self) -> Any:
        """The q01/q99 statistics as an :class:`~flexpack.data.actions.ActionNormalizer` over the model's action
        space (what checkpoints record; None without normalization). Setting it keeps a checkpoint's."""
        from flexpack.data.actions import ActionNormalizer

        return None if self.q01 is None else ActionNormalizer("quantile", self.q01, self.q99)

    @normalizer.setter
    def normalizer(self, value: Any) -> None:
        if value is not None and (value.mode != "quantile" or np.shape(value.low) != (self.action_dim,)):
            raise ValueError(f"{self.root}: a bundle normalizes with q01/q99 over the {self.action_dim}-d action "
                             f"space; got {value.mode} statistics of {np.shape(value.low)[0]} values")
        self.q01, self.q99 = (None, None) if value is None else (np.asarray(value.low, dtype=np.float64),
                                                                 np.asarray(value.high, dtype=np.float64))

    # ---- the dataset -----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.items)

    def lengths(self) -> list[int]:
        """Latent frames F of every item (from the latent files' headers, read at construction)."""
        return [it.frames for it in self.items]

    @property
    def latent_grids(self) -> dict[str, list[tuple[int, int, int]]]:
        """Each dataset's composed latent grids ``(C, H, W)`` (usually one), over the items kept: datasets whose
        grids differ in (H, W) pack together on the largest (spatial padding, :mod:`flexpack.packing.grids`)."""
        out: dict[str, list[tuple[int, int, int]]] = {}
        for it in self.items:
            g = (it.heads[0].channels, *self.grid(it))
            if g not in out.setdefault(self.names[it.dataset], []):
                out[self.names[it.dataset]].append(g)
        return out

    def item_grids(self) -> list[tuple[int, int]]:
        """The composed latent grid (H, W) of every item (from the headers read at construction)."""
        return [self.grid(it) for it in self.items]

    def grid(self, it: BundleItem) -> tuple[int, int]:
        return grid_of(it.layout, [(h.height, h.width) for h in it.heads])

    def where(self, it: BundleItem) -> str:
        return f"{self.names[it.dataset]}: episode {it.episode} segment {it.seg.segment} [{it.seg.start}, {it.seg.end})"

    def set_epoch(self, epoch: int) -> None:
        """Key the text-dropout draws of ``epoch`` (the training loop calls it with the sampler's)."""
        self.epoch = int(epoch)

    def drops_text(self, i: int) -> bool:
        """Whether item ``i`` sees the empty text this epoch: a pure function of (seed, epoch, i)."""
        if self.cfg_prob <= 0.0:
            return False
        return bool(np.random.default_rng([self.seed, self.epoch, i, 0x7E47]).random() < self.cfg_prob)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"item {i} out of range for {len(self)} items")
        i %= len(self)
        it = self.items[i]
        try:
            lat_text = [files.latent_fhwc(h.path) for h in it.heads]
            latent = compose([lat for lat, _ in lat_text], it.layout)
            text = files.text_of(lat_text[0][1], it.heads[0].path)
            if not torch.isfinite(latent).all():
                raise ValueError(f"{it.heads[0].path.parent.parent}: the latent has NaN/Inf values")
            action, mask = acts.align(self._rows(it), it.seg.start, it.ids, self.inverse[it.dataset], self.q01,
                                      self.q99, self.transform, str(it.heads[0].path))
        except ValueError as exc:
            raise ValueError(f"{self.where(it)}: {exc}") from None
        if self.drops_text(i):
            text = self.empty_text
        return {
            "latent": latent,
            "action": torch.from_numpy(action),
            "action_mask": torch.from_numpy(mask),
            "text": text,
            "text_len": int(text.shape[0]),
            "episode_index": it.global_episode,
            "task": it.seg.text,
            "length": it.frames,
            "segment": it.seg.segment,
            "frame_range": (it.seg.start, it.seg.end),
            "latent_range": (0, it.frames),
            "dataset": self.names[it.dataset],
            "frame_ids": list(it.heads[0].frame_ids),
        }

    def find(self, dataset: str, episode: int, segment: int) -> int:
        """The item index of ``dataset``'s episode's segment; ValueError naming what exists otherwise."""
        for i, it in enumerate(self.items):
            if self.names[it.dataset] == dataset and it.episode == episode and it.seg.segment == segment:
                return i
        if dataset not in self.names:
            raise ValueError(f"{self.root}: no dataset {dataset!r} (datasets {self.names[:8]})")
        raise ValueError(f"{self.root}: dataset {dataset!r} has no item for episode {episode} segment {segment}")


def check_channels(where: str, grids: dict[str, list[tuple[int, int, int]]]) -> None:
    """One line naming the datasets and their (C, H, W) where their latents' channel counts differ: those cannot
    share a batch (grids of one C but different (H, W) can: spatial padding)."""
    if len({c for gs in grids.values() for c, _, _ in gs}) > 1:
        shown = ", ".join(f"{name} {g}" for name, gs in grids.items() for g in gs)
        raise ValueError(f"{where}: the datasets' latents have different channel counts ((C, H, W): {shown}); one "
                         "run's batches hold one C: train them in separate runs")


def _video_keys(ds: Dataset21) -> list[str]:
    keys = [k for k, f in ds.info.get("features", {}).items() if f.get("dtype") == "video"]
    if not keys:
        raise ValueError(f"{ds.root / 'meta' / 'info.json'}: no video features; set data.cameras to the camera keys "
                         "under latents/chunk-XXX/")
    return keys


def _bar(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="seg", file=sys.stderr, leave=False)
