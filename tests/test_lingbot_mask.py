"""LingBot-VA's training mask: equal to LeRobot's ``FlexAttnFunc`` mask per clip, block-diagonal over
packed episodes, built by flexpack's block-mask builder equal to create_block_mask's, and chunk size /
window as data (changing them compiles nothing)."""

from __future__ import annotations

import random

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from flexpack.attention import flex
from flexpack.attention.blockmask import fast_block_mask
from flexpack.attention.masks import dense_mask, make_mask
from flexpack.attention.segments import num_segments
from flexpack.families.lingbot.mask import lingbot_mask
from flexpack.packing.layout import SequenceLayout, TokenLayout
from lingbot_ref import LU, eager_flex
from test_blockmask import assert_same_block_mask


def lerobot_dense(B: int, F: int, hw: tuple[int, int], A: int, chunk: int, window: int) -> tuple[torch.Tensor, int]:
    """LeRobot's self-attention mask for B clips of F latent frames (h*w patches, A action steps),
    as its ``init_mask`` builds it, evaluated on every token pair; and the real (unpadded) length."""
    h, w = hw
    lat_shape, act_shape = (B, 4, F, 2 * h, 2 * w), (B, 7, F, A, 1)
    real = 2 * B * F * (h * w + A)
    LU.FlexAttnFunc.init_mask(lat_shape, act_shape, (128 - real % 128) % 128, chunk, window, (1, 2, 2), "cpu")
    mod = LU.FlexAttnFunc.attention_mask.mask_mod
    return dense_mask(mod, real + (128 - real % 128) % 128, real + (128 - real % 128) % 128, "cpu"), real


def lerobot_order(tl: TokenLayout, frames: int) -> torch.Tensor:
    """flexpack token index of each of LeRobot's tokens: [noisy latent, clean latent, noisy action,
    clean action], each clip by clip, frame by frame (the first ``frames`` frames of every row)."""
    v, a = tl.video_index[:, :, :frames], tl.action_index[:, :, :frames]
    return torch.cat([v[0].flatten(), v[1].flatten(), a[0].flatten(), a[1].flatten()])


@pytest.mark.parametrize("B,F,hw,A", [(1, 7, (1, 3), 2), (2, 5, (2, 1), 4), (3, 4, (1, 1), 4)])
def test_mask_equals_lerobots_per_clip(monkeypatch, B, F, hw, A) -> None:
    """Clips in pad rows and packed into one row (with a padding tail): after the token permutation the
    mask is LeRobot's for every chunk size and window; padding attends nothing and is seen by nothing."""
    eager_flex(monkeypatch)
    rows = {"pad": SequenceLayout.from_rows([[F]] * B, F, mode="pad"),
            "pack": SequenceLayout.from_rows([[F] * B], F * B + 2)}
    for chunk in (1, 2, 3, 4):
        for window in (0, 1, 4, 7, 64):
            want, real = lerobot_dense(B, F, hw, A, chunk, window)
            assert not want[real:].any() and not want[:, real:].any()  # LeRobot's padding
            for mode, sl in rows.items():
                tl = sl.tokens(hw[0] * hw[1], A, copies=2, grid_hw=hw)
                got = dense_mask(make_mask(tl, "lingbot", chunk_size=chunk, window=window), tl.num_tokens,
                                 tl.num_tokens)
                perm = lerobot_order(tl, F if mode == "pad" else F * B)
                assert got[perm][:, perm].equal(want[:real, :real]), (mode, chunk, window)
                rest = torch.ones(tl.num_tokens, dtype=torch.bool)
                rest[perm] = False
                assert rest.any() == (mode == "pack") and not got[rest].any() and not got[:, rest].any()


