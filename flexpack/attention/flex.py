"""``FlexAttnFunc``: one attention callable over a layout's mask, with a backend per device.

Backends (all return zeros, never NaN, for query rows that may attend nothing, e.g. padding):

* ``"dense"``: SDPA with a dense boolean mask evaluated from the same mask_mod; autograd on any
  device. This is the CPU training path (FlexAttention has no CPU backward) and the reference.
* ``"flex"``: ``torch.compile``'d FlexAttention (Triton on CUDA, C++ on CPU: forward only there),
  with the block mask from :mod:`flexpack.attention.blockmask`.
* ``"flex-flash"``: the same with ``kernel_options={"BACKEND": "FLASH"}`` (FA4 / CuTe; CUDA only,
  needs the ``flash_attn.cute`` package).
* ``"sdpa-loop"``: one SDPA call per episode (document / valid masks only).
* ``"varlen"``: ``torch.nn.attention.varlen.varlen_attn`` over episode runs (CUDA; document masks).
* ``"auto"``: CUDA -> the mask's ``auto_cuda`` (``AUTO_CUDA``; measured in ``benchmarks/attention.py``; falls back to
  ``"flex"`` without FA4; a single-episode document mask uses one SDPA call); CPU -> ``"dense"``, except
  forward-only calls on long sequences (``T >= CPU_FLEX_MIN_TOKENS``), which use compiled flex to avoid the
  T x T mask.

Which backends take a mask, which one ``"auto"`` picks on CUDA, its key length (cross-attention) and its
block-mask builder are the mask table's (:mod:`flexpack.attention.mask_table`); nothing here names a mask.

Compilation: one compiled FlexAttention per (kernel options, shape), ``dynamic=False``, each with
its own dynamo cache; a new shape compiles once, new layouts of the same shape do not (block-mask
contents and the mask's closure tensors are graph inputs). The block-mask builder compiles once per
(mask kind, shape, segment grid), each also captured once as a CUDA graph that later builds replay
(captures are not compiles). With ``fixed_segments`` (what :class:`~flexpack.models.WanVA` uses, so
training, verify and sampling) the grid follows the layout's shape alone: one builder graph per mask
and pack shape, whatever number of episodes a pack holds; without it the grid is the power of two
above the mask's segment count (smaller grids, one more compile whenever a pack crosses a power of two).
:func:`compile_count` counts every graph compiled here.
"""

from __future__ import annotations

import importlib.util
from collections.abc import MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.profiler import record_function
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from flexpack.attention.blockmask import MAX_SEGMENTS, BlockMaskBuilder, compile_fresh
from flexpack.attention.episode_runs import sdpa_loop, varlen
from flexpack.attention.mask_table import EPISODE_BACKENDS, KNOWN_BACKENDS, MaskKind, update_mask
from flexpack.attention.masks import MaskMod, dense_mask, make_mask, mask_kind, mask_names, next_pow2
from flexpack.packing.layout import SequenceLayout, TokenLayout

BACKENDS = ("auto", *KNOWN_BACKENDS)
DOCUMENT_ONLY = EPISODE_BACKENDS  # the backends over episode runs: masks that say so in the table take them


class _AutoCuda(MutableMapping):
    """The backend ``"auto"`` runs on CUDA per mask: a view of the mask table's ``auto_cuda`` (each mask
    module says why its choice); setting an entry changes the table (a benchmark timing another backend)."""

    def __getitem__(self, name: str) -> str:
        return mask_kind(name).auto_cuda

    def __setitem__(self, name: str, backend: str) -> None:
        update_mask(name, auto_cuda=backend)

    def __delitem__(self, name: str) -> None:
        raise TypeError("AUTO_CUDA entries follow the mask table; unregister the mask instead")

    def __iter__(self) -> Iterator[str]:
        return iter(mask_names())

    def __len__(self) -> int:
        return len(mask_names())


