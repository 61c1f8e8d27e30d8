"""Block masks built by the segment algorithm (:mod:`flexpack.attention.segments`), compiled once per shape
signature and replayed as CUDA graphs: :class:`BlockMaskBuilder` and the eager :func:`fast_block_mask`.

A compiled build is ``torch.compile(dynamic=False)`` of the structure computation with its own dynamo cache
per signature (:func:`compile_fresh`); on CUDA each compiled signature is recorded as a CUDA graph on its
first build and replayed afterwards (:class:`_CapturedBuild`): a build is then a copy in, one replay and a
copy out instead of ~20 small launches.
"""

from __future__ import annotations

import types
import warnings
from typing import Callable

import torch
from torch import Tensor
from torch._dynamo.exc import BackendCompilerFailed
from torch._inductor.exc import InductorError
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from .segments import BLOCK, MAX_SEGMENTS, _structure, num_segments, range_mask_mod


def compile_fresh(fn: Callable, tag: str, backend: str | Callable = "inductor") -> Callable:
    """``torch.compile(dynamic=False)`` of a private copy of ``fn``.

    Dynamo keeps one cache per code object with a limit of 8 entries, after which it silently
    falls back to eager (for FlexAttention: a very slow reference path). Pad mode has tens of
    shapes, so every shape signature gets its own code object and therefore its own cache.
    """
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    return torch.compile(copy, dynamic=False, backend=backend)


def _closure_split(fn: Callable) -> tuple[list[Tensor], tuple] | None:
    """(tensors, other values) of ``fn``'s closure, in cell order; ``None`` if a cell holds anything
    but tensors and plain scalars (e.g. other mask_mods), which a captured graph could not re-bind."""
    tensors, scalars = [], []
    for cell in fn.__closure__ or ():
        v = cell.cell_contents
        if isinstance(v, Tensor):
            tensors.append(v)
        elif isinstance(v, (int, float, bool, str, type(None))):
            scalars.append(v)
        else:
            return None
    return tensors, tuple(scalars)


def _graph_inputs(
    mask_mod: Callable, q_keys: tuple[Tensor, ...], kv_keys: tuple[Tensor, ...]
) -> tuple[list[Tensor], tuple[int, ...], tuple] | None:
    """The distinct tensors a build reads (closure, q and kv keys), the pattern that maps the
    positions of ``closure + q_keys + kv_keys`` onto them (the same tensor often plays several
    roles), and the closure's scalar values; ``None`` when the closure cannot be re-bound."""
    split = _closure_split(mask_mod)
    if split is None:
        return None
    unique: list[Tensor] = []
    pattern = []
    for t in (*split[0], *q_keys, *kv_keys):
        i = next((j for j, u in enumerate(unique) if u is t), None)
        if i is None:
            i = len(unique)
            unique.append(t)
        pattern.append(i)
    return unique, tuple(pattern), split[1]


def _rebind(fn: Callable, tensors: list[Tensor]) -> Callable:
    """A copy of ``fn`` whose closure tensors are ``tensors`` (in cell order), scalars kept."""
    it = iter(tensors)
    cells = tuple(types.CellType(next(it) if isinstance(c.cell_contents, Tensor) else c.cell_contents)
                  for c in fn.__closure__ or ())
    return types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)


