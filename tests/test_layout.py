"""SequenceLayout / TokenLayout: token order, contiguity, positions, HF helpers."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpack.packing.layout import ACTION, CLEAN, NOISY, VIDEO, SequenceLayout, cu_seqlens_from_position_ids

rows_strategy = st.lists(st.lists(st.integers(1, 9), min_size=0, max_size=4), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(rows=rows_strategy, extra=st.integers(0, 5), nv=st.integers(0, 4), na=st.integers(0, 3),
       copies=st.sampled_from([1, 2]))
def test_token_layout_invariants(rows, extra, nv, na, copies):
    if nv + na == 0:
        nv = 1
    fr = max([sum(r) for r in rows] + [1]) + extra
    lay = SequenceLayout.from_rows(rows, fr)
    tl = lay.tokens(nv, na, copies=copies)
    T = len(rows) * fr * (nv + na) * copies
    assert tl.num_tokens == T
    # the two gather maps cover every token exactly once
    allpos = torch.cat([tl.video_index.reshape(-1), tl.action_index.reshape(-1)])
    assert torch.equal(allpos.sort().values, torch.arange(T))
    # the K tokens of one (copy, row, frame) form one contiguous unit (the model relies on it)
    K = nv + na
    unit = torch.cat([tl.video_index, tl.action_index], dim=-1)
    assert torch.equal(unit, (unit[..., :1] // K) * K + torch.arange(K))
    # every token carries the identity of the (copy, row, frame) it was mapped from
    for index, stream in ((tl.video_index, VIDEO), (tl.action_index, ACTION)):
        if index.numel() == 0:
            continue
        c, r, f, _ = torch.meshgrid(*(torch.arange(n) for n in index.shape), indexing="ij")
        assert torch.equal(tl.doc[index], lay.frame_doc[r, f])
        assert torch.equal(tl.frame[index], lay.frame_pos[r, f])
        assert torch.equal(tl.copy[index], c)
        assert bool((tl.stream[index] == stream).all())
    # each episode is one contiguous run: noisy copy first, frames ascending, video before action
    E = sum(len(r) for r in rows)
    assert lay.num_episodes == E
    for e in range(E):
        run = torch.arange(int(tl.doc_start[e]), int(tl.doc_start[e] + tl.doc_len[e]))
        assert bool((tl.doc[run] == e).all())
        assert int((tl.doc == e).sum()) == len(run) == int(lay.episode_frames[e]) * (nv + na) * copies
        key = tl.copy[run] * 10_000 + tl.frame[run] * 10 + tl.stream[run]
        assert bool((key[1:] >= key[:-1]).all())


def test_small_layout_exact():
    lay = SequenceLayout.from_rows([[2, 1], [3]], 4, episode_index=[5, 6, 7])
    assert lay.frame_doc.tolist() == [[0, 0, 1, -1], [2, 2, 2, -1]]
    assert lay.frame_pos.tolist() == [[0, 1, 0, 0], [0, 1, 2, 0]]
    tl = lay.tokens(2, 1, copies=2, grid_hw=(1, 2))
    # row 0: ep0 noisy f0,f1 | ep0 clean f0,f1 | ep1 noisy | ep1 clean | pad noisy | pad clean
    assert tl.doc[:24].tolist() == [0] * 12 + [1] * 6 + [-1] * 6
    assert tl.copy[:12].tolist() == [NOISY] * 6 + [CLEAN] * 6
    assert tl.frame[:6].tolist() == [0, 0, 0, 1, 1, 1]
    assert tl.stream[:3].tolist() == [VIDEO, VIDEO, ACTION]
    assert tl.wpos[:3].tolist() == [0, 1, 0]
    assert tl.doc_start.tolist() == [0, 12, 24] and tl.doc_len.tolist() == [12, 6, 18]


def test_from_lengths_and_cu_seqlens():
    lay = SequenceLayout.from_lengths([3, 5, 2], pad_to=12)
    tl = lay.tokens()
    assert tl.doc.tolist() == [0] * 3 + [1] * 5 + [2] * 2 + [-1] * 2
    assert lay.cu_seqlens.tolist() == [0, 3, 8, 10]
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]])
    assert cu_seqlens_from_position_ids(pos).tolist() == [0, 3, 5, 6, 10]
    with pytest.raises(ValueError, match="start at 0"):
        cu_seqlens_from_position_ids(torch.tensor([1, 2, 0]))
    with pytest.raises(ValueError, match="not contiguous"):
        SequenceLayout.from_rows([[2], [2]], 4).cu_seqlens


def test_text_doc():
    lay = SequenceLayout.from_rows([[2, 1]], 4, text_len=[2, 0])
    assert lay.tokens().text_doc(3).tolist() == [0, 0, -1, -1, -1, -1]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rows=[[3, 3]], frames_per_row=5), "more than frames_per_row"),
        (dict(rows=[[0]], frames_per_row=5), "non-positive length 0"),
        (dict(rows=[], frames_per_row=5), "at least one row"),
        (dict(rows=[[1]], frames_per_row=0), "frames_per_row must be positive"),
        (dict(rows=[[1, 2]], frames_per_row=5, episode_index=[1]), "need 2 entries"),
    ],
)
def test_bad_layouts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SequenceLayout.from_rows(**kwargs)


def test_bad_token_expansion():
    lay = SequenceLayout.from_lengths([2])
    with pytest.raises(ValueError, match="copies"):
        lay.tokens(copies=3)
    with pytest.raises(ValueError, match="grid_hw"):
        lay.tokens(4, grid_hw=(3, 1))
    with pytest.raises(ValueError, match="pad_to"):
        SequenceLayout.from_lengths([5], pad_to=3)
