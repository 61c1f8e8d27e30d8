"""Pad and pack collates: values land where the layout says; both modes describe the same tokens."""

import dataclasses

import pytest
import torch

from flexpack.packing.collate import PackCollate, PadCollate
from flexpack.packing.layout import cu_seqlens_from_position_ids

C, H, W, CA, A, DT = 3, 2, 4, 5, 4, 6


def make_item(ep: int, frames: int, text_len: int = 3, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(1000 * ep + seed)
    mask = torch.ones(CA, frames, A, dtype=torch.bool)
    mask[CA - 1] = False  # an action channel this dataset does not have
    mask[:, 0, 1:] = False  # first latent frame covers one video frame only
    return {
        "latent": torch.randn(C, frames, H, W, generator=g) + 1.0,  # never zero: pad detection below
        "action": torch.randn(CA, frames, A, generator=g) + 1.0,
        "action_mask": mask,
        "text": torch.randn(text_len + 2, DT, generator=g),
        "text_len": text_len,
        "episode_index": ep,
    }


ITEMS = [make_item(10, 7, 2), make_item(11, 3, 4), make_item(12, 12, 1), make_item(13, 1, 3)]


@pytest.mark.parametrize("collate", [PadCollate(pad_multiple=4), PackCollate(frame_budget=30)])
def test_values_land_where_layout_says(collate):
    batch = collate(ITEMS)
    lay = batch.layout
    by_ep = {it["episode_index"]: it for it in ITEMS}
    R, Fr = lay.frame_doc.shape
    for r in range(R):
        for f in range(Fr):
            slot = int(lay.frame_doc[r, f])
            if slot < 0:  # padding frames are zero and fully masked
                assert torch.count_nonzero(batch.latent[r, :, f]) == 0
                assert torch.count_nonzero(batch.action[r, :, f]) == 0
                assert not batch.action_mask[r, :, f].any()
                continue
            item = by_ep[int(lay.episode_index[slot])]
            pos = int(lay.frame_pos[r, f])
            torch.testing.assert_close(batch.latent[r, :, f], item["latent"][:, pos], rtol=0, atol=0)
            m = item["action_mask"][:, pos]
            assert torch.equal(batch.action_mask[r, :, f], m)
            torch.testing.assert_close(batch.action[r, :, f][m], item["action"][:, pos][m], rtol=0, atol=0)
            assert torch.count_nonzero(batch.action[r, :, f][~m]) == 0
    # every item's frames are present exactly once
    assert int(lay.frame_valid.sum()) == sum(it["latent"].shape[1] for it in ITEMS)
    assert lay.valid_frames.tolist() == [it["latent"].shape[1] for it in ITEMS]
    # text: padded to the longest, zero beyond text_len
    assert batch.text.shape == (4, max(it["text"].shape[0] for it in ITEMS), DT)
    for e, it in enumerate(ITEMS):
        n = it["text_len"]
        assert int(lay.text_len[e]) == n
        torch.testing.assert_close(batch.text[e, :n], it["text"][:n])
        assert torch.count_nonzero(batch.text[e, n:]) == 0


def test_pad_mode_shapes_and_doc_ids():
    batch = PadCollate(pad_multiple=8)(ITEMS)
    assert batch.latent.shape == (4, C, 16, H, W)  # max F 12 rounded up to 16
    assert batch.action.shape == (4, CA, 16, A)
    assert batch.valid_frames.tolist() == [7, 3, 12, 1]
    assert batch.doc_ids[1].tolist() == [1, 1, 1] + [-1] * 13
    assert batch.layout.mode == "pad"


def test_pack_mode_one_shape_cu_seqlens_and_positions():
    collate = PackCollate.from_token_budget(max_tokens=36 * 30, tokens_per_frame=36)
    assert collate.frame_budget == 30
    b1, b2 = collate(ITEMS), collate(ITEMS[:2])
    assert b1.latent.shape == b2.latent.shape == (1, C, 30, H, W)
    assert b1.cu_seqlens.tolist() == [0, 7, 10, 22, 23]
    assert b1.doc_ids[0].tolist() == [0] * 7 + [1] * 3 + [2] * 12 + [3] + [-1] * 7
    assert b1.layout.frame_pos[0, :11].tolist() == list(range(7)) + [0, 1, 2, 0]
    ex = b1.hf_packing_kwargs(36)  # HF-style keys count tokens: 36 per frame, the padding tail not a sequence
    assert ex["position_ids"].shape == (1, 30 * 36)
    assert ex["position_ids"][0, 250:254].tolist() == [250, 251, 0, 1]  # episode 0 ends after 7 * 36
    assert ex["cu_seq_lens_q"].tolist() == [0, 252, 360, 792, 828]
    assert ex["max_length_q"] == 12 * 36
    assert ex["seq_idx"][0].tolist() == [0] * 252 + [1] * 108 + [2] * 432 + [3] * 36 + [4] * 252
    assert torch.equal(cu_seqlens_from_position_ids(ex["position_ids"], valid_tokens=828), ex["cu_seq_lens_k"])
    # without valid_tokens the restarting tail is one more sequence (a cover of all T tokens)
    assert cu_seqlens_from_position_ids(ex["position_ids"]).tolist() == [0, 252, 360, 792, 828, 1080]


def test_pad_and_pack_layouts_describe_the_same_tokens():
    pad, pack = PadCollate(pad_multiple=8)(ITEMS), PackCollate(frame_budget=24)(ITEMS)

    def token_records(batch, copies):
        tl = batch.layout.tokens(H * W // 4, A, copies=copies, grid_hw=(H // 2, W // 2))
        # gather each valid token's identity and its latent frame's content
        recs = []
        patches = batch.latent.mean(dim=(1, 3, 4))  # (R, Fr) a per-frame fingerprint
        for c in range(copies):
            for r in range(batch.latent.shape[0]):
                for f in range(batch.latent.shape[2]):
                    for j, t in enumerate(tl.video_index[c, r, f].tolist()):
                        d = int(tl.doc[t])
                        if d < 0:
                            continue
                        ep = int(batch.layout.episode_index[d])
                        recs.append((ep, int(tl.frame[t]), int(tl.copy[t]), int(tl.stream[t]), int(tl.hpos[t]),
                                     int(tl.wpos[t]), round(float(patches[r, f]), 5)))
        n_action = int(((tl.stream == 1) & (tl.doc >= 0)).sum())
        return sorted(recs), n_action

    for copies in (1, 2):
        recs_pad, recs_pack = token_records(pad, copies), token_records(pack, copies)
        assert len(recs_pad[0]) == copies * sum(it["latent"].shape[1] for it in ITEMS) * H * W // 4
        assert recs_pad == recs_pack


def test_pack_crop_and_overflow_errors():
    with pytest.raises(ValueError, match=r"episode 12 \(12 frames\)"):
        PackCollate(frame_budget=20)(ITEMS)
    cropped = PackCollate(frame_budget=5, crop=True)([ITEMS[2]])
    assert cropped.layout.valid_frames.tolist() == [5]
    torch.testing.assert_close(cropped.latent[0], ITEMS[2]["latent"][:, :5])


def test_bad_items_name_the_episode():
    bad = dict(make_item(42, 4))
    bad["latent"] = torch.zeros(C, 4, H + 1, W)
    with pytest.raises(ValueError, match="episode 42"):
        PadCollate()([ITEMS[0], bad])
    bad = dict(make_item(43, 4))
    bad["action"] = torch.zeros(CA, 5, A)
    with pytest.raises(ValueError, match="episode 43.*5 frames"):
        PackCollate(64)([bad])
    with pytest.raises(ValueError, match="empty"):
        PadCollate()([])
    with pytest.raises(ValueError, match="pad_multiple"):
        PadCollate(pad_multiple=0)
    with pytest.raises(ValueError, match="frame_budget"):
        PackCollate(frame_budget=-1)


def test_batch_to_moves_layout():
    b = PackCollate(30)(ITEMS).to("meta")
    assert b.latent.device.type == "meta" and b.layout.frame_doc.device.type == "meta"
    assert {f.name for f in dataclasses.fields(b)} == {"latent", "action", "action_mask", "text", "layout",
                                                       "tokens_per_frame"}


def _hf_items(frames: list[int]) -> list[dict]:
    return [dict(latent=torch.zeros(C, f, H, W), episode_index=i) for i, f in enumerate(frames)]


def test_hf_packing_keys_in_tokens_pinned():
    # F = 3, 5, 2 at 2 tokens per frame, budget 12 frames: transformers' DataCollatorWithFlattening
    # on sequences of 6, 10, 4 tokens gives exactly these cu_seq_lens, max_length and positions
    b = PackCollate.from_token_budget(24, tokens_per_frame=2)(_hf_items([3, 5, 2]))
    ex = b.hf_packing_kwargs(2)
    assert ex["cu_seq_lens_q"].tolist() == ex["cu_seq_lens_k"].tolist() == [0, 6, 16, 20]
    assert ex["cu_seq_lens_q"].dtype == torch.int32
    assert ex["max_length_q"] == ex["max_length_k"] == 10
    assert ex["position_ids"][0].tolist() == list(range(6)) + list(range(10)) + list(range(4)) + [0, 1, 2, 3]
    assert ex["seq_idx"][0].tolist() == [0] * 6 + [1] * 10 + [2] * 4 + [3] * 4
    # a full budget has no tail
    full = PackCollate(10)(_hf_items([3, 5, 2])).hf_packing_kwargs(2)
    assert full["cu_seq_lens_q"].tolist() == [0, 6, 16, 20] and full["position_ids"].shape == (1, 20)
    assert cu_seqlens_from_position_ids(full["position_ids"]).tolist() == [0, 6, 16, 20]
    with pytest.raises(ValueError, match="inside a sequence"):
        cu_seqlens_from_position_ids(ex["position_ids"], valid_tokens=19)


@pytest.mark.parametrize("frames,tpf", [([3, 5, 2], 2), ([7, 1, 4, 2], 5), ([9], 3)])
def test_hf_packing_keys_match_transformers_flattening_collator(frames, tpf):
    hf = pytest.importorskip("transformers")
    collator = hf.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    want = collator([{"input_ids": list(range(100, 100 + f * tpf))} for f in frames])
    got = PackCollate(sum(frames) + 3)(_hf_items(frames)).hf_packing_kwargs(tpf)
    n = int(want["cu_seq_lens_q"][-1])
    assert torch.equal(got["position_ids"][:, :n], want["position_ids"])
    assert torch.equal(got["seq_idx"][:, :n], want["seq_idx"].to(torch.int32))
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert got[key].tolist() == want[key].tolist() and got[key].dtype == want[key].dtype
    assert got["max_length_q"] == int(want["max_length_q"]) and got["max_length_k"] == int(want["max_length_k"])
