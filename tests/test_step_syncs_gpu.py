"""On CUDA the packed training step, as ``flexpack train`` runs it, never waits for the GPU.

From the host batch on: the loader's pinned batch, its copy to the device (data, layout, packing
keys), the noise, the token layout, both block masks (compiled builds replayed as CUDA graphs), the
compiled blocks with FlexAttention, the loss, backward, clipping, the step guard and fused AdamW.
After warm-up (compiles, graph captures) more steps run under
``torch.cuda.set_sync_debug_mode("error")``, where any host-device synchronization raises with the
Python stack of the line that asked for it; a reintroduced ``.item()``, ``.cpu()``, blocking copy,
``nonzero`` or boolean-mask index on that path fails here. None is unavoidable: the step's device
results are read at logged steps only (``tests/test_loop_syncs.py``). One is by design: with
``optim.skip_nonfinite`` (or several ranks) the host must know before the optimizer step whether the
step is finite, which is one read per step, counted exactly below.

Run on a GPU machine: ``pytest -q -m gpu tests/test_step_syncs_gpu.py``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from flexpack.run.config import TrainConfig, from_dict

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def config(mask: str, backend: str, device: str = "cuda", skip_nonfinite: bool = False) -> TrainConfig:
    # head dim 128 (256 / 2 heads): the FLASH (FA4) backend runs where it is installed
    model = {"preset": "tiny", "overrides": {"num_layers": 2, "dim": 256, "num_heads": 2, "ffn_dim": 512,
                                             "attn_backend": backend}}
    teacher = mask == "teacher_forcing"
    if teacher:
        model.update(mask="teacher_forcing", chunk_size=2)
    return from_dict(TrainConfig, {
        "data": {"mode": "pack", "max_tokens": 1024, "action_steps": 4},  # 128 frames of 4 video + 4 action tokens
        "model": model,
        "objective": {"teacher_forcing": teacher, "chunk_size": 2},
        "optim": {"lr": 1e-4, "grad_clip": 1.0, "accum_steps": 2, "skip_nonfinite": skip_nonfinite},
        "runtime": {"device": device, "dtype": "bfloat16" if device == "cuda" else "float32"},
        "parallel": {"compile": device == "cuda"}, "log": {"progress": False},
    })


def run_steps(cfg: TrainConfig, device: torch.device, *, warmup: int, checked: int, check=None,
              lengths: list[int] | None = None) -> dict:
    """``warmup`` optimizer steps, then ``checked`` more inside ``check()`` (a context manager), as the
    train loop runs them: micro-batches from a pinning DataLoader, ``train_step`` with its guard.
    ``lengths``: the episodes' latent frames (default: several short episodes per pack)."""
    import contextlib

    from flexpack.parallel.parallelize import ParallelOptions, compiled_graphs, parallelize
    from flexpack.run.memory_data import RandomEpisodes, synthetic_run
    from flexpack.run.model import build_model
    from flexpack.run.state import faults
    from flexpack.training.loop import lr_at
    from flexpack.training.optim import build_optimizer
    from flexpack.training.step import train_step

    data = synthetic_run(cfg, hw=(4, 4), text_len=8, device=device)
    if lengths is not None:
        m = data.model_config
        dataset = RandomEpisodes(lengths, channels=m.in_channels, hw=(4, 4), action_channels=m.action_channels,
                                 action_steps=cfg.data.action_steps, text_len=8, text_dim=m.text_dim)
        data = data.with_dataset(dataset)
    with device:
        model = build_model(cfg)
    model = parallelize(model, device=device, options=ParallelOptions(compile=cfg.parallel.compile is True))
    opt = build_optimizer(model, cfg.optim, fused=device.type == "cuda")
    start = [p.detach().clone() for p in model.parameters()]
    loader = torch.utils.data.DataLoader(data.dataset, batch_sampler=data.sampler, collate_fn=data.collate,
                                         pin_memory=device.type == "cuda")
    accum = cfg.optim.accum_steps
    guard = faults.StepGuard(faults.GracefulStop(), skip_nonfinite=cfg.optim.skip_nonfinite)
    sums, graphs, episodes = [], {}, []

    def steps(first: int, n: int) -> None:
        micro = iter(loader)  # the sampler's epoch again: the warm-up's shapes and segment buckets
        for step in range(first, first + n):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg.optim.lr, cfg.schedule)
            batches = list(itertools.islice(micro, accum))
            episodes.extend(b.layout.num_episodes for b in batches)
            out, _ = train_step(model, opt, batches, data, step=step, guard=guard)
            sums.append(out)

    steps(0, warmup)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    graphs["before"] = compiled_graphs()
    with check() if check is not None else contextlib.nullcontext():
        steps(warmup, checked)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    graphs["after"] = compiled_graphs()
    guard.flush()  # raises for a non-finite step
    moved = max(float((p.detach() - s).abs().max()) for p, s in zip(model.parameters(), start))
    return {"losses": [float(s[0]) for s in sums], "graphs": graphs, "moved": moved, "episodes": episodes}


