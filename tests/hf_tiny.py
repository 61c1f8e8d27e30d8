"""Tiny random transformers text encoders and tokenizers, built offline for tests (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

WORDS = ("pick place the a cube block red blue green push pull open close drawer task move to and up down "
         "left right stack cup lift put grasp").split()


def tiny_tokenizer():
    """A word-level fast tokenizer (lower-cased words, EOS appended, pad id 0), as UMT5's would be used."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def save_tiny_umt5(folder: Path, *, d_model: int = 16, tokenizer: bool = True, seed: int = 0) -> Path:
    """A 1-layer random ``UMT5EncoderModel`` (+ tokenizer) saved with ``save_pretrained``."""
    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    cfg = UMT5Config(vocab_size=len(WORDS) + 3, d_model=d_model, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                     relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0)
    UMT5EncoderModel(cfg).eval().save_pretrained(folder)
    if tokenizer:
        tiny_tokenizer().save_pretrained(folder)
    return Path(folder)


def tiny_diffusers(seed: int = 0, **kw):
    """A random WanTransformer3DModel fitting configs/tiny_cpu.toml's data (48 latent channels, 64-d text)."""
    import diffusers
    import torch

    torch.manual_seed(seed)
    args = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=48, out_channels=48,
                text_dim=64, freq_dim=16, ffn_dim=48, num_layers=2)
    m = diffusers.WanTransformer3DModel(**{**args, **kw}).eval()
    with torch.no_grad():
        for p in m.parameters():  # off the init, so every mapped weight matters
            p.add_(torch.randn_like(p) * 0.1)
    return m