def test_mask_pinned_on_one_frame_pair() -> None:
    """One episode of 2 frames, 1 video + 1 action token per frame, chunk 1: the pinned pattern,
    including 'noisy action sees the clean video of its own frame' and the window in block ids."""
    tl = SequenceLayout.from_rows([[2]], 2).tokens(1, 1, copies=2)
    # tokens: noisy v0 a0 v1 a1, clean v0 a0 v1 a1; block ids 0 1 2 3 | 0 1 2 3
    rows = dense_mask(lingbot_mask(tl, 1, 64), 8, 8).int().tolist()
    assert rows == [
        [1, 0, 0, 0, 0, 0, 0, 0],  # noisy v0: itself
        [0, 1, 0, 0, 1, 0, 0, 0],  # noisy a0: itself + clean v0 (earlier block id)
        [0, 0, 1, 0, 1, 1, 0, 0],  # noisy v1: itself + clean v0, a0
        [0, 0, 0, 1, 1, 1, 1, 0],  # noisy a1: itself + clean v0, a0, v1
        [0, 0, 0, 0, 1, 0, 0, 0],  # clean v0: itself
        [0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 1, 1, 1, 1],
    ]
    near = dense_mask(lingbot_mask(tl, 1, 1), 8, 8).int().tolist()  # |Δ block id| <= 1
    assert near[3] == [0, 0, 0, 1, 0, 0, 1, 0] and near[7] == [0, 0, 0, 0, 0, 0, 1, 1]


def test_packed_mask_is_the_episodes_masks_block_diagonally() -> None:
    """Each episode with its own chunk size and window: the packed mask is, on every episode's token
    run, the mask that episode gets alone, and False everywhere else (other episodes, padding)."""
    lens, chunks, windows = [3, 5, 2, 4], [1, 3, 2, 4], [4, 1, 0, 64]
    tl = SequenceLayout.from_rows([lens], sum(lens) + 3).tokens(2, 3, copies=2, grid_hw=(1, 2))
    got = dense_mask(lingbot_mask(tl, torch.tensor(chunks), torch.tensor(windows)), tl.num_tokens, tl.num_tokens)
    expect = torch.zeros_like(got)
    for e, n in enumerate(lens):
        alone = SequenceLayout.from_rows([[n]], n).tokens(2, 3, copies=2, grid_hw=(1, 2))
        s, m = int(tl.doc_start[e]), int(tl.doc_len[e])
        expect[s:s + m, s:s + m] = dense_mask(lingbot_mask(alone, chunks[e], windows[e]), m, m)
    assert got.equal(expect)
    assert not got.equal(dense_mask(lingbot_mask(tl, 2, 4), tl.num_tokens, tl.num_tokens))  # the values matter


def random_layout(rng: random.Random) -> tuple[TokenLayout, torch.Tensor, torch.Tensor]:
    E = rng.randint(1, 6)
    lens = [rng.randint(1, 14) for _ in range(E)]
    nv, na = rng.choice([(1, 4), (3, 2), (4, 0), (2, 1)])
    if rng.random() < 0.3:
        sl = SequenceLayout.from_rows([[n] for n in lens], max(lens) + rng.randint(0, 2), mode="pad")
    else:
        sl = SequenceLayout.from_rows([lens], sum(lens) + rng.randint(0, 5))
    chunk = torch.tensor([rng.randint(1, 4) for _ in lens])
    window = torch.tensor([rng.randint(0, 12) for _ in lens])
    return sl.tokens(nv, na, copies=2), chunk, window


def test_block_mask_from_segments_equals_create_block_mask() -> None:
    """flexpack's builder (exact and host-bounded segment counts, through FlexAttnFunc.prepare) gives
    create_block_mask's block mask, its mask_mod is the mask's own (no range bound), and the host
    bounds cover the real segment counts, which do not depend on the chunk size."""
    rng = random.Random(0)
    attn = flex.FlexAttnFunc("flex", compile_block_mask=False)
    for trial in range(16):
        tl, chunk, window = random_layout(rng)
        mod = lingbot_mask(tl, chunk, window)
        T = tl.num_tokens
        want = create_block_mask(mod, 1, 1, T, T, device="cpu")
        assert_same_block_mask(fast_block_mask(mod, T, T), want)
        prep = attn.prepare(tl, "lingbot", chunk_size=chunk, window=window)
        assert_same_block_mask(prep.block_mask(), want)
        assert prep.block_mask().mask_mod is prep.mask_mod and mod.runs is None
        with attn.fixed_segment_bounds():
            assert_same_block_mask(attn.prepare(tl, "lingbot", chunk_size=chunk, window=window).block_mask(), want)
        per_frame = lingbot_mask(tl, 1, 0)  # the most segments any chunk size gives
        real, most = num_segments(mod.q_keys), num_segments(per_frame.q_keys)
        assert real <= most <= mod.segments[0] <= most + 1, (trial, real, most, mod.segments)
        assert per_frame.segments == mod.segments  # whatever the chunk size