AUTO_CUDA = _AutoCuda()
CPU_FLEX_MIN_TOKENS = 16384
# Head dims for which the FLASH (FA4) backend was checked against a float64 reference on the H200
# (benchmarks/flash_grad_check.py): at D=128 its gradients match; at D=16 dq is wrong (relative
# error 1.2, with our block mask and with create_block_mask alike). Other head dims use Triton.
FLASH_HEAD_DIMS = (128,)
FLASH_DTYPES = (torch.bfloat16, torch.float16)  # FA4 takes 16-bit inputs only; float32 runs on Triton


def _flash_for(backend: str, dtype: torch.dtype, strict: bool) -> str:
    """``backend`` for inputs of ``dtype``: FLASH needs 16-bit inputs; ``auto`` moves float32 to
    Triton flex, an explicit ``flex-flash`` (``strict``) says what to change."""
    if backend != "flex-flash" or dtype in FLASH_DTYPES:
        return backend
    if strict:
        raise ValueError(f"the FLASH backend takes bfloat16 or float16 inputs, got {dtype}; "
                         "run under bf16 autocast (runtime.dtype='bfloat16') or use backend 'flex'")
    return "flex"


class GraphCounter:
    """An inductor backend that counts the graphs it compiles (recompiles show up as new graphs);
    this module's counter covers flex kernels and block-mask builders."""

    def __init__(self) -> None:
        self.n = 0

    def backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        self.n += 1
        return compile_fx(gm, example_inputs)


_COUNTER = GraphCounter()
_COMPILED: dict[tuple, Callable] = {}  # compiled flex callables, one per (kernel options, shapes)


def compile_count() -> int:
    """Graphs compiled so far by FlexAttnFunc (all instances): flex kernels + block-mask builders."""
    return _COUNTER.n


def has_flash() -> bool:
    """Whether the FA4 (CuTe) package behind FlexAttention's FLASH backend is importable."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:
        return False


def _flex_call(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask, kernel_options: dict | None) -> Tensor:
    return flex_attention(q, k, v, block_mask=block_mask, kernel_options=kernel_options)


def _compiled_flex(flash: bool, q: Tensor, k: Tensor) -> Callable:
    # one private dynamo cache per shape signature (see compile_fresh); grad mode adds a 2nd entry
    key = (flash, tuple(q.shape), tuple(k.shape), q.dtype, q.device)
    if key not in _COMPILED:
        _COMPILED[key] = compile_fresh(_flex_call, f"{len(_COMPILED)}", _COUNTER.backend)
    return _COMPILED[key]


def compiled_flex_attention(q: Tensor, k: Tensor, *, flash: bool = False) -> Callable:
    """The compiled ``flex_attention`` call ``FlexAttnFunc`` runs for query / key tensors of these
    shapes (Triton, or FA4 with ``flash``): ``fn(q, k, v, block_mask, scale)``. Compiled once per
    shape and shared with ``FlexAttnFunc``, so a benchmark timing it adds no compile."""
    return _compiled_flex(flash, q, k)


@dataclass(eq=False)
class PreparedMask:
    """A mask built once per step from a layout and shared by every layer.

    The backend-specific forms (block mask, dense mask, episode runs) are built on first use.
    """

    kind: str
    layout: TokenLayout
    mask_mod: MaskMod
    q_len: int
    kv_len: int
    builder: BlockMaskBuilder
    kv_segments: int | None = None  # bound on kv-side segments (text: 2 per slot + 1)
    fixed_bounds: bool = False  # segment bounds from the layout's shape alone (see FlexAttnFunc.fixed_segment_bounds)
    _cache: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.layout.doc.device

    @property
    def spec(self) -> MaskKind:
        """The mask table's entry of this mask."""
        return mask_kind(self.kind)

    def block_mask(self) -> BlockMask:
        if "block" not in self._cache:
            with record_function("block_mask"):  # a named range in profiles (mask builds are overhead)
                self._cache["block"] = self.spec.block_mask(self.builder, self.mask_mod, self.q_len, self.kv_len,
                                                            self.segment_bounds())
        return self._cache["block"]

    def segment_bounds(self) -> tuple[int, int]:
        """Static (q, kv) segment counts for the block-mask builder: the mask's host-side bounds
        rounded up to a power of two (>= 64), so that shapes, and compiles, change rarely; at
        most one cell per (copy, row, frame) (times the mask's ``segments_per_cell``, 2 for lingbot). With
        ``fixed_bounds`` always that maximum: one shape per layout shape, whatever the layout holds (unless that
        grid is larger than the builder takes, :data:`~flexpack.attention.blockmask.MAX_SEGMENTS` a side: then
        the rounded bound)."""
        lay = self.layout
        per_cell = getattr(self.mask_mod, "segments_per_cell", 1)  # lingbot: video and action runs of a frame
        cells = lay.frames.num_rows * lay.frames.frames_per_row * lay.copies * per_cell + 1
        kv_cells = self.kv_segments or cells
        seg = getattr(self.mask_mod, "segments", None)
        if seg is None or (self.fixed_bounds and max(cells, kv_cells) <= MAX_SEGMENTS):
            return cells, kv_cells
        return min(max(64, next_pow2(seg[0])), cells), min(max(64, next_pow2(seg[1])), kv_cells)

    def dense(self) -> tuple[Tensor, Tensor]:
        """(Tq, Tk) bool mask with empty rows opened (to keep SDPA finite) and (Tq,) row-has-keys."""
        if "dense" not in self._cache:
            with record_function("block_mask"):
                m = dense_mask(self.mask_mod, self.q_len, self.kv_len, self.device)
                has = m.any(-1)
                self._cache["dense"] = (m | ~has[:, None], has)
        return self._cache["dense"]

    def runs(self) -> list[tuple[int, int]]:
        """Episode token runs ``(start, length)`` (document / valid masks)."""
        if "runs" not in self._cache:
            host = self.layout.on_host()  # host values without reading the device tensors back
            starts, lens = host.doc_start.tolist(), host.doc_len.tolist()
            self._cache["runs"] = [(s, n) for s, n in zip(starts, lens) if n > 0]
        return self._cache["runs"]

    def valid(self) -> Tensor:
        if "valid" not in self._cache:
            self._cache["valid"] = self.layout.valid if self.spec.episode_runs else self.dense()[1]
        return self._cache["valid"]


