"""The one layout object: where every frame and token of a micro-batch comes from.

A micro-batch is a grid of ``R`` rows × ``Fr`` latent frames (pad mode: one episode per row,
``Fr = F_pad``; pack mode: one row holding several episodes back to back, ``Fr`` = frame budget).
:class:`SequenceLayout` describes that grid per frame; :meth:`SequenceLayout.tokens` expands it
into a :class:`TokenLayout`, the flat token sequence the model attends over. Masks, RoPE
positions and loss masks are all derived from these two objects; nothing is inferred from
position ids.

Token order (fixed, so every episode is one contiguous token run and document masks are
block-sparse): rows one after another; inside a row, runs of consecutive frames that belong to
the same episode (or to padding) one after another; inside a run, copy by copy (noisy, then
clean when ``copies == 2``), frame by frame, and inside a frame ``video_tokens`` video tokens
(row-major over the ``(h, w)`` patch grid) followed by ``action_tokens`` action tokens. Where episodes of
smaller latent grids share the batch's (``episode_hw``, :mod:`flexpack.packing.grids`), a frame's video tokens
are its episode's own patches (row-major over its grid) and then spatial padding (``doc = -1``).

Episode slots (``doc``) number the episodes of the micro-batch ``0..E-1`` in row order; ``-1``
marks padding. ``episode_index`` maps slots back to dataset indices.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Sequence

import torch
from torch import Tensor

from .transfer import HostCopy, moved, on_host, to_device  # noqa: F401  (to_device: for the attention wing, which imports layout only)

PAD = -1
VIDEO, ACTION = 0, 1
NOISY, CLEAN = 0, 1


@dataclass(frozen=True, eq=False)
class SequenceLayout:
    """Frame-level layout of one micro-batch (produced by the pad and pack collates).

    Attributes (``E`` episodes, ``R`` rows, ``Fr`` frames per row):
        frame_doc:      (R, Fr) int64 — episode slot of each frame, ``-1`` for padding.
        frame_pos:      (R, Fr) int64 — frame index inside its episode (restarts at 0 for every
                        episode; padding runs restart too, which is what HF-style position ids do).
        episode_row:    (E,) int64 — row of each episode.
        episode_start:  (E,) int64 — first frame of each episode inside its row.
        episode_frames: (E,) int64 — valid frames of each episode.
        episode_index:  (E,) int64 — dataset index of each episode (``-1`` where unknown).
        episode_segment: (E,) int64 — segment (annotated task run) of each episode inside its
                        dataset episode, ``-1`` for a whole episode or where unknown; with
                        ``episode_index`` it keys the episode's noise (one draw per item).
        text_len:       (E,) int64 — valid text tokens per episode (0 where there is no text).
        mode:           ``"pad"``, ``"pack"`` or ``"tokens"`` (:meth:`from_lengths`).
        episode_hw:     (E, 2) int64 latent grid ``(h, w)`` of each episode, in a micro-batch of a run whose
                        episodes' grids differ (:mod:`flexpack.packing.grids`: spatial padding); None where
                        every episode fills the batch's grid.
        grid_hw:        the batch's latent grid ``(H, W)`` where ``episode_hw`` is set, else None.
        host:           on a device layout, the :class:`HostCopy` it was copied from (read it with :meth:`on_host`).
    """

    frame_doc: Tensor
    frame_pos: Tensor
    episode_row: Tensor
    episode_start: Tensor
    episode_frames: Tensor
    episode_index: Tensor
    episode_segment: Tensor
    text_len: Tensor
    mode: str
    episode_hw: Tensor | None = None
    grid_hw: tuple[int, int] | None = None
    host: HostCopy | None = field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------ construction
    @staticmethod
    def from_rows(
        rows: Sequence[Sequence[int]],
        frames_per_row: int,
        *,
        episode_index: Sequence[int] | None = None,
        text_len: Sequence[int] | None = None,
        mode: str = "pack",
        segment: Sequence[int] | None = None,
        grid_hw: tuple[int, int] | None = None,
        episode_hw: Sequence[tuple[int, int]] | None = None,
    ) -> "SequenceLayout":
        """Build a layout from the episode lengths placed in each row, back to back from frame 0.

        ``rows[r]`` lists the frame counts of the episodes in row ``r``; the rest of the row is
        padding. Episode slots are numbered in row order. ``segment``: each slot's segment index
        (default ``-1``: whole episodes). ``grid_hw`` and ``episode_hw``: the batch's latent grid and
        each slot's own (:mod:`flexpack.packing.grids`), both or neither.
        """
        if (grid_hw is None) != (episode_hw is None):
            raise ValueError("grid_hw and episode_hw go together (spatial padding), got one of them")
        if frames_per_row <= 0:
            raise ValueError(f"frames_per_row must be positive, got {frames_per_row}")
        R = len(rows)
        if R == 0:
            raise ValueError("a layout needs at least one row")
        frame_doc = torch.full((R, frames_per_row), PAD, dtype=torch.int64)
        frame_pos = torch.zeros((R, frames_per_row), dtype=torch.int64)
        ep_row, ep_start, ep_frames = [], [], []
        slot = 0
        for r, lengths in enumerate(rows):
            start = 0
            for n in lengths:
                n = int(n)
                if n <= 0:
                    raise ValueError(f"episode slot {slot} (row {r}) has non-positive length {n}")
                if start + n > frames_per_row:
                    raise ValueError(
                        f"row {r} holds {sum(int(x) for x in lengths)} frames, "
                        f"more than frames_per_row={frames_per_row}"
                    )
                frame_doc[r, start : start + n] = slot
                frame_pos[r, start : start + n] = torch.arange(n)
                ep_row.append(r)
                ep_start.append(start)
                ep_frames.append(n)
                start += n
                slot += 1
            if start < frames_per_row:  # padding tail restarts its positions
                frame_pos[r, start:] = torch.arange(frames_per_row - start)
        E = slot
        idx = (torch.full((E,), -1, dtype=torch.int64) if episode_index is None
               else torch.as_tensor(list(episode_index), dtype=torch.int64))
        tl = (torch.zeros(E, dtype=torch.int64) if text_len is None
              else torch.as_tensor(list(text_len), dtype=torch.int64))
        seg = (torch.full((E,), -1, dtype=torch.int64) if segment is None
               else torch.as_tensor(list(segment), dtype=torch.int64))
        if idx.shape != (E,) or tl.shape != (E,) or seg.shape != (E,):
            raise ValueError(f"episode_index, text_len and segment need {E} entries, got {tuple(idx.shape)}, "
                             f"{tuple(tl.shape)} and {tuple(seg.shape)}")
        as_t = lambda xs: torch.as_tensor(xs, dtype=torch.int64).reshape(-1)  # noqa: E731
        hw = None
        if episode_hw is not None:
            hw = torch.as_tensor([list(g) for g in episode_hw], dtype=torch.int64).reshape(-1, 2)
            if hw.shape[0] != E:
                raise ValueError(f"episode_hw needs {E} entries, got {hw.shape[0]}")
            grid_hw = (int(grid_hw[0]), int(grid_hw[1]))
        return SequenceLayout(frame_doc, frame_pos, as_t(ep_row), as_t(ep_start), as_t(ep_frames), idx, seg, tl, mode,
                              hw, grid_hw)

    @staticmethod
    def from_lengths(lengths: Sequence[int], pad_to: int | None = None) -> "SequenceLayout":
        """A plain document layout of token runs: one row, ``lengths`` back to back, padded to ``pad_to``.

        Each "frame" is one token (``tokens()`` with the defaults gives ``T = pad_to or sum(lengths)``).
        """
        total = sum(int(n) for n in lengths)
        if not lengths:
            raise ValueError("lengths is empty")
        if pad_to is not None and pad_to < total:
            raise ValueError(f"pad_to={pad_to} is shorter than the {total} tokens of the lengths")
        return SequenceLayout.from_rows([list(lengths)], pad_to or total, mode="tokens")

    # ------------------------------------------------------------------ views
    @property
    def num_rows(self) -> int:
        return self.frame_doc.shape[0]

    @property
    def frames_per_row(self) -> int:
        return self.frame_doc.shape[1]

    @property
    def num_episodes(self) -> int:
        return self.episode_frames.shape[0]

    @property
    def frame_valid(self) -> Tensor:
        """(R, Fr) bool — frames that belong to an episode (loss and attention ignore the rest)."""
        return self.frame_doc >= 0

    @property
    def valid_frames(self) -> Tensor:
        """(E,) valid frames per episode (in pad mode: per row, as ``valid_frames (B,)``)."""
        return self.episode_frames

    @property
    def cu_seqlens(self) -> Tensor:
        """(E+1,) int32 cumulative frame offsets of the episodes in the flattened frame grid.

        Only contiguous when every row but the last is full (pack mode: one row); pad mode has
        padding between episodes, use ``episode_row``/``episode_start`` there.
        """
        starts = self.episode_row * self.frames_per_row + self.episode_start
        ends = starts + self.episode_frames
        if self.num_episodes and not torch.equal(starts[1:], ends[:-1]):
            raise ValueError("episodes are not contiguous in this layout (pad mode); cu_seqlens is undefined")
        first = starts[:1] if self.num_episodes else torch.zeros(1, dtype=torch.int64)
        return torch.cat([first, ends]).to(torch.int32)

    def signature(self) -> tuple:
        """Shape signature: layouts with equal signatures give tensors of equal shapes."""
        grid = () if self.grid_hw is None else (("grid", *self.grid_hw),)
        return (self.mode, self.num_rows, self.frames_per_row) + grid

    def to(self, device: torch.device | str) -> "SequenceLayout":
        """The layout on ``device`` (see :func:`to_device`); a device layout keeps its host copy,
        and ``to("cpu")`` gives that copy back without reading the device."""
        return moved(self, device)

    def pin_memory(self) -> "SequenceLayout":
        """This (CPU) layout in page-locked memory: :meth:`to` a CUDA device then copies without
        blocking and without staging each tensor first."""
        return replace(self, **{f.name: getattr(self, f.name).pin_memory() for f in fields(self)
                                if isinstance(getattr(self, f.name), Tensor)})

    def on_host(self) -> "SequenceLayout":
        """This layout with CPU tensors: itself, the host copy it was moved from, or (a device
        layout without one, e.g. built on the device or changed there) a copy read back, which
        waits for the GPU."""
        return on_host(self)

    # ------------------------------------------------------------------ expansion
    def tokens(
        self,
        video_tokens: int = 1,
        action_tokens: int = 0,
        *,
        copies: int = 1,
        grid_hw: tuple[int, int] | None = None,
    ) -> "TokenLayout":
        """Expand to the token sequence (see the module docstring for the order).

        Args:
            video_tokens: video tokens per latent frame (``h * w`` patches).
            action_tokens: action tokens per latent frame.
            copies: 1, or 2 for teacher forcing (a noisy and a clean copy of every episode).
            grid_hw: the ``(h, w)`` patch grid; defaults to ``(1, video_tokens)``.
        """
        if video_tokens < 0 or action_tokens < 0 or video_tokens + action_tokens == 0:
            raise ValueError("need video_tokens, action_tokens >= 0 with a positive sum, "
                             f"got {video_tokens}, {action_tokens}")
        if copies not in (1, 2):
            raise ValueError(f"copies must be 1 or 2, got {copies}")
        h, w = grid_hw if grid_hw is not None else (1, video_tokens)
        if h * w != video_tokens:
            raise ValueError(f"grid_hw={grid_hw} does not hold video_tokens={video_tokens}")
        return _expand(self, video_tokens, action_tokens, copies, (h, w))


@dataclass(frozen=True, eq=False)
class TokenLayout:
    """Token-level layout: one entry per token of the flattened micro-batch (length ``T``).

    Attributes:
        doc:    (T,) int64 episode slot, ``-1`` for padding.
        frame:  (T,) int64 latent frame index inside the episode (restarting).
        stream: (T,) int64 ``VIDEO`` (0) or ``ACTION`` (1).
        copy:   (T,) int64 ``NOISY`` (0) or ``CLEAN`` (1).
        hpos, wpos: (T,) int64 patch row / column of video tokens (0 for action tokens).
        video_index:  (copies, R, Fr, video_tokens) int64 — token position of every video patch.
        action_index: (copies, R, Fr, action_tokens) int64 — token position of every action token.
                      The ``K = video_tokens + action_tokens`` tokens of one (copy, row, frame) are
                      one contiguous unit: ``video_index[..., j] = u*K + j``,
                      ``action_index[..., j] = u*K + video_tokens + j`` for that unit ``u``.
        doc_start, doc_len: (E,) int64 — each episode's contiguous token run (all copies).
        text_len: (E,) int64 valid text tokens per episode.
        frames: the :class:`SequenceLayout` it was expanded from.
        runs:   host-side ``(episode slot or -1, frames)`` of every run in token order (rows one
                after another); lets masks bound their segment counts without a device sync.
        video_slot: (R, Fr, video_tokens) int64 or None — with spatial padding (``frames.episode_hw``), the
                patch (row-major over the full grid) that video slot ``j`` of each frame holds: the episode's
                patches first, then padding, whose tokens have ``doc = -1`` (:mod:`flexpack.packing.grids`).
        host:   on a device layout, the :class:`HostCopy` it was copied from (read it with :meth:`on_host`).
    """

    doc: Tensor
    frame: Tensor
    stream: Tensor
    copy: Tensor
    hpos: Tensor
    wpos: Tensor
    video_index: Tensor
    action_index: Tensor
    doc_start: Tensor
    doc_len: Tensor
    text_len: Tensor
    frames: SequenceLayout
    video_tokens: int
    action_tokens: int
    copies: int
    runs: tuple[tuple[int, int], ...] = ()
    video_slot: Tensor | None = None
    host: HostCopy | None = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return self.doc.shape[0]

    @property
    def valid(self) -> Tensor:
        return self.doc >= 0

    @property
    def spatial(self) -> bool:
        """Whether frames may hold spatial padding (a run whose episodes' grids differ): one more key segment per
        frame and copy, and an episode's tokens are no longer one range."""
        return self.video_slot is not None

    def text_doc(self, text_tokens: int) -> Tensor:
        """(E * text_tokens,) episode slot of each flattened text token, ``-1`` for text padding."""
        E = self.text_len.shape[0]
        j = torch.arange(text_tokens, device=self.doc.device)
        slot = torch.arange(E, device=self.doc.device)[:, None].expand(E, text_tokens)
        return torch.where(j[None, :] < self.text_len[:, None], slot, PAD).reshape(-1)

    def signature(self) -> tuple:
        return (self.num_tokens, self.video_tokens, self.action_tokens, self.copies) + self.frames.signature()

    def to(self, device: torch.device | str) -> "TokenLayout":
        """The layout on ``device``, its frames too; keeps the host copy as :meth:`SequenceLayout.to`."""
        out = moved(self, device)
        if out.frames.frame_doc.device == out.doc.device:
            return out
        return replace(out, frames=out.frames.to(device))  # same tensors: the host copy still holds

    def on_host(self) -> "TokenLayout":
        """This layout with CPU tensors (see :meth:`SequenceLayout.on_host`)."""
        return on_host(self)


def _expand(layout: SequenceLayout, nv: int, na: int, copies: int, grid_hw: tuple[int, int]) -> TokenLayout:
    """The token layout, computed on the host from the layout's CPU copy (run lengths, scatters and
    ``runs`` need host values; a device layout brings its host copy) and moved to the layout's device."""
    host = layout.on_host()
    fd = host.frame_doc
    R, Fr = fd.shape
    tpf = nv + na
    dev_out = layout.frame_doc.device
    # run boundaries: a run is a maximal stretch of equal frame_doc inside a row (pads included)
    new_run = torch.ones((R, Fr), dtype=torch.bool)
    new_run[:, 1:] = fd[:, 1:] != fd[:, :-1]
    f_idx = torch.arange(Fr).expand(R, Fr)
    run_start = torch.where(new_run, f_idx, torch.zeros_like(f_idx)).cummax(dim=1).values  # (R, Fr)
    run_id = new_run.long().cumsum(dim=1) - 1
    nruns = int(run_id[:, -1].max()) + 1 if Fr else 0
    run_len = torch.zeros((R, nruns), dtype=torch.int64).scatter_add_(1, run_id, torch.ones_like(run_id))
    n = run_len.gather(1, run_id)  # (R, Fr) length of the run each frame belongs to
    row_base = (torch.arange(R) * Fr * tpf * copies)[:, None]
    # token position of (copy c, row r, frame f, slot j): base + s*tpf*C + c*n*tpf + (f-s)*tpf + j
    frame_base = row_base + run_start * tpf * copies + (f_idx - run_start) * tpf  # (R, Fr)
    c = torch.arange(copies)[:, None, None]
    pos0 = frame_base[None] + c * (n * tpf)[None]  # (C, R, Fr)
    video_index = pos0[..., None] + torch.arange(nv)
    action_index = pos0[..., None] + nv + torch.arange(na)
    T = R * Fr * tpf * copies

    doc = torch.empty(T, dtype=torch.int64)
    frame = torch.empty(T, dtype=torch.int64)
    stream = torch.empty(T, dtype=torch.int64)
    copy = torch.empty(T, dtype=torch.int64)
    hpos = torch.zeros(T, dtype=torch.int64)
    wpos = torch.zeros(T, dtype=torch.int64)
    fp = host.frame_pos
    for index, k, is_action in ((video_index, nv, False), (action_index, na, True)):
        if k == 0:
            continue
        flat = index.reshape(-1)
        doc[flat] = fd[None, :, :, None].expand(copies, R, Fr, k).reshape(-1)
        frame[flat] = fp[None, :, :, None].expand(copies, R, Fr, k).reshape(-1)
        stream[flat] = ACTION if is_action else VIDEO
        copy[flat] = c[..., None].expand(copies, R, Fr, k).reshape(-1)
        if not is_action:
            j = torch.arange(nv).expand(copies, R, Fr, nv).reshape(-1)
            hpos[flat] = j // grid_hw[1]
            wpos[flat] = j % grid_hw[1]
    slot = None
    if host.episode_hw is not None and nv:
        slot = _spatial(host, video_index, grid_hw, doc, hpos, wpos)
    starts = (host.episode_row * Fr + host.episode_start) * tpf * copies
    lens = host.episode_frames * tpf * copies
    first = new_run.nonzero()  # (runs, 2) row, frame of every run's first frame, in token order
    runs = tuple(zip(fd[first[:, 0], first[:, 1]].tolist(), n[first[:, 0], first[:, 1]].tolist()))
    out = TokenLayout(
        doc, frame, stream, copy, hpos, wpos, video_index, action_index, starts, lens,
        host.text_len, host, nv, na, copies, runs, slot,
    )
    if dev_out.type == "cpu":
        return out
    return replace(moved(out, dev_out), frames=layout)  # the frames the caller holds, not a second copy


def _spatial(host: SequenceLayout, video_index: Tensor, grid_hw: tuple[int, int], doc: Tensor, hpos: Tensor,
             wpos: Tensor) -> Tensor:
    """Spatial padding of a host layout's video tokens (in place): padding slots leave their episode
    (``doc = -1``), real slots take their positions in the episode's own grid; returns the slot table."""
    from .grids import spatial_tokens

    slot, real, h, w = spatial_tokens(host, grid_hw)
    copies = video_index.shape[0]
    flat = video_index.reshape(-1)
    doc[flat] = torch.where(real[None].expand(copies, *real.shape).reshape(-1), doc[flat], PAD)
    hpos[flat] = h[None].expand(copies, *h.shape).reshape(-1)
    wpos[flat] = w[None].expand(copies, *w.shape).reshape(-1)
    return slot


def cu_seqlens_from_position_ids(position_ids: Tensor, valid_tokens: int | None = None) -> Tensor:
    """Recover cu_seqlens (int32) from restarting position ids of shape (T,) or (1, T).

    A new sequence starts wherever the position is 0 (HF's packing convention). Without
    ``valid_tokens`` the sequences cover all ``T`` tokens, so a padding tail whose positions
    restart counts as one more sequence; with ``valid_tokens`` (the tokens before the tail) the
    result ends there, which is what :func:`hf_packing_kwargs` emits as ``cu_seq_lens_q/k``.
    """
    pos = position_ids.reshape(-1)
    if pos.numel() == 0:
        raise ValueError("position_ids is empty")
    if int(pos[0]) != 0:
        raise ValueError(f"position_ids must start at 0 for a new sequence, got {int(pos[0])}")
    end = pos.numel() if valid_tokens is None else int(valid_tokens)
    if not 0 < end <= pos.numel():
        raise ValueError(f"valid_tokens must be in 1..{pos.numel()}, got {valid_tokens}")
    if end < pos.numel() and int(pos[end]) != 0:
        raise ValueError(f"valid_tokens={end} is inside a sequence (position {int(pos[end])} there, not 0)")
    starts = torch.nonzero(pos[:end] == 0).reshape(-1)
    return torch.cat([starts, torch.tensor([end], device=pos.device)]).to(torch.int32)


def hf_packing_kwargs(layout: SequenceLayout, tokens_per_frame: int = 1) -> dict[str, Tensor | int]:
    """HF-compatible packing keys for a one-row (pack mode) layout, counted in tokens.

    Every latent frame is ``tokens_per_frame`` tokens (video + action, one copy), so episode
    ``e`` is ``episode_frames[e] * tokens_per_frame`` tokens long, the same sequence the model
    attends over (:meth:`SequenceLayout.tokens`). The keys are what transformers'
    ``DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)`` returns
    for the same episodes as sequences of those lengths, plus the fixed-shape padding tail:

    - ``position_ids`` (1, T) int64: ``0..n-1`` per episode; the padding tail restarts at 0 too,
      so position-id based packing detection never joins it to the last episode;
    - ``cu_seq_lens_q/k`` (E + 1,) int32: ``[0, n_0, n_0 + n_1, ...]``, ending at the last
      *valid* token. The tail is not a sequence: FlashAttention's varlen kernels compute only
      the tokens cu_seqlens cover, so the tail's attention output is left unwritten there (mask
      it with ``torch.where``, not a product, which would turn garbage into NaN).
      ``cu_seqlens_from_position_ids(position_ids)`` still gives the cover with the tail as one
      more sequence, for kernels that must write every row;
    - ``max_length_q/k`` (int): the longest episode in tokens;
    - ``seq_idx`` (1, T) int32: each token's episode slot, the tail numbered ``E`` (so it stays
      non-decreasing, as kernels taking ``seq_idx`` expect).
    """
    if layout.num_rows != 1:
        raise ValueError(f"HF packing keys need a one-row (pack mode) layout, got {layout.num_rows} rows")
    if tokens_per_frame < 1:
        raise ValueError(f"tokens_per_frame must be >= 1, got {tokens_per_frame}")
    frames = layout.episode_frames.to(torch.int64)
    offsets = torch.cumsum(frames, 0) - frames
    if not torch.equal(layout.episode_start.to(torch.int64), offsets):
        raise ValueError(f"HF packing keys need episodes back to back from frame 0, got starts "
                         f"{layout.episode_start.tolist()} for frames {frames.tolist()}")
    pos = layout.frame_pos[0]
    device = pos.device
    # per frame to tokens: a frame's tokens continue its episode's count
    position_ids = (pos[:, None] * tokens_per_frame + torch.arange(tokens_per_frame, device=device)).reshape(1, -1)
    lengths = frames * tokens_per_frame
    cu = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), torch.cumsum(lengths, 0)]).to(torch.int32)
    tail = position_ids.shape[1] - int(cu[-1])
    seq_idx = torch.repeat_interleave(torch.arange(lengths.numel() + 1, device=device),
                                      torch.cat([lengths, torch.tensor([tail], device=device)]))
    max_len = int(lengths.max())
    return {
        "position_ids": position_ids,
        "seq_idx": seq_idx.to(torch.int32).reshape(1, -1),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max_len,
        "max_length_k": max_len,
    }
