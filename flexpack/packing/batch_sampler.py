"""Batch samplers over variable-length episodes, for pad mode and pack mode.

Both samplers take ``lengths`` (latent frames F per episode, read from metadata, no latents
loaded) and yield, for this rank, one list of dataset indices per micro-batch; use them as a
``DataLoader``'s ``batch_sampler`` with the matching collate:

- :class:`LengthBucketBatchSampler` + pad collate: rows padded to ``round_up(max F, pad_multiple)``.
- :class:`TokenBudgetBatchSampler` + pack collate: whole episodes concatenated up to a fixed frame
  budget ``max_tokens // tokens_per_frame`` (one shape).

Invariants shared by both:

- The batches of an epoch are a pure function of (arguments, epoch): every rank computes the plan
  of all ranks from ``numpy.random.default_rng(seed + epoch)`` and takes its own share, so ranks
  agree without communicating, and a different epoch gives a different order.
- Every rank yields the same number of batches per epoch (FSDP steps stay in lockstep). To get
  there a few indices are repeated (tail padding, see each class); none is skipped unless
  ``drop_last=True``.
- ``state_dict()`` after k batches of the current epoch, loaded into a fresh sampler built with
  the same arguments (any rank: the state is the same on every rank), yields exactly the
  remaining batches. ``load_state_dict`` raises ``ValueError`` if the arguments differ.
- Elastic resume: a state loaded into a sampler of another ``world_size`` (same other arguments)
  continues the same epoch. The indices every old rank consumed are recomputed from the old plan
  (``consumed`` in the state), and the rest of the epoch is planned afresh over the new ranks
  from the same ``rng(seed + epoch)``, so across old and new ranks every index of the epoch is
  trained once (plus the new plan's own tail padding). The next epoch is a full plan again. A
  sampler whose epoch is not "every index once" says what is left through ``_remaining`` and
  ``_trained`` (the weighted mixture's: multisets, :mod:`flexpack.packing.weighted`).

Misuse to avoid:

- Forgetting ``set_epoch(e)`` before each epoch repeats epoch 0's order forever.
- Wrapping with ``DataLoader(num_workers>0)`` prefetches batches: the sampler's own position then
  runs ahead of training. Save ``state_dict(position=batches_trained)`` instead.
- One live iterator at a time: two iterators share (and advance) one position.
- Lengths must be latent frames, not video frames (see ``flexpack.packing.lengths.latent_frames``).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import operator
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flexpack.packing.bins import pack_bins
from flexpack.packing.geometry import frame_budget, too_long

COST_HIDDEN_SIZE = 3072  # model width d behind the attention weight of batch_cost (Wan-5B class)


def batch_cost(token_lengths: Sequence[int], computed_tokens: int, hidden_size: int = COST_HIDDEN_SIZE) -> float:
    """Relative compute of one micro-batch: ``computed_tokens + sum(L_i**2) / (6 * hidden_size)``.

    ``computed_tokens`` counts every token the model processes, pad included (linear layers do
    not skip pads); ``L_i`` are the valid tokens of each episode, whose attention is block-sparse
    under the document mask, so pads cost no attention. Per layer a token costs ~24 d^2 FLOPs in
    the linear layers and an attended query-key pair ~4 d FLOPs, hence the weight 1 / (6 d).
    """
    return computed_tokens + sum(int(n) * int(n) for n in token_lengths) / (6.0 * hidden_size)


@dataclass(frozen=True)
class SamplerStats:
    """One epoch of all ranks' micro-batches. Lists are step-major: step 0 rank 0, rank 1, ...

    ``waste`` = pad tokens / computed tokens, counting repeated (tail-padding) episodes as used
    tokens, since they are trained on; ``waste_incl_repeats`` counts them as waste instead.
    ``rank_imbalance`` = mean over steps of max-rank cost / mean-rank cost (:func:`batch_cost`);
    1.0 is perfect.
    """

    waste: float
    waste_incl_repeats: float
    distinct_shapes: int
    shapes: list[tuple[int, int]]  # distinct (rows, frames per row) of the collated batches
    micro_batches: int  # over all ranks
    batches_per_rank: int
    samples: int  # index entries over all ranks, repeats included
    unique_samples: int
    repeated_samples: int  # tail padding
    dropped_samples: int  # drop_last
    rank_imbalance: float
    tokens_used: int
    tokens_computed: int
    padded_frames: list[int]  # frames per row of each micro-batch
    fill: list[float]  # used / computed tokens of each micro-batch

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _int(name: str, value: Any, minimum: int) -> int:
    try:
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def _lengths(lengths: Sequence[int]) -> tuple[int, ...]:
    if len(lengths) == 0:
        raise ValueError("lengths is empty: need at least one episode")
    out = []
    for i, f in enumerate(lengths):
        try:
            v = operator.index(f)
        except TypeError:
            raise ValueError(f"lengths[{i}] = {f!r}: expected an integer number of latent frames") from None
        if v <= 0:
            raise ValueError(f"lengths[{i}] = {v}: episode {i} must have at least 1 latent frame")
        out.append(v)
    return tuple(out)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class _EpochBatchSampler:
    """Epoch/position bookkeeping, resumable state and statistics shared by both samplers.

    Subclasses implement ``_make_plan(epoch) -> [rank][step] -> indices`` (all ranks, equal
    lengths), ``padded_frames(batch)``, ``_shape(batch) -> (rows, frames per row)`` and extend
    ``_args()`` with every argument that changes the order.
    """

    tokens_per_frame: int

    def __init__(self, lengths: Sequence[int], rank: int, world_size: int, seed: int) -> None:
        self.lengths = _lengths(lengths)
        self.world_size = _int("world_size", world_size, 1)
        self.rank = _int("rank", rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank must be < world_size={self.world_size}, got {self.rank}")
        self.seed = _int("seed", seed, 0)
        self.effective_lengths = self.lengths
        self._epoch = 0
        self._position = 0  # batches of the current epoch already yielded on this rank
        self._consumed: tuple[int, ...] = ()  # indices of this epoch trained before the current plan (elastic resume)
        self._cache: tuple[int, tuple[int, ...], list[list[list[int]]]] | None = None

    # --- to implement ------------------------------------------------------------------
    def _make_plan(self, epoch: int, indices: np.ndarray) -> list[list[list[int]]]:
        """All ranks' batches of ``epoch`` over ``indices`` (every index, or the rest of an epoch)."""
        raise NotImplementedError

    def padded_frames(self, batch: Sequence[int]) -> int:
        """Frames per row of the collated tensor for this batch."""
        raise NotImplementedError

    def _shape(self, batch: Sequence[int]) -> tuple[int, int]:
        raise NotImplementedError

    def _args(self) -> dict[str, Any]:
        digest = hashlib.sha256(np.asarray(self.lengths, dtype=np.int64).tobytes()).hexdigest()[:16]
        return {"world_size": self.world_size, "seed": self.seed, "num_episodes": len(self.lengths),
                "lengths_sha256": digest}

    # --- epoch plan --------------------------------------------------------------------
    def _plan(self, epoch: int | None = None, consumed: tuple[int, ...] | None = None) -> list[list[list[int]]]:
        epoch = self._epoch if epoch is None else epoch
        consumed = (self._consumed if epoch == self._epoch else ()) if consumed is None else consumed
        if self._cache is None or self._cache[:2] != (epoch, consumed):
            plan = self._make_plan(epoch, self._remaining(epoch, consumed))
            assert len({len(p) for p in plan}) == 1, "ranks got different batch counts"
            self._cache = (epoch, consumed, plan)
        return self._cache[2]

    def _remaining(self, epoch: int, consumed: tuple[int, ...]) -> np.ndarray:
        """The indices ``epoch`` still has to train once ``consumed`` were trained: every index not in it."""
        indices = np.arange(len(self.lengths))
        return np.setdiff1d(indices, np.asarray(consumed, dtype=np.int64)) if consumed else indices

    def _trained(self, consumed: tuple[int, ...], batches: list[list[int]]) -> tuple[int, ...]:
        """``consumed`` and the indices of ``batches`` together, as a state's ``consumed`` records them (a set)."""
        return tuple(sorted(set(consumed).union(*batches)))

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order ``__iter__`` yields. A new epoch restarts at batch 0;
        setting the current epoch again keeps the position (so a resumed loop may call it)."""
        epoch = _int("epoch", epoch, 0)
        if epoch != self._epoch:
            self._epoch, self._position, self._consumed = epoch, 0, ()

    def max_batch_size(self, epoch: int | None = None) -> int:
        """Most samples in one of this rank's batches of ``epoch`` (default: the current one)."""
        return max((len(b) for b in self._plan(epoch)[self.rank]), default=0)

    def most_per_batch(self) -> int:
        """Most samples any batch of any epoch, rank or resumed plan can hold (a bound from the
        arguments alone, >= every ``max_batch_size``): what a run sizes per-episode shapes by so
        that no later epoch needs a larger one."""
        raise NotImplementedError

    def __len__(self) -> int:
        """Batches this rank yields in the current epoch (the same on every rank)."""
        return len(self._plan()[self.rank])

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._plan()[self.rank]
        while self._position < len(batches):
            batch = batches[self._position]
            self._position += 1  # before yielding: a state taken now excludes this batch
            yield list(batch)
        self._position = 0  # exhausted: a new iteration replays this epoch unless set_epoch

    # --- resumable state ---------------------------------------------------------------
    def state_dict(self, position: int | None = None) -> dict[str, Any]:
        """Epoch, batches consumed in it, and the arguments that fixed the order.

        ``position`` overrides the count of batches drawn from this sampler, for callers whose
        loader prefetches (count the batches actually trained on)."""
        pos = self._position if position is None else _int("position", position, 0)
        state = {"sampler": type(self).__name__, "epoch": self._epoch, "position": pos, "args": self._args()}
        if self._consumed:
            state["consumed"] = list(self._consumed)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly after the batches counted in ``state`` (see ``state_dict``)."""
        if not isinstance(state, dict) or not {"sampler", "epoch", "position", "args"} <= state.keys():
            raise ValueError(f"not a sampler state: {state!r}")
        if state["sampler"] != type(self).__name__:
            raise ValueError(f"state is from {state['sampler']}, not {type(self).__name__}")
        mine = self._args()
        diff = {k: (v, mine.get(k)) for k, v in state["args"].items() if mine.get(k) != v and k != "world_size"}
        diff.update({k: (None, v) for k, v in mine.items() if k not in state["args"]})
        if diff:
            detail = ", ".join(f"{k}: state {a!r} vs sampler {b!r}" for k, (a, b) in sorted(diff.items()))
            raise ValueError(f"state does not match this sampler's arguments ({detail})")
        epoch = _int("state epoch", state["epoch"], 0)
        position = _int("state position", state["position"], 0)
        consumed = tuple(sorted(_int("state consumed", i, 0) for i in state.get("consumed", ())))
        if any(i >= len(self.lengths) for i in consumed):
            raise ValueError(f"state consumed indices beyond the {len(self.lengths)} episodes")
        old_world = _int("state world_size", state["args"].get("world_size", self.world_size), 1)
        if old_world != self.world_size:
            consumed, position = self._reshard(epoch, consumed, position, old_world), 0
            if not len(self._remaining(epoch, consumed)):  # the old ranks finished the epoch: the next one is whole
                epoch, consumed = epoch + 1, ()
        count = len(self._plan(epoch, consumed)[self.rank])
        if position > count:
            raise ValueError(f"state position {position} > {count} batches in epoch {epoch}")
        self._epoch, self._position, self._consumed = epoch, position, consumed

    def _reshard(self, epoch: int, consumed: tuple[int, ...], position: int, old_world: int) -> tuple[int, ...]:
        """Indices of ``epoch`` trained by ``old_world`` ranks: ``consumed`` plus the first
        ``position`` batches of every old rank in the plan they followed."""
        old = copy.copy(self)
        old.world_size, old.rank, old._cache = old_world, 0, None
        plan = old._plan(epoch, consumed)
        if position > len(plan[0]):
            raise ValueError(f"state position {position} > {len(plan[0])} batches in epoch {epoch}")
        return self._trained(consumed, [b for rank in plan for b in rank[:position]])

    # --- statistics --------------------------------------------------------------------
    def stats(self, progress: bool = False) -> SamplerStats:
        """Waste, shapes and rank balance of the current epoch over all ranks' batches."""
        plan = self._plan()
        tpf, steps = self.tokens_per_frame, len(plan[0])
        eff = self.effective_lengths
        seen: set[int] = set()
        counts: Counter[int] = Counter()
        used = used_first = computed = 0
        shapes: set[tuple[int, int]] = set()
        padded, fill, ratios = [], [], []
        step_iter: Any = range(steps)
        if progress:
            from tqdm import tqdm

            step_iter = tqdm(step_iter, desc="stats", unit="step", disable=None)
        for s in step_iter:
            costs = []
            for r in range(self.world_size):
                batch = plan[r][s]
                rows, frames = self._shape(batch)
                c_tok = rows * frames * tpf
                toks = [eff[i] * tpf for i in batch]
                counts.update(batch)
                used_first += sum(t for i, t in zip(batch, toks) if i not in seen)
                seen.update(batch)
                used, computed = used + sum(toks), computed + c_tok
                shapes.add((rows, frames))
                padded.append(frames)
                fill.append(sum(toks) / c_tok)
                costs.append(batch_cost(toks, c_tok))
            ratios.append(max(1.0, max(costs) * len(costs) / sum(costs)))  # max >= mean; no rounding below 1
        samples = sum(counts.values())
        return SamplerStats(
            waste=1.0 - used / computed, waste_incl_repeats=1.0 - used_first / computed,
            distinct_shapes=len(shapes), shapes=sorted(shapes),
            micro_batches=steps * self.world_size, batches_per_rank=steps,
            samples=samples, unique_samples=len(counts), repeated_samples=samples - len(counts),
            dropped_samples=len(self.lengths) - len(counts),
            rank_imbalance=float(np.mean(ratios)), tokens_used=used, tokens_computed=computed,
            padded_frames=padded, fill=fill,
        )