class FlexAttnFunc:
    """Attention over packed episodes: ``FlexAttnFunc()(q, k, v, layout, mask="document")``.

    q: (1, H, Tq, D), k/v: (1, H, Tk, D) -> (1, H, Tq, D). ``Tq == T`` (the layout's tokens);
    ``Tk == T`` except for ``mask="text"``, where k/v are the ``E * text_tokens`` flattened text
    tokens. Build the mask once per step with :meth:`prepare` and pass the result to every layer.
    The layout is a :class:`TokenLayout`; a :class:`SequenceLayout` (frames) is expanded to
    ``Tq / frames`` tokens per frame where the mask does not depend on the stream or copy of a
    token, and is otherwise a ``TypeError`` saying to pass ``layout.tokens(...)``.
    """

    def __init__(
        self,
        backend: str = "auto",
        *,
        compile_block_mask: bool | None = None,
        range_masks: bool = True,
        graph_block_mask: bool | None = None,
        fixed_segments: bool = False,
    ) -> None:
        """``fixed_segments``: build every block mask on the segment grid of the layout's shape (see
        :meth:`fixed_segment_bounds`, which turns it on for a block of code), so that no number of
        episodes per pack compiles the builder anew. ``range_masks``: inside partial blocks the flex
        kernels evaluate the mask as key ranges per query (:func:`flexpack.attention.blockmask.range_mask_mod`,
        same values); ``False`` evaluates the mask_mod of :mod:`flexpack.attention.masks` there instead (kept
        for comparison).
        ``compile_block_mask`` / ``graph_block_mask``: compile the block-mask builder (default: on
        CUDA) and replay each compiled signature as a CUDA graph (default: when compiled on CUDA);
        see :class:`~flexpack.attention.blockmask.BlockMaskBuilder`."""
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
        self.backend = backend
        if graph_block_mask and compile_block_mask is False:
            raise ValueError("graph_block_mask=True needs a compiled block-mask builder "
                             "(compile_block_mask=False given)")
        self._compile_bm = compile_block_mask
        self._graph_bm = graph_block_mask
        self._range_masks = range_masks
        self._builders: dict[bool, BlockMaskBuilder] = {}
        self._fixed_bounds = fixed_segments

    @contextmanager
    def fixed_segment_bounds(self) -> Iterator[None]:
        """Within this block, block masks are built on segment grids sized by the layout's shape
        alone (one cell per frame and copy), not by the power of two above the mask's segment count.

        A run that must not compile after its warm-up, whatever number of episodes a pack holds,
        builds every pack on one grid (``fixed_segments=True`` does so for every call). The grid is
        larger (one cell per frame: 2,049 a side for a 65,536-token pack of 32-token frames, against
        64-128 for a document mask of a few dozen episodes), so a build does more work
        (``benchmarks/blockmask_build.py`` times both grids)."""
        before, self._fixed_bounds = self._fixed_bounds, True
        try:
            yield
        finally:
            self._fixed_bounds = before

    @property
    def compile_count(self) -> int:
        return compile_count()

    def _builder(self, device: torch.device) -> BlockMaskBuilder:
        # compiling the builder pays off on CUDA (few kernel launches); on CPU it only costs time
        comp = device.type == "cuda" if self._compile_bm is None else self._compile_bm
        if comp not in self._builders:
            graphs = comp and self._graph_bm is not False
            self._builders[comp] = BlockMaskBuilder(compile=comp, compile_backend=_COUNTER.backend,
                                                    range_mods=self._range_masks, cuda_graphs=graphs)
        return self._builders[comp]

    def prepare(
        self,
        layout: TokenLayout,
        mask: str = "document",
        *,
        chunk_size: int | Tensor | None = None,
        window: int | Tensor | None = None,
        text_tokens: int | None = None,
        text_slots: int | None = None,
        device: torch.device | str | None = None,
    ) -> PreparedMask:
        """Build the mask for ``layout`` once (per step); pass the result to every layer's call.

        For ``mask="text"``, k/v hold ``text_slots * text_tokens`` keys (default: one slot per
        episode); :func:`flexpack.attention.masks.text_slots` gives a slot count that keeps the shape
        fixed as the number of episodes per micro-batch varies.
        """
        spec = mask_kind(mask)  # an unknown name: one line listing the known ones
        if isinstance(layout, SequenceLayout):
            raise TypeError(_NEEDS_TOKENS.format(what="prepare() got a SequenceLayout (frames)"))
        if device is not None and layout.doc.device != torch.device(device):
            layout = layout.to(device)
        mod = make_mask(layout, mask, chunk_size=chunk_size, window=window, text_tokens=text_tokens,
                        text_slots=text_slots)
        kv_len, kv_segments = layout.num_tokens, None
        if spec.keys is not None:  # cross-attention: the keys are not the layout's tokens
            opts = {"chunk_size": chunk_size, "window": window, "text_tokens": text_tokens, "text_slots": text_slots}
            kv_len, kv_segments = spec.keys(layout, **{k: opts[k] for k in spec.options})
        if kv_len == 0:
            raise ValueError(f"mask {mask!r} has no keys (kv_len=0)")
        prep = PreparedMask(mask, layout, mod, layout.num_tokens, kv_len, self._builder(layout.doc.device), kv_segments,
                            fixed_bounds=self._fixed_bounds)
        backend = self._pick(prep, needs_grad=True)
        if backend != self._pick(prep, needs_grad=False):
            return prep  # decided per call (CPU auto, long T): build lazily, never a useless T x T mask
        if backend in ("flex", "flex-flash"):
            prep.block_mask()
        elif backend == "dense":
            prep.dense()
        return prep

    def _pick(self, prep: PreparedMask, needs_grad: bool) -> str:
        if self.backend != "auto":
            return self.backend
        if prep.device.type == "cuda":
            spec = prep.spec
            one = prep.layout.text_len.numel() == 1 and not prep.layout.spatial  # one episode, no spatial padding
            if spec.episode_runs and "sdpa-loop" in spec.backends and one:
                return "sdpa-loop"  # one episode: a single SDPA call beat FLASH (0.93x) on the H200
            choice = spec.auto_cuda
            return "flex" if choice == "flex-flash" and not has_flash() else choice
        if not needs_grad and prep.q_len >= CPU_FLEX_MIN_TOKENS:
            return "flex"
        return "dense"

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        layout_or_prepared: TokenLayout | SequenceLayout | PreparedMask,
        mask: str = "document",
        **mask_kw,
    ) -> Tensor:
        # a named range: profiles (flexpack.training.observe.profile_summary) count what runs inside it,
        # and the backward of what it created, as attention
        with record_function("attention"):
            return self._call(q, k, v, layout_or_prepared, mask, **mask_kw)

    def _call(self, q: Tensor, k: Tensor, v: Tensor, layout_or_prepared: TokenLayout | PreparedMask, mask: str,
              **mask_kw) -> Tensor:
        prep = layout_or_prepared
        if isinstance(prep, SequenceLayout):
            prep = _frames_to_tokens(prep, q.shape[2] if q.dim() == 4 else -1, mask)
        if isinstance(prep, TokenLayout):
            prep = self.prepare(prep, mask, device=q.device, **mask_kw)
        elif mask_kw or (mask != "document" and mask != prep.kind):
            raise ValueError(f"a PreparedMask ({prep.kind!r}) already fixes the mask; got mask={mask!r}, {mask_kw}")
        if q.dim() != 4 or q.shape[0] != 1 or k.shape != v.shape or k.shape[:2] != q.shape[:2]:
            raise ValueError(f"expected q (1,H,Tq,D), k/v (1,H,Tk,D); got {tuple(q.shape)}, {tuple(k.shape)}, "
                             f"{tuple(v.shape)}")
        if q.shape[2] != prep.q_len or k.shape[2] != prep.kv_len:
            raise ValueError(f"mask {prep.kind!r} is for Tq={prep.q_len}, Tk={prep.kv_len}; "
                             f"got q {q.shape[2]}, k {k.shape[2]}")
        if q.device != prep.device:
            raise ValueError(f"q is on {q.device} but the mask on {prep.device}; pass device= to prepare()")
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        backend = _flash_for(self._resolve(prep, needs_grad, q.shape[-1]), q.dtype, self.backend == "flex-flash")
        if backend in ("flex", "flex-flash") and q.device.type == "cpu" and needs_grad:
            raise ValueError("FlexAttention has no CPU backward; use backend='dense' (or 'auto') for training on CPU")
        return _run(backend, q, k, v, prep)

    def _resolve(self, prep: PreparedMask, needs_grad: bool, head_dim: int) -> str:
        """The backend a call with these properties runs (FLASH only at verified head dims)."""
        backend = self._pick(prep, needs_grad)
        if backend == "flex-flash" and head_dim not in FLASH_HEAD_DIMS:
            if self.backend == "flex-flash":
                raise ValueError(f"the FLASH backend is verified only for head dims {FLASH_HEAD_DIMS}, got {head_dim}")
            backend = "flex"
        if backend in EPISODE_BACKENDS and prep.layout.spatial:  # runs of whole episodes: padding inside them
            raise ValueError(f"backend {backend!r} cannot skip spatial padding (grids differ); use flex/dense/auto")
        if backend not in prep.spec.backends:
            takers = "/".join(m for m in mask_names() if backend in mask_kind(m).backends)
            raise ValueError(f"backend {backend!r} supports only {takers} masks, got {prep.kind!r}")
        return backend

    def bind(self, prep: PreparedMask, head_dim: int, *, needs_grad: bool | None = None) -> "BoundAttention":
        """``(q, k, v) -> out`` for one prepared mask, with the backend decided now, outside any
        compiled region (a compiled block then traces only the kernel call, no dispatch logic).

        ``needs_grad`` defaults to ``torch.is_grad_enabled()``: bind inside the forward that uses it."""
        grad = torch.is_grad_enabled() if needs_grad is None else needs_grad
        backend = self._resolve(prep, grad, head_dim)
        block, traced = None, backend
        if backend in ("flex", "flex-flash"):
            if prep.device.type == "cpu" and grad:
                raise ValueError("FlexAttention has no CPU backward; "
                                 "use backend='dense' (or 'auto') for training on CPU")
            block = prep.block_mask()
        elif backend == "dense":
            prep.dense()
        else:
            prep.runs()
        if block is None and prep.device.type == "cuda":
            # a per-episode loop or varlen call depends on the episode runs, which a compiled block would
            # specialize on (a recompile per layout): traced, the call is FlexAttention over a block mask
            block = prep.block_mask()
            traced = "flex-flash" if has_flash() and head_dim in FLASH_HEAD_DIMS else "flex"
        return BoundAttention(backend, prep, block, traced, strict=self.backend == "flex-flash")


