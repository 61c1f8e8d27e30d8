"""The mask table: one :class:`MaskKind` per mask name, the one place that says what a mask is.

An entry declares its name, the factory of its mask function (``build(layout, **options) -> mask_mod``),
its block-mask builder, the attention backends that take it and the one ``"auto"`` picks on CUDA, and
what the rest of flexpack asks of a mask: whether it takes ``model.chunk_size`` (``chunked``), whether
it needs the clean copy of ``objective.teacher_forcing`` (``teacher_forcing``), whether it depends on a
token's stream or copy (``token_level``: a frame layout cannot stand in for the token layout), the key
length of a cross-attention mask (``keys``), and the model families that may train with it
(``model.mask`` there). :class:`~flexpack.attention.flex.FlexAttnFunc`, the config check, the model
registry and the samplers read the table; none of them lists mask names.

Adding a mask is one :func:`register_mask` call beside its factory, inside flexpack (the built-in
families: ``mask_document.py``, ``mask_chunk.py``, ``mask_text.py``; a model family's own in its folder, such as
``families/lingbot/mask.py``) or outside it::

    register_mask("prefix", build=prefix_mask, options=("chunk_size",), chunked=True, families=("wanva",))

Read the table through :mod:`flexpack.attention.masks`, which imports the built-in families (this module
alone holds only what has been registered so far).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from torch.nn.attention.flex_attention import BlockMask

from flexpack.attention.blockmask import BlockMaskBuilder
from flexpack.attention.maskmod import MaskMod
from flexpack.packing.layout import TokenLayout

# backends every mask can run on: a dense boolean mask (any device, the reference) and FlexAttention
# over a block mask (Triton, or FA4 "FLASH")
ANY_MASK_BACKENDS = ("dense", "flex", "flex-flash")
# backends over episode runs: one SDPA per episode, or varlen attention (a mask that is "same episode")
EPISODE_BACKENDS = ("sdpa-loop", "varlen")
KNOWN_BACKENDS = ANY_MASK_BACKENDS + EPISODE_BACKENDS
# the options a mask factory may take (FlexAttnFunc.prepare and make_mask pass them on)
MASK_OPTIONS = ("chunk_size", "window", "text_tokens", "text_slots")

BlockMaskFn = Callable[[BlockMaskBuilder, MaskMod, int, int, "tuple[int, int]"], BlockMask]


def segment_block_mask(builder: BlockMaskBuilder, mask_mod: MaskMod, q_len: int, kv_len: int,
                       max_segments: tuple[int, int]) -> BlockMask:
    """The default block-mask builder: flexpack's segment algorithm over the mask_mod's keys
    (:class:`~flexpack.attention.blockmask.BlockMaskBuilder`; ``create_block_mask`` for a mask_mod without
    ``q_keys`` / ``kv_keys``)."""
    return builder(mask_mod, q_len, kv_len, max_segments=max_segments)


@dataclass(frozen=True, kw_only=True)
class MaskKind:
    """One mask of the table (see the module docstring)."""

    name: str
    # (layout, **options) -> mask_mod; receives exactly the options named in ``options`` (None where not given)
    build: Callable[..., MaskMod]
    options: tuple[str, ...] = ()
    # (builder, mask_mod, q_len, kv_len, max_segments) -> BlockMask
    block_mask: BlockMaskFn = segment_block_mask
    backends: tuple[str, ...] = ANY_MASK_BACKENDS  # the backends that take it (FlexAttnFunc's names)
    auto_cuda: str = "flex"  # what FlexAttnFunc("auto") runs on CUDA (benchmarks/attention.py measures them)
    chunked: bool = False  # takes model.chunk_size (frames per chunk); the sampler cuts at chunk boundaries
    teacher_forcing: bool = False  # relates a noisy and a clean copy: needs objective.teacher_forcing
    token_level: bool = False  # depends on a token's stream or copy, not only its episode and frame
    # cross-attention: (layout, **options) -> (key length, bound on key-side segments); None: self-attention
    keys: Callable[..., tuple[int, int]] | None = None
    families: tuple[str, ...] = ()  # model families (model.family) that may train with it (model.mask)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a mask's name must be a non-empty string, got {self.name!r}")
        if not callable(self.build):
            raise ValueError(f"mask {self.name!r}: build must be callable, got {self.build!r}")
        if bad := [o for o in self.options if o not in MASK_OPTIONS]:
            raise ValueError(f"mask {self.name!r}: unknown options {bad}; known: {MASK_OPTIONS}")
        if bad := [b for b in self.backends if b not in KNOWN_BACKENDS]:
            raise ValueError(f"mask {self.name!r}: unknown backends {bad}; known: {KNOWN_BACKENDS}")
        if self.auto_cuda not in self.backends:
            raise ValueError(f"mask {self.name!r}: auto_cuda={self.auto_cuda!r} is not one of its backends "
                             f"{self.backends}")

    def make(self, layout: TokenLayout, **options: Any) -> MaskMod:
        """The mask_mod over ``layout`` with the options this mask takes (the others are ignored)."""
        return self.build(layout, **{k: options.get(k) for k in self.options})

    @property
    def episode_runs(self) -> bool:
        """Whether the per-episode backends take it: the mask is "same episode" over valid tokens."""
        return any(b in EPISODE_BACKENDS for b in self.backends)


_TABLE: dict[str, MaskKind] = {}


def register_mask(name: str, *, build: Callable[..., MaskMod], replace: bool = False, **fields: Any) -> MaskKind:
    """Add the mask ``name`` to the table (``fields``: those of :class:`MaskKind`); a name already there
    is an error unless ``replace``. Returns the entry."""
    kind = MaskKind(name=name, build=build, **fields)
    if name in _TABLE and not replace:
        raise ValueError(f"mask {name!r} is registered already; pass replace=True to change it")
    _TABLE[name] = kind
    return kind


def unregister_mask(name: str) -> None:
    """Remove ``name`` from the table (a mask registered for a while, e.g. by a test)."""
    if name not in _TABLE:
        raise ValueError(f"unknown mask {name!r}; expected one of {mask_names()}")
    del _TABLE[name]


def update_mask(name: str, **fields: Any) -> MaskKind:
    """Change fields of a registered mask (e.g. the backend ``"auto"`` picks, for a benchmark)."""
    kind = mask_kind(name)
    old = {f.name: getattr(kind, f.name) for f in dataclasses.fields(kind) if f.name != "name"}
    return register_mask(name, replace=True, **{**old, **fields})


def mask_kind(name: str) -> MaskKind:
    """The table's entry for ``name``, or one ValueError line listing the known masks."""
    try:
        return _TABLE[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown mask {name!r}; expected one of {mask_names()}") from None


def mask_names() -> tuple[str, ...]:
    """Every registered mask, in registration order (the built-in ones first)."""
    return tuple(_TABLE)
