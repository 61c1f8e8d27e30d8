"""The mask table: a mask defined here, outside flexpack, registered the way the built-in ones are, is taken by
the config check, builds its block mask and runs through FlexAttnFunc's dense backend; unknown names are one
line listing the known masks."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask

from flexpack.attention.blockmask_check import block_structure
from flexpack.attention.flex import AUTO_CUDA, FlexAttnFunc
from flexpack.attention.masks import (
    MASK_KINDS,
    MaskMod,
    mask_kind,
    mask_names,
    register_mask,
    tag_mask,
    unregister_mask,
)
from flexpack.packing.layout import SequenceLayout, TokenLayout
from flexpack.run.config import load_config
from flexpack.run.resolve import config_family

NAME = "local_band"


def local_band_mask(layout: TokenLayout, chunk_size: int | None) -> MaskMod:
    """Attention inside an episode to frames at most ``chunk_size - 1`` away (either side).

    Note: ``doc[q] == doc[kv] >= 0`` and ``|frame[q] - frame[kv]| < chunk_size``."""
    if chunk_size is None:
        raise ValueError(f"mask {NAME!r} needs chunk_size")
    doc, frame = layout.doc, layout.frame

    def local_band(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        same = (doc[q_idx] == doc[kv_idx]) & (doc[q_idx] >= 0)
        return same & ((frame[q_idx] - frame[kv_idx]).abs() < chunk_size)

    return tag_mask(local_band, f"{NAME}_{chunk_size}", (doc, frame), (doc, frame), local_band_mask.__doc__)


@pytest.fixture
def local_band():
    kind = register_mask(NAME, build=local_band_mask, options=("chunk_size",), chunked=True, families=("wanva",))
    yield kind
    unregister_mask(NAME)


def _layout() -> TokenLayout:
    # 3 episodes and trailing padding, 32 tokens a frame: 22 frames = 704 tokens, 4 frames a 128-token block
    return SequenceLayout.from_rows([[6, 9, 5]], 22, text_len=[1, 1, 1]).tokens(32)


def _reference(layout: TokenLayout, chunk: int) -> torch.Tensor:
    """The mask pair by pair in plain Python (independent of the mask_mod above)."""
    doc, frame = layout.doc.tolist(), layout.frame.tolist()
    T = len(doc)
    return torch.tensor([[doc[q] >= 0 and doc[q] == doc[k] and abs(frame[q] - frame[k]) < chunk for k in range(T)]
                         for q in range(T)])


def test_a_registered_mask_is_in_the_table_and_taken_by_the_config_check(local_band):
    assert mask_names()[: len(MASK_KINDS)] == MASK_KINDS and mask_names()[-1] == NAME
    assert mask_kind(NAME) is local_band and local_band.backends == ("dense", "flex", "flex-flash")
    assert AUTO_CUDA[NAME] == "flex"  # the table's default for a mask that chose none
    cfg = load_config(overrides=[f"model.mask='{NAME}'", "model.chunk_size=3"])
    assert cfg.model.mask == NAME and config_family(cfg).chunk_masks == ("chunk_causal", "teacher_forcing", NAME)
    with pytest.raises(ValueError, match=rf"model.mask='{NAME}' needs a positive model.chunk_size"):
        load_config(overrides=[f"model.mask='{NAME}'"])
    with pytest.raises(ValueError, match=r"model.mask must be one of \('lingbot',\)"):  # not a lingbot-va mask
        load_config(overrides=["model.family='lingbot-va'", "model.preset='lingbot-va-tiny'", f"model.mask='{NAME}'"])


def test_a_registered_mask_builds_its_block_mask_and_runs_dense_equal_to_a_reference(local_band):
    lay, chunk = _layout(), 6
    ref = _reference(lay, chunk)
    assert ref.any() and not ref.all()
    prep = FlexAttnFunc("flex").prepare(lay, NAME, chunk_size=chunk)
    want = create_block_mask(lambda b, h, q, k: ref[q, k], 1, 1, lay.num_tokens, lay.num_tokens, device="cpu")
    got_partial, got_full = block_structure(prep.block_mask())
    want_partial, want_full = block_structure(want)
    assert got_partial.equal(want_partial) and got_full.equal(want_full)
    assert got_full.any() and (got_partial & ~got_full).any()  # full and partial blocks both occur

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, lay.num_tokens, 8, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    out = FlexAttnFunc("dense")(q, k, v, lay, mask=NAME, chunk_size=chunk)
    s = (q @ k.transpose(-1, -2)) / 8 ** 0.5
    has = ref.any(-1)[:, None]
    want_out = s.masked_fill(~ref, float("-inf")).masked_fill(~has, 0.0).softmax(-1) * has @ v
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
    out.sum().backward()  # the dense backend trains on the CPU
    assert q.grad is not None and bool(q.grad[:, :, lay.doc < 0].eq(0).all())  # padding queries: no gradient


def test_an_unknown_mask_is_one_line_listing_the_known_ones(local_band):
    for call in (lambda: mask_kind("nope"), lambda: FlexAttnFunc("dense").prepare(_layout(), "nope")):
        with pytest.raises(ValueError) as err:
            call()
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith("unknown mask 'nope'; expected one of (")
        assert all(repr(m) in msg for m in (*MASK_KINDS, NAME))
    with pytest.raises(ValueError, match=r"model.mask must be one of \('document', 'chunk_causal', 'teacher_forcing', "
                                         rf"'{NAME}'\) for model.family = 'wanva', got 'nope'"):
        load_config(overrides=["model.mask='nope'"])


def test_a_mask_name_is_registered_once_and_its_fields_are_checked(local_band):
    with pytest.raises(ValueError, match=f"mask '{NAME}' is registered already"):
        register_mask(NAME, build=local_band_mask)
    with pytest.raises(ValueError, match=r"unknown backends \['cudnn'\]"):
        register_mask("other", build=local_band_mask, backends=("dense", "cudnn"))
    with pytest.raises(ValueError, match="auto_cuda='varlen' is not one of its backends"):
        register_mask("other", build=local_band_mask, auto_cuda="varlen")
    assert "other" not in mask_names()
    with pytest.raises(ValueError, match="backend 'varlen' supports only document/valid masks, got 'local_band'"):
        lay = _layout()
        q = torch.zeros(1, 1, lay.num_tokens, 8)
        FlexAttnFunc("varlen")(q, q, q, lay, mask=NAME, chunk_size=2)
