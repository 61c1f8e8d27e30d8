"""The train loop reads device values on the host at logged steps only: on a GPU every such read
waits for the GPU, and a wait per step leaves the GPU idle while the host queues the next step.

On CPU there is no device to wait for, so the tests mark what would live on it: the step's
results (loss parts, gradient norm), and — as ``Batch.to`` and ``SequenceLayout.tokens`` put them
on a GPU — the micro-batch, its layouts and everything computed from them. Any host read of a
marked tensor (``.item()``, ``.tolist()``, ``.cpu()``, ``int()``/``bool()``, ``nonzero``, boolean-mask
indexing, ``torch.equal``, ``repeat_interleave`` without ``output_size``, ...) is recorded with
the optimizer step it happened in.
"""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("lerobot")

from flexpack.attention.flex import PreparedMask  # noqa: E402
from flexpack.attention.masks import make_mask  # noqa: E402
from flexpack.commands.train import train  # noqa: E402
from flexpack.packing.collate import Batch, PackCollate  # noqa: E402
from flexpack.packing.layout import SequenceLayout  # noqa: E402
from flexpack.packing.transfer import with_host  # noqa: E402
from flexpack.run.config import load_config  # noqa: E402
from flexpack.training import step as step_mod  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
READS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy", "__format__", "__repr__",
         "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose"}


def _bool_index(args) -> bool:
    """Indexing with a boolean mask: its output size is the mask's count, read back from the device."""
    idx = args[1] if len(args) > 1 else None
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class _Watched(torch.Tensor):
    """A device value: host reads of it, or of anything computed from it, are recorded."""

    reads: list[tuple[int, str]] = []
    step = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (name in READS or (name in ("__getitem__", "index_select") and _bool_index(args))
                or (name == "repeat_interleave" and kwargs.get("output_size") is None
                    and len(args) > 1 and isinstance(args[1], torch.Tensor))
                or (name == "where" and len(args) == 1)):
            cls.reads.append((cls.step, name))
        return super().__torch_function__(func, types, args, kwargs)


def _watched(t):
    return t.as_subclass(_Watched) if isinstance(t, torch.Tensor) else t


def _on_device(layout, frames=None):
    """``layout`` as a GPU copy of it would be: marked tensors, the CPU layout as its host copy."""
    tensors = {f.name: _watched(getattr(layout, f.name)) for f in fields(layout)
               if isinstance(getattr(layout, f.name), torch.Tensor)}
    return with_host(replace(layout, **tensors, **({"frames": frames} if frames is not None else {})), layout.on_host())


def _simulate_device(monkeypatch) -> None:
    """Batch.to and SequenceLayout.tokens hand out marked values, as they would on a GPU."""
    batch_to, tokens = Batch.to, SequenceLayout.tokens

    def to(self, device, non_blocking=False):
        moved = batch_to(self, device, non_blocking)
        data = {f.name: _watched(getattr(moved, f.name)) for f in fields(moved)
                if isinstance(getattr(moved, f.name), torch.Tensor)}
        return replace(moved, layout=_on_device(moved.layout), **data)

    def device_tokens(self, *a, **k):
        out = tokens(self, *a, **k)  # computed on the host copy
        return _on_device(out, frames=self) if isinstance(self.frame_doc, _Watched) else out

    monkeypatch.setattr(Batch, "to", to)
    monkeypatch.setattr(SequenceLayout, "tokens", device_tokens)


def _train_watched(monkeypatch, tiny_dataset, tmp_path, overrides=()):
    accumulate, clip = step_mod.accumulate, torch.nn.utils.clip_grad_norm_

    def watched_accumulate(*a, **k):
        _Watched.step += 1  # the optimizer step now running (1-based)
        return accumulate(*a, **k).as_subclass(_Watched)

    monkeypatch.setattr(step_mod, "accumulate", watched_accumulate)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: clip(*a, **k).as_subclass(_Watched))
    _Watched.reads, _Watched.step = [], 0
    cfg = load_config(CONFIGS / "tiny_cpu.toml", [
        f'data.root="{tiny_dataset}"', f'runtime.out_dir="{tmp_path / "run"}"', "log.progress=false",
        "data.max_tokens=60", "checkpoint.every=0", "log.tensorboard=false", "schedule.steps=7",
        "log.every=3", *overrides])
    return train(cfg)


def test_host_reads_of_step_results_happen_at_logged_steps_only(one_thread, monkeypatch, tiny_dataset, tmp_path):
    result = _train_watched(monkeypatch, tiny_dataset, tmp_path)
    assert [m["step"] for m in result.metrics] == [3, 6, 7]
    read_at = {s for s, _ in _Watched.reads}
    assert read_at == {3, 6, 7}, _Watched.reads  # the logged steps (and the last), never the others