def test_chunk_and_window_are_checked() -> None:
    tl = SequenceLayout.from_rows([[3, 2]], 6).tokens(1, 1, copies=2)
    for kw, match in (({"chunk_size": 0, "window": 4}, "chunk_size must be an int >= 1"),
                      ({"chunk_size": 2, "window": -1}, "window must be an int >= 0"),
                      ({"chunk_size": torch.tensor([1, 0]), "window": 4}, r"chunk_size values must be >= 1"),
                      ({"chunk_size": torch.tensor([1, 2, 3]), "window": 4}, r"\(E,\)=\(2,\)"),
                      ({"chunk_size": 2}, "needs chunk_size and window")):
        with pytest.raises(ValueError, match=match):
            make_mask(tl, "lingbot", **kw)
    with pytest.raises(TypeError, match="token layout"):  # frames do not say which copy a token is
        flex.FlexAttnFunc("dense")(*[torch.zeros(1, 1, 12, 8)] * 3, tl.frames, mask="lingbot", chunk_size=1, window=4)


class _Counting(flex.GraphCounter):
    """Counts dynamo graphs and runs them eagerly (no inductor: fast on the CPU)."""

    def backend(self, gm, example_inputs):
        self.n += 1
        return gm.forward


def test_changing_chunk_and_window_compiles_nothing(monkeypatch) -> None:
    """The compiled block-mask builder and the compiled FlexAttention call of FlexAttnFunc compile once for
    a layout shape; masks with other chunk sizes and windows (ints or per episode) reuse both graphs
    and give create_block_mask's block mask and the dense attention's output."""
    counter = _Counting()
    monkeypatch.setattr(flex, "_COUNTER", counter)
    monkeypatch.setattr(flex, "_COMPILED", {})
    attn = flex.FlexAttnFunc("flex", compile_block_mask=True, graph_block_mask=False)
    dense = flex.FlexAttnFunc("dense")
    tl = SequenceLayout.from_rows([[5, 3, 4]], 14).tokens(2, 3, copies=2)
    T = tl.num_tokens
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, T, 8, generator=g) for _ in range(3))
    settings = [(1, 4), (3, 4), (2, 17), (torch.tensor([1, 4, 2]), torch.tensor([4, 9, 0])), (4, 64)]
    counts, outs = [], []
    for chunk, window in settings:
        prep = attn.prepare(tl, "lingbot", chunk_size=chunk, window=window)
        assert_same_block_mask(prep.block_mask(), create_block_mask(prep.mask_mod, 1, 1, T, T, device="cpu"))
        with torch.no_grad():
            out = attn(q, k, v, prep)
            ref = dense(q, k, v, dense.prepare(tl, "lingbot", chunk_size=chunk, window=window))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        outs.append(out)
        counts.append(counter.n)
    assert counts[0] == 2 and counts[-1] == 2, counts  # one builder graph + one FlexAttention graph
    assert len(attn._builder(torch.device("cpu"))._compiled) == 1  # one builder signature
    assert not outs[0].equal(outs[1])  # the settings did change the attention
    # a layout of another shape is a new signature: the counter does see new graphs
    other = SequenceLayout.from_rows([[5, 3, 4]], 16).tokens(2, 3, copies=2)
    attn.prepare(other, "lingbot", chunk_size=2, window=4).block_mask()
    assert counter.n == 3
