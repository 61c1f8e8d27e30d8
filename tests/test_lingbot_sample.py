"""Sampling the lingbot-va family: flexpack's packed sampler against LeRobot's own ``LingBotVAPolicy._infer`` (one
chunk, the same weights, prompt, negative prompt and noise), and packed pairs equal to each pair alone.

What is compared: LeRobot's ``_infer`` denoises one chunk of ``frame_chunk_size`` latent frames, video stream then
action stream, each with classifier-free guidance on its KV cache; flexpack's :class:`LingbotSampler` solves the
same frames of a pair with the training mask. Both run in float32 on the CPU (LeRobot's inference attention is
SDPA, no bfloat16 cast), from the same starting noise (LeRobot's ``torch.randn`` draws, injected into flexpack),
so the generated latents and the actions of the used channels agree to float32 rounding: a relative error
(max |diff| / max |LeRobot's|) below 1e-5 over every generated value (5e-7 .. 1e-6 measured; a guidance
scale of 4 instead of 5, or another negative prompt, gives 3e-4 .. 6e-3). Two contexts: LeRobot's first chunk (frame
0 known, held at timestep 0 in the chunk; flexpack: cut 1 inside block 0) and a later chunk after a chunk of
observed latents and executed actions went into the cache (``_compute_kv_cache``; flexpack: cut 4, the clean
copy).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("lerobot.policies.lingbot_va", reason="the installed lerobot has no lingbot_va policy")

from lerobot.configs.types import FeatureType, PolicyFeature  # noqa: E402
from lerobot.policies.lingbot_va.configuration_lingbot_va import LingBotVAConfig  # noqa: E402
from lerobot.policies.lingbot_va.modeling_lingbot_va import LingBotVAPolicy  # noqa: E402

from flexpack.attention.flex import FlexAttnFunc  # noqa: E402
from flexpack.families.lingbot.convert import build_from_lerobot  # noqa: E402
from flexpack.families.lingbot.sampler import LingbotSampler  # noqa: E402
from flexpack.run.compose import compose
from flexpack.run.resolve import model_config_of  # noqa: E402
from flexpack.sampling.pairs import Pair  # noqa: E402
from flexpack.sampling.solver import SampleOptions  # noqa: E402
from helpers import tiny_config  # noqa: E402

LINGBOT = ["model.family=lingbot-va", "model.preset=lingbot-va-tiny"]
H, W, C, A, USED = 4, 4, 4, 4, list(range(6))  # latent grid, frames per chunk, action steps per frame, channels
TOL = 1e-5
pytestmark = pytest.mark.usefixtures("one_thread")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def setup():
    """A tiny LeRobot policy (float32, random weights off their init), flexpack's model holding its weights,
    the run config of the same fields, and a prompt / negative prompt padded as LeRobot pads them."""
    cfg = tiny_config("unused", "unused", *LINGBOT, "data.max_tokens=400", "model.overrides.num_inference_steps=5",
                      "model.overrides.action_num_inference_steps=7", "model.overrides.action_guidance_scale=3.0")
    m = model_config_of(cfg)
    assert (m.guidance_scale, m.frame_chunk_size, m.action_per_frame) == (5.0, C, A)
    fields = {k: v for k, v in m.lerobot_fields().items()}
    fields.update(patch_size=tuple(fields["patch_size"]), obs_cam_keys=["observation.images.cam0"], height=16 * H,
                  width=16 * W, dtype="float32", device="cpu", attn_mode="torch")
    torch.manual_seed(0)
    policy = LingBotVAPolicy(LingBotVAConfig(input_features={"observation.images.cam0": PolicyFeature(
        type=FeatureType.VISUAL, shape=(3, 16 * H, 16 * W))}, **fields)).eval()
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model = build_from_lerobot(policy.state_dict(), m, attn=FlexAttnFunc("dense")).eval()
    g = torch.Generator().manual_seed(1)
    text, neg = torch.randn(5, m.text_dim, generator=g), torch.randn(1, m.text_dim, generator=g)
    return cfg, policy, model, (text, 5), (neg, 1)


def padded(text: torch.Tensor) -> torch.Tensor:
    """(1, 512, D): LeRobot's prompt embedding of ``text``'s tokens, zero padded."""
    out = torch.zeros(1, 512, text.shape[1])
    out[0, : text.shape[0]] = text
    return out


def start(policy, prompt, negative) -> None:
    policy.reset()
    policy._prompt_embeds, policy._negative_prompt_embeds = padded(prompt[0]), padded(negative[0])
    policy._init_streaming_cache(None)


def make_pair(latent: torch.Tensor, action: torch.Tensor, cut: int, prompt, episode: int = 0) -> Pair:
    """A pair over ``latent`` (48, L, H, W) and ``action`` (30, L, A): actions in the used channels, none at frame 0."""
    mask = torch.zeros_like(action, dtype=torch.bool)
    mask[USED, 1:] = True
    return Pair(episode=episode, segment=-1, cut=cut, horizon=latent.shape[1] - cut, latent=latent,
                action=torch.where(mask, action, 0.0), action_mask=mask, text=prompt[0], text_len=prompt[1])


def injected(lat: torch.Tensor, act: torch.Tensor, first: int):
    """The sampler's noise: LeRobot's draws for frames [first, first + C) of the one pair of the pack."""
    def noise(lay, pairs, lshape, ashape, dev):
        (r,), (s,) = lay.episode_row.tolist(), lay.episode_start.tolist()
        n, an = torch.zeros(lshape), torch.zeros(ashape)
        n[r, :, s + first: s + first + C] = lat[0]
        an[r, :, s + first: s + first + C] = act[0, ..., 0]
        return n, an
    return noise


def run_ours(cfg, model, pairs, negative, noise=None) -> LingbotSampler:
    run = compose(cfg, "sample", hw=(H, W), device=torch.device("cpu"))
    assert run.geometry.tokens_per_frame == (H // 2) * (W // 2) + A
    sampler = LingbotSampler(model, run, SampleOptions(), negative_text=negative, noise=noise)
    sampler.run(pairs)
    return sampler


def test_first_chunk_equals_lerobots_infer(setup) -> None:
    """LeRobot's first chunk (frame 0 observed): frames 1..3 of video and actions as its _infer makes them."""
    cfg, policy, model, prompt, negative = setup
    g = torch.Generator().manual_seed(2)
    init = torch.randn(1, 48, 1, H, W, generator=g)
    start(policy, prompt, negative)
    torch.manual_seed(7)
    actions, latents = policy._infer(init, frame_st_id=0)
    torch.manual_seed(7)  # _infer's own draws: latents, then actions
    lat_noise, act_noise = torch.randn(1, 48, C, H, W), torch.randn(1, 30, C, A, 1)
    truth = torch.cat([init[0], torch.randn(48, C - 1, H, W, generator=g)], 1)  # targets' truth is never read
    pair = make_pair(truth, torch.randn(30, C, A, generator=g), cut=1, prompt=prompt)
    sampler = run_ours(cfg, model, [pair], negative, injected(lat_noise, act_noise, 0))
    assert rel_err(pair.pred_latent[:, 1:], latents[0, :, 1:]) < TOL
    assert rel_err(pair.pred_action[USED, 1:], actions[0, USED, 1:, :, 0]) < TOL
    assert torch.equal(pair.pred_latent[:, 0], init[0, :, 0]) and not pair.pred_action[:, 0].any()
    assert not pair.pred_action[6:].any()  # unused channels stay 0, as LeRobot zeroes them
    assert sampler.forwards == 2 * 5 + 2 * 7  # both streams guided: a negative pass per step