@dataclass(eq=False)
class BoundAttention:
    """Attention over one prepared mask with a fixed backend (see :meth:`FlexAttnFunc.bind`).

    Eager calls go through the module's compiled FlexAttention kernels; inside a ``torch.compile``'d
    region (a compiled transformer block) the kernel call is traced into that region's graph, so
    the block's norms, modulation, RoPE and casts fuse around it.
    """

    backend: str
    prep: PreparedMask
    # built at bind time (flex, and every CUDA backend): an input of the traced call
    block_mask: BlockMask | None = None
    # what a compiled region runs: the flex kernel over ``block_mask`` where there is one
    traced_backend: str | None = None
    strict: bool = False  # flex-flash was asked for by name: float32 inputs are an error, not a move to Triton

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if torch.compiler.is_compiling():  # traced into a compiled block's graph (its dtype is static)
            if self.block_mask is not None:
                traced = _flash_for(self.traced_backend or self.backend, q.dtype, self.strict)
                opts = {"BACKEND": "FLASH"} if traced == "flex-flash" else None
                return flex_attention(q, k, v, block_mask=self.block_mask, kernel_options=opts)
            return _run(_flash_for(self.backend, q.dtype, self.strict), q, k, v, self.prep)
        with record_function("attention"):  # a named range in profiles
            return _run(_flash_for(self.backend, q.dtype, self.strict), q, k, v, self.prep)


