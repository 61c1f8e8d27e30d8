"""Tiny LeRobot ``lingbot_va`` artifacts built offline with LeRobot's, diffusers' and transformers' own APIs (imported
as ``lingbot_tiny``): a policy checkpoint to fine-tune from, and the frozen modules of a ``wan_pretrained_path``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def save_policy(path: Path, seed: int = 0, size: int = 32, **kw: Any) -> Any:
    """A tiny LeRobot lingbot_va policy of the demo data's shape (48-channel latents, 64-d text, 6 action columns,
    its ``obs_cam_keys`` as VISUAL inputs of ``size`` x ``size`` pixels), saved with LeRobot's save_pretrained; every
    tensor moved off its init (LeRobot zero-inits some), so a load is checked. Returns the policy."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.lingbot_va.configuration_lingbot_va import LingBotVAConfig
    from lerobot.policies.lingbot_va.modeling_lingbot_va import LingBotVAPolicy

    fields = dict(num_attention_heads=2, attention_head_dim=32, text_dim=64, freq_dim=32, ffn_dim=128, num_layers=2,
                  used_action_channel_ids=list(range(6)), obs_cam_keys=["observation.images.cam0"], dtype="float32",
                  device="cpu", snr_shift=4.0)
    fields.update(kw)
    torch.manual_seed(seed)
    inputs = {key: PolicyFeature(type=FeatureType.VISUAL, shape=(3, size, size)) for key in fields["obs_cam_keys"]}
    policy = LingBotVAPolicy(LingBotVAConfig(input_features=inputs, **fields))
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    policy.save_pretrained(path)
    return policy


def save_frozen_modules(folder: Path, text_dim: int) -> Path:
    """A local wan_pretrained_path: a tiny random Wan2.2-style VAE (48 latent channels, 16 pixels and 4 frames per
    latent cell, patchified by 2 as Wan2.2's), a tiny random UMT5 encoder of width ``text_dim`` and a T5 tokenizer
    built from a small vocabulary, in vae/, text_encoder/, tokenizer/ (nothing downloaded)."""
    from diffusers import AutoencoderKLWan
    from transformers import T5TokenizerFast, UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=48, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                     temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                     patch_size=2, scale_factor_spatial=16, latents_mean=(torch.randn(48, generator=g) * 0.1).tolist(),
                     latents_std=(1 + torch.rand(48, generator=g)).tolist()).save_pretrained(folder / "vae")
    words = "pick up the red cube open drawer push button twice stack blue block on green one".split()
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(f"\u2581{w}", -1.0 - i) for i, w in enumerate(words)]
    tok = T5TokenizerFast(vocab=vocab, extra_ids=0)
    tok.save_pretrained(folder / "tokenizer")
    UMT5EncoderModel(UMT5Config(vocab_size=len(vocab), d_model=text_dim, d_kv=16, d_ff=2 * text_dim, num_layers=1,
                                num_heads=2)).save_pretrained(folder / "text_encoder")
    return folder
