"""Spatial padding: items of different latent grids in one micro-batch of the run's largest grid.

Tokens of a padded episode are its tokens alone; padding tokens belong to no episode; block masks over such layouts
are create_block_mask's; packed ≡ per-episode (outputs, loss, gradients) for WanVA, and a padding that leaked into
attention is caught."""

from __future__ import annotations

import random

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from flexpack.attention.flex import FlexAttnFunc
from flexpack.attention.masks import dense_mask
from flexpack.flow.objective import FlowMatchingConfig
from flexpack.models import registry
from flexpack.packing import layout as layout_mod
from flexpack.packing.collate import PackCollate, PadCollate
from flexpack.packing.grids import latent_valid, padding_share, real_tokens
from flexpack.packing.layout import PAD, SequenceLayout
from flexpack.run.root import ForwardOptions
from flexpack.tools.verify import verify_batch
from test_blockmask import assert_same_block_mask
from test_verify import items, model

registry.family("lingbot-va")  # the "lingbot" mask registers with its family

pytestmark = pytest.mark.usefixtures("one_thread")

GRID = (4, 6)  # latent grid of the run; the tiny WanVA's patch is 2x2, so 2x3 patches a frame
SMALL = {1: (2, 6), 3: (4, 2)}  # items of smaller grids: a height and a width padding


def mixed_items(lengths=(5, 3, 7, 2), seed=0):
    out = items(list(lengths), seed)
    g = torch.Generator().manual_seed(seed + 1)
    for i, (h, w) in SMALL.items():
        out[i]["latent"] = torch.randn(4, lengths[i], h, w, generator=g)
    return out


def test_a_padded_episode_keeps_its_tokens_and_positions_alone() -> None:
    """Episode 0 (latent 4x2: patches 2x1) in frames of 4x6 (2x3): its slots hold patches 0 and 3 (column 0),
    then padding; its tokens (doc 0) are, in order, exactly those of the episode alone at its own grid."""
    sl = SequenceLayout.from_rows([[3, 2]], 7, grid_hw=GRID, episode_hw=[(4, 2), GRID])
    lay = sl.tokens(6, 1, copies=2, grid_hw=(2, 3))
    alone = SequenceLayout.from_rows([[3]], 3).tokens(2, 1, copies=2, grid_hw=(2, 1))
    assert lay.video_slot[0, 0].tolist() == [0, 3, 1, 2, 4, 5]
    assert lay.video_slot[0, 4].tolist() == list(range(6))  # episode 1 fills the grid
    mine, its = lay.doc == 0, alone.doc == 0
    for key in ("frame", "stream", "copy", "hpos", "wpos"):
        assert torch.equal(getattr(lay, key)[mine], getattr(alone, key)[its]), key
    assert int((lay.doc == PAD).sum()) == 3 * 2 * 4 + 2 * 2 * 7  # 4 padding slots a frame and copy + 2 pad frames
    assert int((lay.doc == 1).sum()) == 2 * 2 * 7 and lay.spatial
    assert real_tokens(sl, 7, 6) == 3 * (2 + 1) + 2 * 7


def test_collate_places_items_top_left_and_refuses_what_does_not_fit() -> None:
    its = mixed_items()
    batch = PackCollate(20, grid=GRID)(its)
    assert batch.latent.shape == (1, 4, 20, *GRID)
    assert batch.layout.episode_hw.tolist() == [[4, 6], [2, 6], [4, 6], [4, 2]]
    lat3 = batch.latent[0, :, 15:17]
    assert torch.equal(lat3[..., :4, :2], its[3]["latent"]) and not lat3[..., 2:].any()
    valid = latent_valid(batch.layout)
    assert int(valid.sum()) == 5 * 24 + 3 * 12 + 7 * 24 + 2 * 8
    assert padding_share([5, 3, 7, 2], [(4, 6), (2, 6), (4, 6), (4, 2)], GRID) == pytest.approx(1 - 340 / 408)
    pad = PadCollate(4, grid=GRID)(its)
    assert pad.latent.shape == (4, 4, 8, *GRID) and torch.equal(pad.latent[1, :, :3, :2], its[1]["latent"])
    with pytest.raises(ValueError, match=r"^item 1 \(episode 1\): latent \(C,H,W\)=\(4, 2, 6\) differs"):
        PackCollate(20)(its)  # without the run's grid, grids must agree as before
    its[2]["latent"] = torch.randn(3, 7, 4, 6)
    with pytest.raises(ValueError, match=r"^item 2 \(episode 2\): latent \(C,H,W\)=\(3, 4, 6\) does not fit the "
                                         r"run's grid \(C,H,W\)=\(4, 4, 6\)$"):
        PackCollate(20, grid=GRID)(its)


