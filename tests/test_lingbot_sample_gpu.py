"""lingbot-va sampling on CUDA with compiled blocks and FlexAttention's lingbot mask: no recompiles across pair
lengths and packs, packed == each pair alone, and the same numbers as the CPU's dense reference."""

from __future__ import annotations

import pytest
import torch

from flexpack.families.lingbot.sampler import LingbotSampler
from flexpack.parallel.parallelize import ParallelOptions, compiled_graphs, parallelize
from flexpack.run.compose import compose
from flexpack.run.model import build_model
from flexpack.sampling.pairs import make_pair
from flexpack.sampling.solver import SampleOptions
from helpers import tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TPF = 5  # 1 video token (2x2 latents, 2x2 patches) + 4 action tokens per frame and copy
SETS = ["model.family=lingbot-va", "model.preset=lingbot-va-tiny", "data.max_tokens=400", "runtime.device='cuda'",
        "model.overrides.num_inference_steps=3", "model.overrides.action_num_inference_steps=4",
        "model.overrides.action_guidance_scale=2.0"]
NEGATIVE = (torch.randn(1, 64, generator=torch.Generator().manual_seed(9)), 1)


def _items(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, F in enumerate(lengths):
        mask = torch.zeros(30, F, 4, dtype=torch.bool)
        mask[:6, 1:] = True  # the used channels; frame 0 carries no action
        out.append({"latent": torch.randn(48, F, 2, 2, generator=g), "action": torch.randn(30, F, 4, generator=g),
                    "action_mask": mask, "text": torch.randn(5, 64, generator=g), "text_len": 5, "episode_index": i})
    return out


def _sampler(model, cfg, dev, **kw):
    run = compose(cfg, "sample", hw=(2, 2), device=dev)
    assert run.geometry.tokens_per_frame == TPF
    return LingbotSampler(model, run, SampleOptions(steps=3), negative_text=NEGATIVE, **kw)


def test_compiled_lingbot_sampling_never_recompiles_and_equals_alone_and_the_cpu():
    cfg = tiny_config("unused", "unused", *SETS, "model.overrides.attn_backend='auto'")
    cpu_cfg = tiny_config("unused", "unused", *SETS[:3], *SETS[4:], "runtime.device='cpu'")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    with dev:
        eager = build_model(cfg).eval()
        model = build_model(cfg).eval()
    model.load_state_dict(eager.state_dict())
    parallelize(model, device=dev, options=ParallelOptions(compile=True))
    sampler = _sampler(model, cfg, dev, text_slots=16)
    sampler.run([make_pair(it, 4, 4) for it in _items([8, 12, 9], 0)])  # warm-up: the pack shape compiles
    for seed, lengths in enumerate([[30, 9, 17], [6, 6, 6, 7, 11], [44, 20]], start=1):
        pairs = [make_pair(it, c, 4) for it in _items(lengths, seed) for c in (4, 8) if c + 4 <= it["latent"].shape[1]]
        before = compiled_graphs()
        sampler.run(pairs)
        assert compiled_graphs() == before, f"recompiled for lengths {lengths}"
        p = pairs[0]
        (alone,) = [make_pair(it, p.cut, 4) for it in _items(lengths, seed) if it["episode_index"] == p.episode]
        _sampler(eager, cfg, dev, max_tokens=TPF * alone.frames).run([alone])
        err = (p.pred_latent - alone.pred_latent).abs().max() / alone.pred_latent.abs().max()
        a_err = (p.pred_action - alone.pred_action).abs().max() / alone.pred_action.abs().max()
        assert float(err) < 5e-3 and float(a_err) < 5e-3, (float(err), float(a_err))  # TF32, kernel order
        assert torch.equal(p.pred_latent[:, :p.cut], p.latent[:, :p.cut])
        if seed == 1:  # the CPU's dense reference on the same weights
            cpu = build_model(cpu_cfg).eval()
            cpu.load_state_dict({k: v.cpu() for k, v in eager.state_dict().items()})
            (ref,) = [make_pair(it, p.cut, 4) for it in _items(lengths, seed) if it["episode_index"] == p.episode]
            _sampler(cpu, cpu_cfg, torch.device("cpu"), max_tokens=TPF * ref.frames).run([ref])
            err = (alone.pred_latent - ref.pred_latent).abs().max() / ref.pred_latent.abs().max()
            assert float(err) < 5e-3, float(err)
