"""Packed sampling on CUDA with compiled blocks: no recompiles across episode lengths, packed == alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flexpack.parallel.parallelize import ParallelOptions, compiled_graphs, parallelize
from flexpack.run.compose import compose
from flexpack.run.config import load_config
from flexpack.run.model import build_model
from flexpack.sampling.pairs import make_pair
from flexpack.sampling.solver import PackedSampler, SampleOptions

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# attn_backend 'auto': FA4 where installed, as sampling runs on a GPU machine
pytestmark = [pytest.mark.gpu, pytest.mark.fa4, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TPF = 5

MASKS = {
    "document": [],
    "teacher_forcing": ["model.mask='teacher_forcing'", "model.chunk_size=2", "objective.chunk_size=2",
                        "objective.teacher_forcing=true"],
}


def _items(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [{"latent": torch.randn(48, F, 2, 2, generator=g), "action": torch.randn(6, F, 4, generator=g),
             "action_mask": torch.ones(6, F, 4, dtype=torch.bool), "text": torch.randn(5, 64, generator=g),
             "text_len": 5, "episode_index": i} for i, F in enumerate(lengths)]


@pytest.mark.parametrize("mask", list(MASKS))
def test_compiled_packed_sampling_never_recompiles_across_lengths_and_equals_alone(mask):
    cfg = load_config(CONFIGS / "tiny_cpu.toml", [
        "data.max_tokens=400", "runtime.device='cuda'", *MASKS[mask],
        "model.overrides={in_channels=48, text_dim=64, action_channels=6, attn_backend='auto', dim=256, "
        "num_heads=2, ffn_dim=512}"])
    dev = torch.device("cuda")
    torch.manual_seed(0)
    with dev:
        eager = build_model(cfg).eval()
        model = build_model(cfg).eval()
    model.load_state_dict(eager.state_dict())
    parallelize(model, device=dev, options=ParallelOptions(compile=True))
    opts = SampleOptions(steps=3)
    run = compose(cfg, "sample", hw=(2, 2), device=dev)
    assert run.geometry.tokens_per_frame == TPF
    sampler = PackedSampler(model, run, opts, text_slots=16)
    sampler.run([make_pair(it, 2, 4) for it in _items([8, 12, 6], 0)])  # warm-up: the pack shape compiles
    for seed, lengths in enumerate([[30, 9, 17], [6, 6, 6, 6, 7, 11], [44, 20]], start=1):
        pairs = [make_pair(it, c, 4) for it in _items(lengths, seed) for c in (2, 4) if c + 4 <= it["latent"].shape[1]]
        before = compiled_graphs()  # here: the eager single-pair runs below compile attention for their own lengths
        sampler.run(pairs)
        assert compiled_graphs() == before, f"recompiled for lengths {lengths}"
        for p in pairs[:1]:  # each single compiles attention for its own length: one a set suffices
            (alone,) = [make_pair(it, p.cut, 4) for it in _items(lengths, seed) if it["episode_index"] == p.episode]
            PackedSampler(eager, run, opts, max_tokens=TPF * alone.frames).run([alone])
            err = (p.pred_latent - alone.pred_latent).abs().max() / alone.pred_latent.abs().max()
            assert float(err) < 5e-3  # TF32 and kernel order differ between compiled packs and eager singles
            assert torch.equal(p.pred_latent[:, :p.cut], p.latent[:, :p.cut])