CASES = {
    "pack": (PackCollate(20, grid=GRID), FlowMatchingConfig(), ForwardOptions()),
    "pad": (PadCollate(4, grid=GRID), FlowMatchingConfig(weighting="bell", action_weight=0.5), ForwardOptions()),
    "pack-teacher-forcing": (PackCollate(20, grid=GRID), FlowMatchingConfig(teacher_forcing=True, chunk_size=2),
                             ForwardOptions(mask="teacher_forcing", chunk_size=2)),
}


@pytest.mark.parametrize("case", CASES)
def test_mixed_grids_packed_equal_each_episode_alone_at_its_grid(case) -> None:
    collate, cfg, kw = CASES[case]
    its = mixed_items()
    assert len({tuple(it["latent"].shape[2:]) for it in its}) == 3
    report = verify_batch(model(), its, collate, cfg, seed=4, forward=kw)
    print(report.table())
    assert report.ok and report.max_err < 1e-5
    assert [r.frames for r in report.rows] == [5, 3, 7, 2]


def test_padding_that_leaks_into_attention_fails_verify(monkeypatch) -> None:
    """The same check with padding tokens left in their episode (a mask that lets real queries see them)."""
    spatial = layout_mod._spatial

    def leaky(host, video_index, grid_hw, doc, hpos, wpos):
        kept = doc.clone()
        slot = spatial(host, video_index, grid_hw, doc, hpos, wpos)
        doc.copy_(kept)
        return slot

    monkeypatch.setattr(layout_mod, "_spatial", leaky)
    collate, cfg, kw = CASES["pack"]
    report = verify_batch(model(), mixed_items(), collate, cfg, seed=4, forward=kw)
    assert not report.ok and report.max_err > 1e-3


def test_one_grid_items_give_the_outputs_of_a_collate_without_a_grid() -> None:
    """Items that all fill the run's grid go through the spatial path unchanged: same outputs as today's."""
    its = items([5, 3, 7, 2])
    m = model()
    t = torch.full((1, 20), 500.0)
    with torch.no_grad():
        outs = [m(PackCollate(20, grid=g)(its), timestep=t) for g in (None, GRID)]
    assert torch.equal(outs[0].video, outs[1].video) and torch.equal(outs[0].action, outs[1].action)


def spatial_layout(rng: random.Random, copies: int, actions: int):
    lens = [rng.randint(1, 9) for _ in range(rng.randint(1, 8))]
    hw = [rng.choice([GRID, (2, 6), (4, 2), (2, 2), (2, 4)]) for _ in lens]
    sl = SequenceLayout.from_rows([lens], sum(lens) + rng.randint(0, 5), text_len=[rng.randint(0, 5) for _ in lens],
                                  grid_hw=GRID, episode_hw=hw)
    return sl.tokens(6, actions, copies=copies, grid_hw=(2, 3))


KINDS = {"document": {}, "valid": {}, "chunk_causal": {"chunk_size": 2},
         "teacher_forcing": {"chunk_size": 2, "window": 1}, "text": {"text_tokens": 5},
         "lingbot": {"chunk_size": 2, "window": 3}}