def test_a_chunk_after_context_equals_lerobots_cache(setup) -> None:
    """A chunk after observed latents and executed actions went into LeRobot's KV cache: flexpack's cut 4 with
    them as the clean copy gives frames 4..7 as LeRobot's _infer(None, frame_st_id=4)."""
    cfg, policy, model, prompt, negative = setup
    g = torch.Generator().manual_seed(3)
    ctx_lat, ctx_act = torch.randn(1, 48, C, H, W, generator=g), torch.zeros(1, 30, C, A, 1)
    ctx_act[:, USED, 1:] = torch.randn(1, len(USED), C - 1, A, 1, generator=g)  # frame 0 carries no action
    start(policy, prompt, negative)
    policy._init_latent = None
    policy._encode_frames = lambda frames: ctx_lat  # the observed chunk's latents, as the VAE would give them
    policy._compute_kv_cache([None], ctx_act)
    assert policy._frame_st_id == C
    torch.manual_seed(8)
    actions, latents = policy._infer(None, frame_st_id=C)
    torch.manual_seed(8)
    lat_noise, act_noise = torch.randn(1, 48, C, H, W), torch.randn(1, 30, C, A, 1)
    truth = torch.cat([ctx_lat[0], torch.randn(48, C, H, W, generator=g)], 1)
    acts = torch.cat([ctx_act[0, ..., 0], torch.randn(30, C, A, generator=g)], 1)
    pair = make_pair(truth, acts, cut=C, prompt=prompt)
    run_ours(cfg, model, [pair], negative, injected(lat_noise, act_noise, C))
    assert rel_err(pair.pred_latent[:, C:], latents[0]) < TOL
    assert rel_err(pair.pred_action[USED, C:], actions[0, USED, :, :, 0]) < TOL
    assert torch.equal(pair.pred_latent[:, :C], ctx_lat[0])  # the context stays the truth