@pytest.fixture
def no_syncs():
    """Any host-device synchronization inside raises (CUDA's sync debug mode)."""
    import contextlib

    @contextlib.contextmanager
    def check():
        with pytest.raises(RuntimeError, match="synchroniz"):  # the mode is on and does catch a read
            torch.cuda.set_sync_debug_mode("error")
            try:
                torch.ones(1, device="cuda").item()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return check


@pytest.mark.parametrize("backend", [pytest.param("auto", marks=pytest.mark.fa4), "flex"])
@pytest.mark.parametrize("mask", ["document", "teacher_forcing"])
def test_packed_step_has_no_host_syncs_after_warmup(no_syncs, mask, backend):
    """``auto``: FA4 (FLASH) where installed, else Triton flex; ``flex``: Triton flex."""
    torch.manual_seed(0)
    out = run_steps(config(mask, backend), torch.device("cuda"), warmup=3, checked=3, check=no_syncs)
    assert out["graphs"]["after"] == out["graphs"]["before"]  # no recompile in the checked steps
    assert len(out["losses"]) == 6 and all(0.0 < x < 100.0 for x in out["losses"]), out["losses"]
    assert out["moved"] > 0.0  # the optimizer did update the weights
    assert max(out["episodes"]) > 1


@pytest.mark.fa4
def test_one_episode_packs_have_no_host_syncs_after_warmup(no_syncs):
    """One episode per pack: FlexAttnFunc picks the per-episode SDPA path for its document mask,
    which needs the episode runs on the host (from the layout's host copy), and the compiled
    blocks trace FlexAttention over the block mask instead."""
    torch.manual_seed(0)
    lengths = [100, 90, 120, 70, 110, 80, 128, 75, 95, 105, 85, 115]  # > 64 of the 128 frames: one per pack
    out = run_steps(config("document", "auto"), torch.device("cuda"), warmup=3, checked=3, check=no_syncs,
                    lengths=lengths)
    assert out["graphs"]["after"] == out["graphs"]["before"]
    assert set(out["episodes"]) == {1}
    assert len(out["losses"]) == 6 and all(0.0 < x < 100.0 for x in out["losses"]), out["losses"]


def test_skip_nonfinite_waits_exactly_once_per_step():
    """``optim.skip_nonfinite``: the step guard reads the (reduced) finite/signal flags once per step,
    before the optimizer step may update the weights; nothing else waits."""
    import contextlib
    import warnings

    caught: list = []

    @contextlib.contextmanager
    def count():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # one warning per synchronizing call (the mode's own "prototype feature" notice is not one)
        caught.extend(str(w.message) for w in seen if "called a synchronizing" in str(w.message))

    torch.manual_seed(0)
    out = run_steps(config("document", "flex", skip_nonfinite=True), torch.device("cuda"), warmup=3, checked=3,
                    check=count)
    assert len(caught) == 3, caught  # one per checked step
    assert all(0.0 < x < 100.0 for x in out["losses"]), out["losses"]