@pytest.mark.parametrize("kind", KINDS)
def test_block_masks_over_spatial_padding_equal_create_block_mask(kind) -> None:
    """The segment builder on the fixed (shape-only) grid and on the host bounds gives create_block_mask's block
    mask, and the mask_mod the kernels run equals the mask; padding tokens see nothing and nothing sees them."""
    rng = random.Random(len(kind))
    for trial in range(8):
        copies = 1 if kind == "chunk_causal" else (2 if kind in ("lingbot", "teacher_forcing") else rng.choice([1, 2]))
        lay = spatial_layout(rng, copies, rng.choice([0, 2]) if kind != "lingbot" else 2)
        for fixed in (False, True):
            attn = FlexAttnFunc("flex", compile_block_mask=False, fixed_segments=fixed)
            prep = attn.prepare(lay, kind, **KINDS[kind])
            want = create_block_mask(prep.mask_mod, 1, 1, prep.q_len, prep.kv_len, device="cpu")
            assert_same_block_mask(prep.block_mask(), want)
            dense = dense_mask(prep.mask_mod, prep.q_len, prep.kv_len)
            assert dense_mask(prep.block_mask().mask_mod, prep.q_len, prep.kv_len).equal(dense), (trial, fixed)
        pad = lay.doc == PAD
        assert not dense[pad].any()
        if kind != "text":
            assert not dense[:, pad].any()


def test_one_segment_grid_for_every_mix_of_grids() -> None:
    """Packs of one shape holding different mixes of grids get one segment grid (one builder signature, no
    compile for a new mix) and one token count."""
    attn = FlexAttnFunc("flex", compile_block_mask=False, fixed_segments=True)
    mixes = [[GRID] * 3, [(2, 2), GRID, (4, 2)], [(2, 6)] * 3]
    lays = [SequenceLayout.from_rows([[4, 5, 3]], 14, text_len=[2] * 3, grid_hw=GRID, episode_hw=m)
            .tokens(6, 2, copies=2, grid_hw=(2, 3)) for m in mixes]
    for kind in ("lingbot", "document"):
        kw = KINDS[kind]
        assert len({attn.prepare(lay, kind, **kw).segment_bounds() for lay in lays}) == 1
    assert len({lay.num_tokens for lay in lays}) == 1


@pytest.mark.slow  # compiles FlexAttention for the CPU (~30 s)
def test_flex_forward_gives_zeros_for_padding_and_the_dense_values_elsewhere() -> None:
    """FlexAttention (CPU forward) over a spatial layout: finite everywhere, zeros on padding queries, the dense
    backend's values on real ones."""
    lay = spatial_layout(random.Random(3), 2, 2)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, lay.num_tokens, 16, generator=g) for _ in range(3))
    kw = KINDS["lingbot"]
    flex = FlexAttnFunc("flex", compile_block_mask=False)(q, k, v, lay, "lingbot", **kw)
    dense = FlexAttnFunc("dense")(q, k, v, lay, "lingbot", **kw)
    assert torch.isfinite(flex).all() and torch.isfinite(dense).all()
    pad = lay.doc == PAD
    assert not flex[:, :, pad].any() and not dense[:, :, pad].any()
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


def test_episode_run_backends_refuse_spatial_padding() -> None:
    lay = spatial_layout(random.Random(1), 1, 0)
    q = torch.randn(1, 1, lay.num_tokens, 8)
    with pytest.raises(ValueError, match="^backend 'sdpa-loop' cannot skip spatial padding"):
        FlexAttnFunc("sdpa-loop")(q, q, q, lay, "document")


def test_useful_flops_count_each_episode_at_its_own_grid() -> None:
    """Spatial padding is no useful work: a padded pack's FLOPs are its episodes' FLOPs alone at their grids."""
    from flexpack.models import wan_config
    from flexpack.training.observe.flops import useful_flops

    cfg = wan_config("tiny")
    sl = SequenceLayout.from_rows([[3, 2]], 7, text_len=[4, 4], grid_hw=GRID, episode_hw=[(2, 6), GRID])
    kw = dict(action_tokens=2, copies=2)
    packed = useful_flops(cfg, sl, video_tokens=6, **kw)
    alone = useful_flops(cfg, [3], 4, video_tokens=3, **kw) + useful_flops(cfg, [2], 4, video_tokens=6, **kw)
    assert packed == alone and packed < useful_flops(cfg, [3, 2], 4, video_tokens=6, **kw)