@pytest.mark.slow  # 15 s on 2 cores
def test_packed_pairs_equal_each_pair_alone(setup) -> None:
    """Several pairs (cuts inside a block and on one, one stage and several, other lengths) in one pack give each
    pair's result alone (their own noise, keyed by the pair); the stages end on LeRobot's chunk boundaries."""
    cfg, _, model, prompt, negative = setup

    def pairs():
        out = []
        for e, (frames, cut) in enumerate([(4, 1), (8, 4), (11, 2), (6, 4)]):
            gen = torch.Generator().manual_seed(10 + e)
            latent, action = torch.randn(48, frames, H, W, generator=gen), torch.randn(30, frames, A, generator=gen)
            out.append(make_pair(latent, action, cut=cut, prompt=prompt, episode=e))
        return out

    packed = pairs()
    sampler = run_ours(cfg, model, packed, negative)
    stages = sampler.forwards // (2 * 5 + 2 * 7)
    assert stages == 3  # (11, 2): frames 2..3, 4..7, 8..10 — the longest pair's three blocks
    for i, alone in enumerate(pairs()):
        run_ours(cfg, model, [alone], negative)
        assert rel_err(packed[i].pred_latent, alone.pred_latent) < TOL, i
        assert rel_err(packed[i].pred_action, alone.pred_action) < TOL, i
        assert not torch.equal(alone.pred_latent[:, alone.cut:], alone.latent[:, alone.cut:])


def test_guidance_off_runs_no_negative_pass(setup) -> None:
    """guidance_scale and action_guidance_scale <= 1: one model call per step and no negative prompt needed."""
    cfg, _, model, prompt, _ = setup
    plain = replace(cfg, model=replace(cfg.model, overrides={**cfg.model.overrides, "guidance_scale": 1.0,
                                                             "action_guidance_scale": 1.0}))
    gen = torch.Generator().manual_seed(5)
    pair = make_pair(torch.randn(48, 8, H, W, generator=gen), torch.randn(30, 8, A, generator=gen), 4, prompt)
    sampler = run_ours(plain, model, [pair], None)
    assert sampler.forwards == 5 + 7


def test_negative_prompt_is_the_empty_prompt_of_the_caches_encoder(tiny_dataset, tmp_path, monkeypatch) -> None:
    """The negative prompt is "" through the text encoder the cache names (its text files' header); an encoder
    that cannot be loaded is one line naming the file and how to sample without guidance."""
    from flexpack.data import cache
    from flexpack.data.text import HashTextEncoder, text_encoder_named
    from flexpack.families.lingbot import sampler as lingbot
    from flexpack.run.build import open_dataset

    ds = open_dataset(tiny_config(tiny_dataset, tmp_path, *LINGBOT))
    emb, n = lingbot.negative_prompt(ds)
    want, m = HashTextEncoder().encode("")
    assert n == m == 1 and torch.equal(emb, want)
    assert text_encoder_named("hash:8x4").encode("a b")[0].shape == (4, 8)
    with pytest.raises(ValueError, match="expected umt5:PATH:MAX_LEN"):
        text_encoder_named("umt5:/models/umt5")
    real = cache.read_text_header
    monkeypatch.setattr(cache, "read_text_header", lambda f: replace(real(f), encoder=f"umt5:{tmp_path}/gone:512"))
    with pytest.raises(ValueError, match=r"task_000000.safetensors: classifier-free guidance needs the negative "
                                         r"prompt through its text encoder .*guidance_scale=1"):
        lingbot.negative_prompt(ds)


def test_inference_fields_come_from_a_lerobot_config() -> None:
    """LeRobot's inference fields of a policy config.json are the family's (a pretrained policy samples as it was
    configured); the registry lists them as sampling fields, which a trained-config check does not compare."""
    from flexpack.families.lingbot.config import LEROBOT_INFERENCE, config_from_lerobot
    from flexpack.models.registry import family
    from flexpack.run.state.trained import differences

    m = config_from_lerobot({"type": "lingbot_va", "frame_chunk_size": 2, "attn_window": 8, "num_inference_steps": 3,
                             "action_num_inference_steps": 4, "guidance_scale": 2.5, "action_guidance_scale": 1.5})
    assert [getattr(m, k) for k in LEROBOT_INFERENCE] == [2, 8, 3, 4, 2.5, 1.5]
    assert family("lingbot-va").sampling_fields == LEROBOT_INFERENCE
    a = tiny_config("unused", "unused", *LINGBOT)
    b = tiny_config("unused", "unused", *LINGBOT, "model.overrides.guidance_scale=1.0")
    c = tiny_config("unused", "unused", *LINGBOT, "objective.shift=4.0")
    assert differences(b, a) == {} and "model.snr_shift" in differences(c, a)
    with pytest.raises(ValueError, match="guidance_scale and action_guidance_scale must be finite and >= 0"):
        tiny_config("unused", "unused", *LINGBOT, "model.overrides.guidance_scale=-1.0")