@pytest.mark.parametrize("mask", ["document", "teacher_forcing"])
def test_the_step_never_reads_its_batch_or_layouts_back(one_thread, monkeypatch, tiny_dataset, tmp_path, mask):
    """From the batch's copy to the device to the optimizer step — noise, token layout, masks, model,
    loss — nothing reads a device value back: host-side quantities come from the host layout."""
    _simulate_device(monkeypatch)
    over = (["model.mask=\"teacher_forcing\"", "model.chunk_size=2", "objective.teacher_forcing=true"]
            if mask != "document" else [])
    result = _train_watched(monkeypatch, tiny_dataset, tmp_path, over)
    assert len(result.metrics) == 3
    late = [(s, name) for s, name in _Watched.reads if s not in (3, 6, 7)]
    assert not late, late
    assert {name for _, name in _Watched.reads} <= {"__float__", "cpu", "__bool__", "item", "tolist"}  # the log's reads


def test_host_side_values_of_a_device_layout_come_from_its_host_copy():
    """Token expansion, the text mask's check and the episode runs of sdpa-loop / varlen read the
    host copy of a device layout; a layout without one (changed by ``replace``) is read back, and
    the check above sees that."""
    batch = PackCollate(12)([{"latent": torch.zeros(2, n, 1, 1), "text": torch.zeros(3, 4), "text_len": 2}
                             for n in (5, 4)])
    _Watched.reads, _Watched.step = [], 1
    device = _on_device(batch.layout)
    tl = _on_device(device.tokens(video_tokens=1, action_tokens=2), frames=device)
    make_mask(tl, "text", text_tokens=3)
    runs = PreparedMask("document", tl, make_mask(tl, "document"), 27, 27, builder=None).runs()
    assert _Watched.reads == []
    assert tl.runs == ((0, 5), (1, 4), (-1, 3)) and runs == [(0, 15), (15, 12)]
    assert replace(tl).on_host() is tl.on_host()  # the same tensors: the host copy holds
    assert replace(device, mode="pad").on_host().mode == "pad"  # changed: not the host copy's "pack"
    from torch.distributed.utils import _apply_to_tensors  # what FSDP2 maps over a module's inputs

    mapped = _apply_to_tensors(lambda t: t.to(t.device), tl)
    assert mapped is not tl and mapped.on_host() is tl.on_host() and mapped.frames.on_host() is device.on_host()
    stale = replace(tl, doc_start=tl.doc_start + 0, text_len=tl.text_len + 0)  # changed: no stale host values
    assert PreparedMask("document", stale, make_mask(stale, "document"), 27, 27, builder=None).runs() == runs
    assert {n for _, n in _Watched.reads} == {"tolist"}  # doc_start / doc_len read back
    _Watched.reads = []
    with pytest.raises(ValueError, match="exceeds text_tokens=1"):
        make_mask(stale, "text", text_tokens=1)
    assert _Watched.reads
    _Watched.reads = []
    replace(device, frame_doc=device.frame_doc + 0).tokens(video_tokens=1, action_tokens=2)
    assert _Watched.reads  # frame_doc read back to find the runs


@pytest.mark.parametrize("mask", ["document", "teacher_forcing"])
def test_forward_and_backward_run_on_the_meta_device(one_thread, mask):
    """A step's micro-batches, forward and backward, with the model and the batches on the meta
    device: its tensors have shapes but no values, so any host read of a device value (a layout
    read back, a mask check, an ``.item()``) raises instead of silently waiting for a GPU."""
    from flexpack.run.config import TrainConfig, from_dict
    from flexpack.run.memory_data import synthetic_run
    from flexpack.run.model import build_model

    model = {"preset": "tiny", "overrides": {"num_layers": 2, "attn_backend": "dense"}}
    if mask == "teacher_forcing":
        model.update(mask="teacher_forcing", chunk_size=2)
    cfg = from_dict(TrainConfig, {"data": {"mode": "pack", "max_tokens": 256, "action_steps": 4}, "model": model,
                                  "objective": {"teacher_forcing": mask == "teacher_forcing", "chunk_size": 2},
                                  "optim": {"accum_steps": 2}})
    meta = torch.device("meta")
    data = synthetic_run(cfg, hw=(4, 4), text_len=8, device=meta)
    batches = [data.collate([data.dataset[i] for i in idx]) for idx in list(data.sampler)[:2]]
    assert all(b.layout.num_episodes > 1 and b.text is not None and b.action is not None for b in batches)
    with meta:
        net = build_model(cfg)
    out = step_mod.accumulate(net, batches, data, step=0)
    assert out.device == meta and out.shape == (3,)
    assert all(p.grad is not None and p.grad.device == meta for p in net.parameters())  # backward reached every weight
