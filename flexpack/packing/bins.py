"""Bin packing of whole episodes into fixed-capacity micro-batches.

The token-budget sampler calls :func:`pack_bins` once per epoch. Sizes are integers in one unit
(latent frames); ``capacity`` is the micro-batch's frame budget.

Algorithm (minimum-bin-slack, bin at a time): open a bin, put the largest remaining item in it,
then fill the rest of the bin with the subset of the remaining items whose total comes closest to
the capacity (exact subset sum over a Python-int bitset, one shift-or per item, stopping as soon
as the bin is exactly full). Candidates are tried largest first, so large items are placed while
many small ones remain to fill the gaps; the small ones left for the last bins are the easiest to
pack tightly. Where that misses the lower bound ``ceil(sum / capacity)``, plain
best-fit-decreasing is tried too and the fewer bins win, so the result is never worse than BFD.
On the 1,280 reference episodes this reaches the lower bound (0.4 % waste) where BFD needs two
bins more (1.8 %), in ~20 ms.

Equal counts per rank: when the bin count is not a multiple of ``multiple`` (the world size), the
missing bins are filled with *repeated* items (tail padding, as ``DistributedSampler`` repeats
indices), chosen in seeded random order among items not yet repeated this epoch and packed as
tightly as the originals. Every item appears in exactly one bin; repeats appear once more.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def lower_bound_bins(sizes: Sequence[int], capacity: int) -> int:
    """The fewest bins any packing can use: ``ceil(sum(sizes) / capacity)``."""
    return -(-int(sum(sizes)) // capacity)


def _best_subset(cands: Sequence[int], sizes: Sequence[int], room: int) -> list[int]:
    """Subset of ``cands`` (item ids) with the largest total ``<= room``; earlier ids preferred."""
    if room <= 0 or not cands:
        return []
    if sum(sizes[i] for i in cands) <= room:  # everything fits; also spares a huge bitset
        return list(cands)
    full = (1 << (room + 1)) - 1
    reach = 1  # bit s set <=> total s is reachable with the items seen so far
    history: list[int] = []
    for i in cands:
        history.append(reach)
        reach = (reach | (reach << sizes[i])) & full
        if reach >> room & 1:  # exactly full: no better subset exists
            break
    s = reach.bit_length() - 1
    chosen: list[int] = []
    for k in range(len(history) - 1, -1, -1):
        if not history[k] >> s & 1:  # total s needs item k
            chosen.append(cands[k])
            s -= sizes[cands[k]]
    assert s == 0, "subset-sum backtrack lost its way"  # internal invariant
    return chosen


def pack_bins(
    sizes: Sequence[int],
    capacity: int,
    *,
    multiple: int = 1,
    rng: np.random.Generator,
    jitter: float = 0.05,
) -> list[list[int]]:
    """Pack items ``0..len(sizes)-1`` into bins of total size ``<= capacity``.

    Returns a list of bins (lists of item ids); its length is a multiple of ``multiple``. Every
    item is in exactly one bin, except the tail-padding repeats described in the module docstring.

    ``rng`` makes the packing differ between epochs without losing tightness: items are ordered by
    ``size * (1 + u)`` with ``u ~ U(0, jitter)`` (ties and near-ties change places), so the same
    ``rng`` state gives the same bins. Every size must be in ``1..capacity``.
    """
    n = len(sizes)
    if n == 0:
        raise ValueError("pack_bins needs at least one item")
    if capacity <= 0 or multiple <= 0:
        raise ValueError(f"capacity and multiple must be > 0, got {capacity} and {multiple}")
    sizes = [int(s) for s in sizes]
    bad = next((i for i, s in enumerate(sizes) if not 1 <= s <= capacity), None)
    if bad is not None:
        raise ValueError(f"item {bad} has size {sizes[bad]}, expected 1..{capacity}")

    key = np.asarray(sizes, dtype=np.float64) * (1.0 + jitter * rng.random(n))
    order = [int(i) for i in np.argsort(-key, kind="stable")]  # largest first
    bins = _min_bin_slack(order, sizes, capacity)
    if len(bins) > lower_bound_bins(sizes, capacity):
        bfd = best_fit_decreasing(sizes, capacity)
        if len(bfd) < len(bins):  # rare (items near the capacity); keeps "BFD or better" true
            bins = bfd

    # Tail padding: extra bins of repeated items so len(bins) % multiple == 0.
    not_repeated: list[int] = []
    for _ in range(-len(bins) % multiple):
        if not not_repeated:
            not_repeated = [int(i) for i in rng.permutation(n)]
        chosen = _best_subset(not_repeated, sizes, capacity)
        bins.append(chosen)
        taken = set(chosen)
        not_repeated = [i for i in not_repeated if i not in taken]
    return bins


def _min_bin_slack(order: list[int], sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """One bin at a time: the largest remaining item plus the best-filling subset of the rest."""
    bins: list[list[int]] = []
    remaining = order
    while remaining:
        first, rest = remaining[0], remaining[1:]
        chosen = [first, *_best_subset(rest, sizes, capacity - sizes[first])]
        bins.append(chosen)
        taken = set(chosen)
        remaining = [i for i in rest if i not in taken]
    return bins


def _best_fit(order: list[int], sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Best fit in the given order: each item goes to the fullest bin it fits in."""
    loads: list[int] = []
    bins: list[list[int]] = []
    for i in order:
        fits = [b for b, load in enumerate(loads) if load + sizes[i] <= capacity]
        if fits:
            b = max(fits, key=lambda b: loads[b])
        else:
            b = len(bins)
            loads.append(0)
            bins.append([])
        loads[b] += sizes[i]
        bins[b].append(i)
    return bins


def best_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Plain best-fit-decreasing, the baseline that tests and benchmarks compare with."""
    return _best_fit(sorted(range(len(sizes)), key=lambda i: -sizes[i]), sizes, capacity)
