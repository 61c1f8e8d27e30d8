"""The packed flow-matching sampler: schedule and solvers, packed == alone, conditioning, metrics."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from flexpack.data.normalization import ActionStats
from flexpack.packing.collate import PackCollate
from flexpack.packing.layout import SequenceLayout
from flexpack.run.compose import compose
from flexpack.run.config import load_config
from flexpack.run.model import build_model
from flexpack.sampling.metrics import Metrics, denormalize, normalize
from flexpack.sampling.pairs import cut_points, make_pair
from flexpack.sampling.schedule import model_calls, sigma_grid, solve
from flexpack.sampling.solver import PackedSampler, SampleOptions, context_chunk

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
pytestmark = pytest.mark.usefixtures("one_thread")
TPF = 5  # tiny_cpu: one 2x2 latent patch + 4 action steps per frame
SPECS_DIST = [(0, 2, 8), (1, 2, 6), (2, 2, 4), (3, 2, 4), (0, 4, 4)]  # (item, cut, horizon): rollouts and forecasts

MASKS = {
    "document": [],
    "document_chunk_sigma": ["objective.chunk_size=2"],  # one σ per 2-frame chunk: cut points on chunk edges
    "chunk_causal": ["model.mask='chunk_causal'", "model.chunk_size=2", "objective.chunk_size=2"],
    "teacher_forcing": ["model.mask='teacher_forcing'", "model.chunk_size=2", "objective.chunk_size=2",
                        "objective.teacher_forcing=true"],
}


def _cfg(mask: str, *extra: str):
    return load_config(CONFIGS / "tiny_cpu.toml", ["data.max_tokens=200", *MASKS[mask], *extra])


def _items(seed: int = 0, lengths=(10, 8, 6, 7)):
    g = torch.Generator().manual_seed(seed)
    out = []
    for e, F in enumerate(lengths):
        out.append({"latent": torch.randn(48, F, 2, 2, generator=g), "action": torch.randn(6, F, 4, generator=g),
                    "action_mask": torch.rand(6, F, 4, generator=g) > 0.2, "text": torch.randn(5, 64, generator=g),
                    "text_len": 3 + e % 3, "episode_index": 10 + e})
    return out


def _pairs(items, specs):
    return [make_pair(items[i], c, h) for i, c, h in specs]


# ---------------------------------------------------------------------------- schedule and solvers
def test_euler_matches_diffusers_flow_match_euler_scheduler():
    diffusers = pytest.importorskip("diffusers")
    shift, n = 3.0, 7
    sched = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    sched.set_timesteps(sigmas=np.linspace(1.0, 0.0, n + 1)[:-1])
    ours = sigma_grid(n, shift)
    torch.testing.assert_close(sched.sigmas.double(), ours, atol=1e-6, rtol=0)
    torch.testing.assert_close(sched.timesteps.double(), ours[:-1] * 1000, atol=1e-3, rtol=0)

    w = torch.randn(16, 16, generator=torch.Generator().manual_seed(0)) / 4

    def field(x, sigma):  # any smooth velocity; the solver only sees its values
        return torch.tanh(x @ w) + sigma

    x0 = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    x = x0.clone()
    for i, t in enumerate(sched.timesteps):
        x = sched.step(field(x, float(sched.sigmas[i])), t, x).prev_sample
    (mine,) = solve(lambda xs, i: (field(xs[0], float(ours[i])),), (x0,), (ours.float(),), "euler")
    torch.testing.assert_close(mine, x, atol=1e-5, rtol=0)


def test_heun_is_second_order_on_an_analytic_field():
    # dx/dσ = a·x: exact x(0) = x(1)·exp(−a)
    a, x1 = 1.3, torch.tensor([2.0], dtype=torch.float64)
    exact = x1 * math.exp(-a)
    errs = {}
    for solver in ("euler", "heun"):
        for n in (8, 16):
            g = sigma_grid(n, 1.0)
            (x,) = solve(lambda xs, i: (a * xs[0],), (x1,), (g,), solver)
            errs[solver, n] = float((x - exact).abs())
    assert errs["heun", 8] < errs["euler", 8] / 5
    assert errs["euler", 8] / errs["euler", 16] == pytest.approx(2, rel=0.2)  # first order
    assert errs["heun", 8] / errs["heun", 16] > 3  # second order (last step Euler keeps it slightly below 4)
    assert model_calls(8, "heun") == 15 and model_calls(8, "euler") == 8


def test_sigma_grid_rejects_zero_steps():
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        sigma_grid(0, 1.0)


def test_cut_points_on_chunk_multiples_leaving_a_horizon():
    assert cut_points(10, 4, 4, 1) == [1, 2, 4, 6]
    assert cut_points(10, 2, 4, 2) == [2, 6]
    assert all(c % 2 == 0 and c + 4 <= 11 for c in cut_points(11, 3, 4, 2))
    assert cut_points(5, 4, 4, 2) == []  # one chunk + horizon does not fit


# ---------------------------------------------------------------------------- packed == alone
def sample_run(cfg):
    """A "sample" run of pairs made in memory: 2x2 latents, TPF tokens a frame."""
    run = compose(cfg, "sample", hw=(2, 2), device=torch.device("cpu"))
    assert run.geometry.tokens_per_frame == TPF
    return run


def _run(model, cfg, pairs, *, max_tokens=None, solver="euler", stage=None):
    s = PackedSampler(model, sample_run(cfg), SampleOptions(steps=3, solver=solver), max_tokens=max_tokens,
                      stage=stage)
    s.run(pairs)
    return s


@pytest.mark.parametrize("mask", list(MASKS))
def test_packed_sampling_equals_each_pair_alone(mask):
    cfg = _cfg(mask)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    items = _items()
    specs = [(0, 2, 4), (0, 6, 4), (1, 2, 4), (2, 2, 4), (3, 2, 4)]
    packed = _pairs(items, specs)
    s = _run(model, cfg, packed, solver="heun")
    # 5 pairs of 6..10 frames in 40-frame packs: more than one pair per pack
    assert s.forwards < len(specs) * model_calls(3, "heun") * (2 if mask == "teacher_forcing" else 1)
    for p, spec in zip(packed, specs):
        (alone,) = _pairs(items, [spec])
        _run(model, cfg, [alone], max_tokens=TPF * alone.frames, solver="heun")
        torch.testing.assert_close(p.pred_latent, alone.pred_latent, atol=1e-5, rtol=0)
        torch.testing.assert_close(p.pred_action, alone.pred_action, atol=1e-5, rtol=0)
        # context frames stay exactly the truth; target frames were generated
        assert torch.equal(p.pred_latent[:, :p.cut], p.latent[:, :p.cut])
        assert torch.equal(p.pred_action[:, :p.cut], p.action[:, :p.cut])
        assert not torch.allclose(p.pred_latent[:, p.cut:], p.latent[:, p.cut:], atol=1e-3)
        assert torch.equal(p.pred_action[~p.action_mask], torch.zeros_like(p.pred_action[~p.action_mask]))


def test_sampling_builds_masks_on_shape_fixed_segment_grids():
    """Every mask the sampler prepares has segment bounds fixed by the pack's shape (packs with
    different episode counts share one compiled builder on CUDA), as the model's own attention builds
    them in training too."""
    cfg = _cfg("document")
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    seen, real = [], model.attn.prepare

    def spy(*a, **k):
        prep = real(*a, **k)
        seen.append((prep.fixed_bounds, (prep.kind, prep.segment_bounds())))
        return prep

    model.attn.prepare = spy
    _run(model, cfg, _pairs(_items(), [(0, 2, 4), (1, 2, 4), (2, 2, 4), (3, 2, 4), (0, 6, 4)]))
    assert seen and all(fixed for fixed, _ in seen)
    grids = {b for _, b in seen}
    assert len(grids) == len({kind for kind, _ in grids}) == 2  # per mask (self, text) one grid for every pack
    assert real(SequenceLayout.from_rows([[3]], 8, text_len=[1]).tokens(TPF - 1, 1), "document").fixed_bounds


def test_rollout_packed_equals_alone_and_stages_chain():
    cfg = _cfg("teacher_forcing")
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    items = _items(lengths=(10, 8, 6))
    specs = [(i, 2, F - 2) for i, F in enumerate((10, 8, 6))]
    packed = _pairs(items, specs)
    s = _run(model, cfg, packed)
    assert s.forwards == 4 * 3  # 4 stages of one chunk (the longest pair), 3 Euler steps each, all pairs in one pack
    for p, spec in zip(packed, specs):
        (alone,) = _pairs(items, [spec])
        _run(model, cfg, [alone], max_tokens=TPF * alone.frames)
        torch.testing.assert_close(p.pred_latent, alone.pred_latent, atol=1e-5, rtol=0)


def test_the_truth_of_target_frames_never_reaches_the_model():
    cfg = _cfg("chunk_causal")
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    items = _items(lengths=(8,))
    a, = _pairs(items, [(0, 2, 4)])
    changed = dict(items[0], latent=items[0]["latent"].clone(), action=items[0]["action"].clone())
    changed["latent"][:, 2:] += 5.0
    changed["action"][:, 2:] -= 3.0
    b = make_pair(changed, 2, 4)
    _run(model, cfg, [a])
    _run(model, cfg, [b])
    torch.testing.assert_close(a.pred_latent[:, 2:], b.pred_latent[:, 2:], atol=0, rtol=0)
    # while the context does reach it
    ctx = dict(items[0], latent=items[0]["latent"].clone())
    ctx["latent"][:, :2] += 5.0
    c = make_pair(ctx, 2, 4)
    _run(model, cfg, [c])
    assert not torch.allclose(a.pred_latent[:, 2:], c.pred_latent[:, 2:], atol=1e-4)


def test_one_sigma_per_episode_model_refuses_conditioning_in_one_line():
    from dataclasses import replace

    base = _cfg("document")
    cfg = replace(base, objective=replace(base.objective, chunk_size=None))
    with pytest.raises(ValueError, match="one σ per episode and can only generate whole episodes jointly") as e:
        context_chunk(sample_run(cfg))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="can only generate"):
        PackedSampler(build_model(cfg), sample_run(cfg))


# ---------------------------------------------------------------------------- metrics
def _hand_pair():
    # 2 channels (dataset columns 0, 1 -> channels 0, 1; channel 2 unused), 4 frames, A = 2; cut 2
    lat = torch.arange(2 * 4 * 1 * 2, dtype=torch.float32).view(2, 4, 1, 2) / 10
    act = torch.tensor([[[0.1, 0.2], [0.3, 0.4], [0.5, 0.6], [0.7, 0.8]],
                        [[-.1, -.2], [-.3, -.4], [-.5, -.6], [-.7, -.8]],
                        [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]])
    mask = torch.ones_like(act, dtype=torch.bool)
    mask[2] = False
    mask[0, 1, 1] = False  # channel 0's last context value is then 0.3
    mask[1, 3, 0] = False
    p = make_pair({"latent": lat, "action": act, "action_mask": mask, "episode_index": 3}, 2, 2)
    p.pred_latent[:, 2:] = lat[:, 2:] + 0.5
    p.pred_action[:, 2:] = torch.where(mask[:, 2:], act[:, 2:] * 2, 0.0)
    return p


def test_metrics_and_baselines_against_numpy():
    p = _hand_pair()
    norm = ActionStats(mode="quantile", low=(0.0, -2.0), high=(4.0, 2.0))
    mean_raw = [1.0, 0.5]
    m = Metrics(norm, [0, 1], mean_raw)
    m.add(p)
    out = m.result()

    true = p.action[:2, 2:].numpy().astype(np.float64)
    msk = p.action_mask[:2, 2:].numpy()
    pred = true * 2
    raw = lambda y: np.stack([denormalize(norm, y[c], np.array([c])) for c in range(2)])  # noqa: E731
    assert out["action_mse"] == pytest.approx(((pred - true) ** 2)[msk].mean())
    assert out["action_l1"] == pytest.approx(np.abs(pred - true)[msk].mean())
    assert out["action_mse_raw"] == pytest.approx(((raw(pred) - raw(true)) ** 2)[msk].mean())
    assert out["action_mse_per_dim"][1] == pytest.approx(((pred[1] - true[1]) ** 2)[msk[1]].mean())
    assert out["action_mse_per_step"][1] == pytest.approx(((pred[:, 1] - true[:, 1]) ** 2)[msk[:, 1]].mean())
    assert out["latent_mse"] == pytest.approx(0.25)
    # quantile width 4 and 4 (high - low): raw error = normalized error · width / 2
    assert out["action_l1_raw"] == pytest.approx(out["action_l1"] * 2)

    last = np.array([0.3, -0.4])[:, None, None]  # channel 0: the masked 0.4 is skipped
    assert (out["baselines"]["last"]["action_mse"]
            == pytest.approx(((last - true) ** 2 * np.ones_like(true))[msk].mean()))
    mean_n = normalize(norm, np.array(mean_raw))  # [-0.5, 0.25]
    np.testing.assert_allclose(mean_n, [-0.5, 0.25])
    assert out["baselines"]["mean"]["action_mse"] == pytest.approx(((mean_n[:, None, None] - true) ** 2)[msk].mean())
    lat = p.latent.numpy().astype(np.float64)
    assert out["baselines"]["last"]["latent_mse"] == pytest.approx(((lat[:, 1:2] - lat[:, 2:]) ** 2).mean())
    ctx_mean = lat[:, :2].mean(axis=(1, 2, 3), keepdims=True)
    assert out["baselines"]["mean"]["latent_mse"] == pytest.approx(((ctx_mean - lat[:, 2:]) ** 2).mean())


def test_ensemble_scores_against_brute_force_and_the_gaussian_crps():
    from math import erf, exp, pi, sqrt

    from flexpack.sampling.ensemble import ensemble_scores

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(5, 3, 4)), rng.normal(size=(3, 4))
    k2, spread, crps = ensemble_scores(x, y)
    np.testing.assert_allclose(k2, (x.mean(0) - y) ** 2)
    np.testing.assert_allclose(spread, x.var(0))
    brute = np.abs(x - y).mean(0) - np.abs(x[:, None] - x[None]).sum((0, 1)) / (2 * 25)
    np.testing.assert_allclose(crps, brute, atol=1e-12)
    _, s1, c1 = ensemble_scores(x[:1], y)  # one sample: no spread, CRPS = absolute error
    assert (s1 == 0).all()
    np.testing.assert_allclose(c1, np.abs(x[0] - y))
    # many draws of N(0, 1) against y: the closed form σ[z(2Φ(z) − 1) + 2φ(z) − 1/√π]
    draws = rng.normal(size=(20000, 1))
    z = 0.7
    exact = z * erf(z / sqrt(2)) + 2 * exp(-z * z / 2) / sqrt(2 * pi) - 1 / sqrt(pi)
    assert ensemble_scores(draws, np.array([z]))[2][0] == pytest.approx(exact, abs=5e-3)
    with pytest.raises(ValueError, match="samples must be"):
        ensemble_scores(x, y[0])


def test_metrics_of_k_samples_against_numpy():
    p = _hand_pair()
    q = make_pair({"latent": p.latent, "action": p.action, "action_mask": p.action_mask, "episode_index": 3}, 2, 2,
                  sample=1)
    q.pred_latent[:, 2:] = p.latent[:, 2:] - 0.25
    q.pred_action[:, 2:] = torch.where(p.action_mask[:, 2:], p.action[:, 2:] * 0.5, 0.0)
    m = Metrics(None, [0, 1], None)
    m.add(p, q)
    out = m.result()
    true, msk = p.action[:2, 2:].numpy().astype(np.float64), p.action_mask[:2, 2:].numpy()
    a = np.stack([true * 2, true * 0.5])
    assert out["samples"] == 2 and out["pairs"] == 1
    assert out["action_mse"] == pytest.approx(((a[0] - true) ** 2)[msk].mean())  # the first sample's
    assert out["action_mse_kmean"] == pytest.approx(((a.mean(0) - true) ** 2)[msk].mean())
    assert out["action_spread"] == pytest.approx(a.var(0)[msk].mean())
    crps = np.abs(a - true).mean(0) - np.abs(a[0] - a[1]) / 4  # 1/(2K²) Σ_kl |x_k − x_l| with K = 2
    assert out["action_crps"] == pytest.approx(crps[msk].mean())
    assert out["latent_mse"] == pytest.approx(0.25) and out["latent_mse_kmean"] == pytest.approx(0.125 ** 2)
    assert out["latent_spread"] == pytest.approx(0.375 ** 2) and out["latent_crps"] == pytest.approx(0.375 - 0.75 / 4)
    assert out["action_mse_kmean_per_step"][0] == pytest.approx(((a.mean(0) - true)[:, 0] ** 2)[msk[:, 0]].mean())
    other = make_pair({"latent": p.latent, "action": p.action, "action_mask": p.action_mask, "episode_index": 4}, 2, 2)
    with pytest.raises(AssertionError, match="samples of one"):
        m.add(p, other)


def test_denormalize_inverts_the_dataset_normalizer():
    from flexpack.data.actions import ActionNormalizer

    u = np.random.default_rng(0).uniform(0, 1, size=(7, 3))
    for n in (ActionNormalizer("quantile", np.array([-2.0, 0.0, 1.0]), np.array([4.0, 5.0, 3.0])),
              ActionNormalizer("meanstd", np.array([1.0, 0.5, 0.0]), np.array([2.0, 0.5, 1.0]))):
        state = ActionStats.of(n)
        x = n.low + u * (n.high - n.low) if n.mode == "quantile" else 4 * u - 1  # quantile clips outside q01..q99
        np.testing.assert_allclose(denormalize(state, n(x), np.arange(3)), x, atol=1e-5)
        np.testing.assert_allclose(normalize(state, x), n(x), atol=1e-6)


def test_sampler_euler_equals_diffusers_scheduler_on_one_episode():
    """The whole forecast of one pair: the sampler vs a loop of diffusers' scheduler steps over the
    same model calls (video and actions each stepped by their own scheduler; same σ grid)."""
    diffusers = pytest.importorskip("diffusers")
    from dataclasses import replace

    from flexpack.sampling.pairs import pair_noise

    cfg = _cfg("document", "objective.shift=3.0", "objective.action_shift=2.0")
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    pair = _pairs(_items(lengths=(9,)), [(0, 3, 6)])[0]
    ref = make_pair(_items(lengths=(9,))[0], 3, 6)
    _run(model, cfg, [pair])  # 3 Euler steps, in a 40-frame pack

    n = 3
    batch = PackCollate(9)([ref.item(9)])
    target = (batch.layout.frame_pos >= 3)[0]  # (Fr,)
    noise, anoise = pair_noise(batch.layout, [ref.seed], batch.latent.shape, batch.action.shape, torch.device("cpu"))
    t5, a_live = target[None, None, :, None, None], target[None, None, :, None] & batch.action_mask
    x = torch.where(t5, noise, batch.latent)
    a = torch.where(a_live, anoise, batch.action)
    scheds = []
    for shift in (3.0, 2.0):
        s = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
        s.set_timesteps(sigmas=np.linspace(1.0, 0.0, n + 1)[:-1])
        scheds.append(s)
    sv, sa = scheds
    with torch.no_grad():
        for i in range(n):
            tv = torch.where(target, sv.timesteps[i], 0.0)[None]
            ta = torch.where(target, sa.timesteps[i], 0.0)[None]
            out = model(replace(batch, latent=x, action=a), timestep=tv, action_timestep=ta, mask="document")
            x = torch.where(t5, sv.step(out.video, sv.timesteps[i], x).prev_sample, x)
            a = torch.where(a_live, sa.step(out.action, sa.timesteps[i], a).prev_sample, a)
    torch.testing.assert_close(pair.pred_latent, x[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(pair.pred_action, torch.where(batch.action_mask, a, 0.0)[0], atol=1e-5, rtol=0)


def test_a_pair_longer_than_a_pack_is_named():
    cfg = _cfg("document", "data.max_tokens=30")  # 6 frames per pack
    model = build_model(cfg).eval()
    pairs = _pairs(_items(), [(0, 2, 4), (0, 4, 4)])
    with pytest.raises(ValueError, match=r"episode 10 at cut 4: 8 latent frames = 40 tokens do not fit a pack of "
                                         r"data.max_tokens=30"):
        _run(model, cfg, pairs)
    with pytest.raises(ValueError, match="solver must be one of"):
        PackedSampler(model, sample_run(cfg), SampleOptions(solver="rk4"))


def test_benchmark_script_runs_tiny_and_reports_its_keys(tmp_path):
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "sample.py"), "--tiny", "--sets", "short",
                           "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())["short"]
    assert r["recompiles_after_warmup"] == 0 and r["pairs"] > r["episodes"]
    assert r["packed_vs_loop"] == pytest.approx(r["packed_tokens_per_s"] / r["loop_tokens_per_s"])
    assert r["packed_model_calls"] < r["pairs"] * r["steps"]  # several pairs per pack