class _CapturedBuild:
    """One compiled build signature recorded as a CUDA graph and replayed.

    The compiled build is ~20 small kernels; launched from Python they cost more host time than
    the GPU needs to run them. Here the mask's tensors are copied into static buffers, the graph
    is replayed (one launch) and its outputs are copied out into fresh tensors (one foreach op),
    so that a BlockMask never aliases the graph's memory: an earlier BlockMask stays valid after
    the next build. The graph bakes in the mask's non-tensor closure values (e.g. a window), so
    those are part of the builder's key.
    """

    def __init__(
        self, fn: Callable, mask_mod: Callable, args: tuple, unique: list[Tensor], pattern: tuple[int, ...]
    ) -> None:
        q_keys, kv_keys, *rest = args
        self.pattern = pattern
        self.static = [t.clone() for t in unique]
        nq, nkv = len(q_keys), len(kv_keys)
        ncl = len(pattern) - nq - nkv
        slot = [self.static[i] for i in pattern]
        static_args = (_rebind(mask_mod, slot[:ncl]), tuple(slot[ncl:ncl + nq]), tuple(slot[ncl + nq:]), *rest)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture (allocator, lazy init)
            fn(*static_args)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.outs = list(fn(*static_args))

    def fits(self, unique: list[Tensor], pattern: tuple[int, ...]) -> bool:
        """Whether these distinct input tensors fit the static buffers."""
        return pattern == self.pattern and all(
            t.shape == s.shape and t.dtype == s.dtype and t.device == s.device for t, s in zip(unique, self.static)
        )

    def __call__(self, inputs: list[Tensor]) -> tuple[Tensor, ...]:
        torch._foreach_copy_(self.static, inputs)
        self.graph.replay()
        return tuple(torch._foreach_add(self.outs, 0))  # fresh copies (int32 + 0 is exact)