def _run(backend: str, q: Tensor, k: Tensor, v: Tensor, prep: PreparedMask) -> Tensor:
    """One eager attention call with a resolved backend."""
    if backend == "dense":
        return _dense(q, k, v, prep)
    if backend in ("flex", "flex-flash"):
        opts = {"BACKEND": "FLASH"} if backend == "flex-flash" else None
        return _compiled_flex(backend == "flex-flash", q, k)(q, k, v, prep.block_mask(), opts)
    if backend == "sdpa-loop":
        return sdpa_loop(q, k, v, prep)
    return varlen(q, k, v, prep)


_NEEDS_TOKENS = ("{what}; FlexAttnFunc needs the token layout: pass "
                 "layout.tokens(video_tokens=h * w, action_tokens=..., copies=..., grid_hw=(h, w))")


def _frames_to_tokens(layout: SequenceLayout, q_len: int, mask: str) -> TokenLayout:
    """A frame layout as tokens where the mask cannot depend on what is missing: with ``Tq`` a
    multiple of the frame count every frame holds ``Tq / frames`` tokens, and document, valid,
    chunk-causal and text masks look only at a token's episode and frame, never at whether it is
    a video or an action token. Teacher forcing also needs the copies, which frames do not say."""
    frames = layout.frame_doc.numel()
    token_level = mask_kind(mask).token_level  # the mask reads a token's stream or copy
    if token_level or q_len <= 0 or q_len % frames:
        got = f"a SequenceLayout of {frames} frames for q of {q_len} tokens"
        got += f" and mask={mask!r}" if token_level else ""
        raise TypeError(_NEEDS_TOKENS.format(what=f"got {got}"))
    return layout.tokens(video_tokens=q_len // frames)


def _dense(q: Tensor, k: Tensor, v: Tensor, prep: PreparedMask) -> Tensor:
    m, has = prep.dense()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    # rows without keys attended everything above (finite); zeroing them also zeroes their grads
    return out * has[:, None].to(out.dtype)