class LengthBucketBatchSampler(_EpochBatchSampler):
    """Pad mode: batches of ``batch_size`` episodes of similar length, padded to few shapes.

    Order of epoch e, from ``rng = numpy.random.default_rng(seed + e)``:

    1. ``perm = rng.permutation(n)``.
    2. Tail padding (``drop_last=False``): ``perm`` is extended cyclically from its start to
       ``ceil(n / world_size) * world_size`` entries, so the first ``-n % world_size`` indices of
       the shuffle appear twice. With ``drop_last=True`` it is cut to ``n // world_size *
       world_size`` instead and every rank's incomplete last batch is dropped.
    3. Rank r takes ``perm[r::world_size]`` (round robin).
    4. Each run of ``batch_size * pool_factor`` of its indices (a pool) is sorted by length
       (stable) and cut into batches of ``batch_size``; only the last batch of the last pool can
       be smaller.
    5. Batches are reordered by ``rng.permutation(batches_per_rank)``, the same permutation on
       every rank, so at one step all ranks hold batches from the same place in their pools.

    Each batch is collated to ``padded_frames(batch) = round_up(max F, pad_multiple)`` frames.
    ``tokens_per_frame`` only scales ``stats()`` (costs and token counts).
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        pool_factor: int = 50,
        pad_multiple: int = 8,
        drop_last: bool = False,
        tokens_per_frame: int = 1,
    ) -> None:
        super().__init__(lengths, rank, world_size, seed)
        self.batch_size = _int("batch_size", batch_size, 1)
        self.pool_factor = _int("pool_factor", pool_factor, 1)
        self.pad_multiple = _int("pad_multiple", pad_multiple, 1)
        self.tokens_per_frame = _int("tokens_per_frame", tokens_per_frame, 1)
        self.drop_last = bool(drop_last)
        n = len(self.lengths)
        if self.drop_last and n // self.world_size < self.batch_size:
            raise ValueError(
                f"drop_last=True leaves no batch: {n} episodes over world_size={self.world_size} "
                f"give {n // self.world_size} per rank < batch_size={self.batch_size}"
            )

    def _args(self) -> dict[str, Any]:
        return {**super()._args(), "batch_size": self.batch_size, "pool_factor": self.pool_factor,
                "pad_multiple": self.pad_multiple, "drop_last": self.drop_last}

    def padded_frames(self, batch: Sequence[int]) -> int:
        return _round_up(max(self.lengths[i] for i in batch), self.pad_multiple)

    def most_per_batch(self) -> int:
        return min(self.batch_size, len(self.lengths))

    def _shape(self, batch: Sequence[int]) -> tuple[int, int]:
        return len(batch), self.padded_frames(batch)

    def _make_plan(self, epoch: int, indices: np.ndarray) -> list[list[list[int]]]:
        rng = np.random.default_rng(self.seed + epoch)
        n, w, b = len(indices), self.world_size, self.batch_size
        perm = indices[rng.permutation(n)]
        total = n // w * w if self.drop_last else -(-n // w) * w
        perm = np.resize(perm, total)  # np.resize repeats from the start: the tail padding
        lengths = np.asarray(self.lengths)
        pool = b * self.pool_factor
        plan = []
        for r in range(w):
            mine = perm[r::w]
            batches = []
            for start in range(0, len(mine), pool):
                chunk = mine[start : start + pool]
                chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
                batches += [[int(i) for i in chunk[k : k + b]] for k in range(0, len(chunk), b)]
            if self.drop_last:
                batches = [x for x in batches if len(x) == b]
            plan.append(batches)
        order = rng.permutation(len(plan[0]))
        return [[batches[k] for k in order] for batches in plan]


class TokenBudgetBatchSampler(_EpochBatchSampler):
    """Pack mode: whole episodes packed into micro-batches of at most ``max_tokens`` tokens.

    An episode costs ``F * tokens_per_frame`` tokens; the pack collate concatenates a micro-batch
    along the frame axis into ``budget_frames = max_tokens // tokens_per_frame`` frames (one shape
    for the whole run). Epoch e, from ``rng = numpy.random.default_rng(seed + e)``:

    1. Packing (:func:`flexpack.packing.bins.pack_bins`): minimum-bin-slack with a seeded jitter of the
       size order, never worse than best-fit-decreasing; on the reference lengths it reaches the
       lower bound. The bin count is rounded up to a multiple of ``world_size`` with bins of
       repeated episodes (the tail padding; ``stats().repeated_samples`` counts them).
    2. Step assignment: bins sorted by :func:`batch_cost` are grouped ``world_size`` consecutive
       bins to a step, so the ranks of one step do similar work; each step deals its bins to
       ranks in a random order, and the step order is shuffled.

    An episode longer than the budget raises ``ValueError`` naming it. With ``crop=True`` it is
    cropped instead: ``effective_lengths[i]`` (= ``min(lengths[i], budget_frames)``) is what the
    sampler packed, and the collate must keep only the first ``effective_lengths[i]`` frames
    (``PackCollate(budget_frames, crop=True)`` does so for a micro-batch holding it alone, which
    is always the case since a cropped episode fills its micro-batch).
    """

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        *,
        tokens_per_frame: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        crop: bool = False,
    ) -> None:
        super().__init__(lengths, rank, world_size, seed)
        self.max_tokens = _int("max_tokens", max_tokens, 1)
        self.tokens_per_frame = _int("tokens_per_frame", tokens_per_frame, 1)
        self.budget_frames = frame_budget(self.max_tokens, self.tokens_per_frame)
        self.crop = bool(crop)
        over = too_long(self.lengths, self.budget_frames)
        if over and not self.crop:
            i = over[0]
            raise ValueError(
                f"episode {i} has {self.lengths[i]} latent frames = {self.lengths[i] * self.tokens_per_frame} "
                f"tokens > max_tokens={self.max_tokens} ({len(over)} episode(s) too long); "
                "raise max_tokens, drop the episode, or pass crop=True"
            )
        self.effective_lengths = tuple(min(f, self.budget_frames) for f in self.lengths)

    def _args(self) -> dict[str, Any]:
        return {**super()._args(), "max_tokens": self.max_tokens,
                "tokens_per_frame": self.tokens_per_frame, "crop": self.crop}

    def padded_frames(self, batch: Sequence[int]) -> int:
        return self.budget_frames

    def most_per_batch(self) -> int:
        """The most episodes whose (effective) lengths fit one budget together: the shortest ones. A pack
        never holds an episode twice (tail-padding bins repeat episodes of other packs), so no pack of
        any epoch holds more."""
        used = count = 0
        for n in sorted(self.effective_lengths):
            if used + n > self.budget_frames:
                break
            used, count = used + n, count + 1
        return count

    def _shape(self, batch: Sequence[int]) -> tuple[int, int]:
        return 1, self.budget_frames

    def _make_plan(self, epoch: int, indices: np.ndarray) -> list[list[list[int]]]:
        rng = np.random.default_rng(self.seed + epoch)
        w, tpf = self.world_size, self.tokens_per_frame
        bins = pack_bins([self.effective_lengths[i] for i in indices], self.budget_frames, multiple=w, rng=rng)
        bins = [[int(indices[k]) for k in b] for b in bins]  # positions in ``indices`` -> dataset indices
        computed = self.budget_frames * tpf
        cost = [batch_cost([self.effective_lengths[i] * tpf for i in b], computed) for b in bins]
        by_cost = sorted(range(len(bins)), key=lambda k: (cost[k], k))
        steps = [by_cost[s : s + w] for s in range(0, len(bins), w)]
        plan: list[list[list[int]]] = [[] for _ in range(w)]
        for s in rng.permutation(len(steps)):
            for r, k in enumerate(rng.permutation(steps[s])):
                plan[r].append(bins[k])
        return plan