class BlockMaskBuilder:
    """Builds block masks from mask_mods of :mod:`flexpack.attention.masks`; optionally compiled (CUDA).

    ``compile=True`` wraps the structure computation in ``torch.compile(dynamic=False)``: one
    compilation per (mask code, q_len, kv_len, segment bounds) signature, each with its own
    dynamo cache (:func:`compile_fresh`), none when only the layout's contents change (closures
    are compared by code, their tensors are graph inputs).

    ``range_mods=True`` (default) gives the BlockMask, for masks with a ``runs`` bound, a
    :func:`range_mask_mod` with the same values as the mask (the kernels evaluate it inside
    partial blocks); ``False`` keeps the mask's own mask_mod there.

    ``cuda_graphs`` (default: on with ``compile`` on CUDA) records each compiled signature as a
    CUDA graph on its first build and replays it afterwards (:class:`_CapturedBuild`): a build
    is then a copy in, one replay and a copy out instead of ~20 launches. Each graph keeps its
    working memory (segment grid and block tables) allocated, one per signature: pad mode with
    many shapes holds many. Masks whose closure holds other mask_mods (``all_of``, the "valid"
    mask) are not captured and run the compiled build.
    """

    def __init__(
        self,
        compile: bool = False,
        compile_backend: str | Callable = "inductor",
        range_mods: bool = True,
        cuda_graphs: bool | None = None,
    ) -> None:
        self.compile = compile
        self.range_mods = range_mods
        self.cuda_graphs = compile if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and not compile:
            raise ValueError("cuda_graphs=True needs compile=True (the graph records the compiled build)")
        self._backend = compile_backend
        self._compiled: dict[tuple, Callable] = {}
        self._graphs: dict[tuple, _CapturedBuild | None] = {}

    def _fn(self, mask_mod: Callable, *args) -> tuple[Tensor, ...]:
        if not self.compile:
            return _structure(mask_mod, *args)
        key = (getattr(mask_mod, "__code__", None), *args[2:])
        if key not in self._compiled:
            self._compiled[key] = compile_fresh(_structure, f"s{len(self._compiled)}", self._backend)
        inputs = _graph_inputs(mask_mod, args[0], args[1]) if self.cuda_graphs and args[0][0].is_cuda else None
        if inputs is not None:
            unique, pattern, scalars = inputs
            graph = self._graph((*key, scalars, args[0][0].device), key, mask_mod, args, unique, pattern)
            if graph is not None and graph.fits(unique, pattern):
                return graph(unique)
        return self._run_compiled(key, mask_mod, args)

    def _run_compiled(self, key: tuple, mask_mod: Callable, args: tuple) -> tuple[Tensor, ...]:
        try:
            return self._compiled[key](mask_mod, *args)
        except (BackendCompilerFailed, InductorError) as e:
            # Seen on the H200 (torch 2.11): inductor codegen fails for the teacher-forcing
            # structure at some segment counts. The eager build gives the same block mask.
            msg = " ".join(str(e).split())[:400]
            warnings.warn(f"compiling the block-mask builder failed ({type(e).__name__}: {msg}); "
                          "building eagerly for this shape")
            self._compiled[key] = _structure
            return _structure(mask_mod, *args)

    def _graph(
        self, gkey: tuple, key: tuple, mask_mod: Callable, args: tuple, unique: list[Tensor], pattern: tuple[int, ...]
    ) -> _CapturedBuild | None:
        """The CUDA graph of ``gkey`` (compile key, closure scalars, device), captured on first use;
        ``None`` after an eager fallback or a failed capture."""
        if gkey not in self._graphs:
            self._run_compiled(key, mask_mod, args)  # compiles a new signature outside the capture
            graph = None
            if self._compiled[key] is not _structure:
                try:
                    graph = _CapturedBuild(self._compiled[key], mask_mod, args, unique, pattern)
                except RuntimeError as e:
                    msg = " ".join(str(e).split())[:300]
                    warnings.warn(f"capturing the block-mask build as a CUDA graph failed ({msg}); "
                                  "launching the compiled build instead")
            self._graphs[gkey] = graph
        return self._graphs[gkey]

    def __call__(
        self,
        mask_mod: Callable,
        q_len: int,
        kv_len: int,
        *,
        max_segments: tuple[int, int] | None = None,
    ) -> BlockMask:
        """The BlockMask of ``mask_mod`` over a ``q_len x kv_len`` grid.

        ``max_segments`` bounds the segment counts of the q and kv sides (e.g. frames x copies
        of the layout, +1); with it no host sync happens and shapes depend only on the
        signature. Without it the exact counts are read back (one sync). Masks without
        ``q_keys`` (e.g. composed with torch's ``and_masks``) fall back to ``create_block_mask``.
        """
        q_keys = getattr(mask_mod, "q_keys", None)
        kv_keys = getattr(mask_mod, "kv_keys", None)
        if not q_keys or not kv_keys:
            dev = q_keys[0].device if q_keys else "cpu"
            return create_block_mask(mask_mod, 1, 1, q_len, kv_len, device=dev)
        for side, keys, n in (("q", q_keys, q_len), ("kv", kv_keys, kv_len)):
            bad = [tuple(k.shape) for k in keys if k.shape != (n,)]
            if bad:
                raise ValueError(f"{side}_keys of {mask_mod.__name__} have shapes {bad}, expected ({n},)")
        if max_segments is None:
            sq, sk = num_segments(q_keys), num_segments(kv_keys)
        else:
            sq, sk = min(max_segments[0], q_len), min(max_segments[1], kv_len)
        if max(sq, sk) > MAX_SEGMENTS:
            if max_segments is not None:  # the bound was loose; the real count may still be small
                return self(mask_mod, q_len, kv_len)
            return create_block_mask(mask_mod, 1, 1, q_len, kv_len, device=q_keys[0].device)
        runs = (getattr(mask_mod, "runs", None) or 0) if self.range_mods else 0
        t = self._fn(mask_mod, q_keys, kv_keys, q_len, kv_len, sq, sk, runs if runs in (1, 2) else 0)
        return BlockMask(
            seq_lengths=(q_len, kv_len),
            kv_num_blocks=t[0], kv_indices=t[1], full_kv_num_blocks=t[2], full_kv_indices=t[3],
            q_num_blocks=t[4], q_indices=t[5], full_q_num_blocks=t[6], full_q_indices=t[7],
            BLOCK_SIZE=(BLOCK, BLOCK), mask_mod=range_mask_mod(*t[8:]) if len(t) > 8 else mask_mod,
        )


def fast_block_mask(
    mask_mod: Callable, q_len: int, kv_len: int, *, max_segments: tuple[int, int] | None = None, range_mods: bool = True
) -> BlockMask:
    """Eager :class:`BlockMaskBuilder` call (see there)."""
    return BlockMaskBuilder(compile=False, range_mods=range_mods)(mask_mod, q_len, kv_len, max_segments=max_segments)
