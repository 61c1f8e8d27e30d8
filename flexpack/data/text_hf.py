"""Real text encoders from local ``transformers`` folders: ``umt5:PATH`` (Wan's umT5) and ``hf:PATH``.

Wan's recipe (diffusers' ``WanPipeline._get_t5_prompt_embeds``): the prompt is cleaned (HTML
entities decoded, whitespace collapsed), tokenized to ``max_len`` = 512 tokens with padding and
truncation, encoded with the attention mask, and the embeddings at padding positions are set to
zero; the number of real tokens (EOS included) is the cache's ``text_len``. The cache stores the
(max_len, Dt) embedding in bf16 per task (:func:`flexpack.data.cache.write_text`).

``PATH`` is a folder with the encoder (``config.json`` + weights) and its tokenizer, or a diffusers
pipeline folder holding ``text_encoder/`` and ``tokenizer/`` (Wan2.2-TI2V-5B-Diffusers), or such a
``text_encoder/`` folder itself (its sibling ``tokenizer/`` is used). ``umt5:`` loads
``UMT5EncoderModel``; ``hf:`` loads the class the config names in ``architectures`` (else
``AutoModel``) and uses its encoder where it is an encoder-decoder. Nothing is downloaded.
Weights run in bfloat16 on CUDA (as Wan runs umT5) and float32 on the CPU.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "spiece.model", "tokenizer.model", "vocab.txt", "vocab.json"
)


def clean_prompt(text: str) -> str:
    """Wan's prompt cleaning without ftfy: entities decoded (twice, as Wan), whitespace collapsed."""
    return re.sub(r"\s+", " ", html.unescape(html.unescape(text))).strip()


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def resolve_folders(path: str | Path) -> tuple[Path, Path]:
    """(encoder folder, tokenizer folder) of ``PATH`` (see the module docstring); one-line errors."""
    path = Path(path)
    if (path / "text_encoder").is_dir():  # a diffusers pipeline folder
        encoder, candidates = path / "text_encoder", [path / "tokenizer"]
    else:
        encoder, candidates = path, [path, path.parent / "tokenizer"]
    if not (encoder / "config.json").is_file():
        raise FileNotFoundError(f"{encoder}: no config.json; the text encoder needs a local transformers folder "
                                "(as written by save_pretrained)")
    for folder in candidates:
        if _has_tokenizer(folder):
            return encoder, folder
    raise FileNotFoundError(f"{encoder}: no tokenizer ({', '.join(TOKENIZER_FILES[:3])}, ...) in "
                            f"{' or '.join(str(c) for c in candidates)}; save it there with tokenizer.save_pretrained")


def _model_class(kind: str, encoder: Path) -> Any:
    import transformers

    if kind == "umt5":
        return transformers.UMT5EncoderModel
    names = json.loads((encoder / "config.json").read_text()).get("architectures") or []
    for name in names:
        if hasattr(transformers, name):
            return getattr(transformers, name)
    return transformers.AutoModel


class HFTextEncoder:
    """A transformers encoder + tokenizer behind the :class:`~flexpack.data.text.TextEncoder` interface."""

    def __init__(self, kind: str, path: str, *, max_len: int = 512, device: str | torch.device = "cpu") -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise ImportError(f"the {kind} text encoder needs transformers (pip install 'flexpack[hf]')") from exc
        if max_len < 1:
            raise ValueError(f"text max length must be >= 1, got {max_len}")
        encoder, tok_dir = resolve_folders(path)
        self.device = torch.device(device)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
        if self.tokenizer.pad_token is None:  # e.g. decoder-style tokenizers: the pad id is masked out anyway
            if self.tokenizer.eos_token is None:
                raise ValueError(f"{tok_dir}: the tokenizer has neither a pad nor an eos token to pad with")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model = _model_class(kind, encoder).from_pretrained(str(encoder), local_files_only=True, dtype=dtype)
        if getattr(model.config, "is_encoder_decoder", False):
            model = model.get_encoder()
        self.model = model.to(self.device).eval()
        self.max_len = max_len
        self.name = f"{kind}:{path}:{max_len}"  # recorded in the cache: another encoder or length re-encodes

    @torch.no_grad()
    def encode_batch(self, texts: list[str]) -> list[tuple[torch.Tensor, int]]:
        """(max_len, Dt) float32 embeddings, zero at padding, and the real token count of each text."""
        tok = self.tokenizer([clean_prompt(t) for t in texts], padding="max_length", max_length=self.max_len,
                             truncation=True, add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        ids, mask = tok["input_ids"].to(self.device), tok["attention_mask"].to(self.device)
        hidden_BLD = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        hidden_BLD = hidden_BLD * mask[..., None].to(hidden_BLD.dtype)  # padding rows are exactly zero
        lengths = mask.sum(1).tolist()
        return [(h.cpu(), int(n)) for h, n in zip(hidden_BLD, lengths)]

    def encode(self, text: str) -> tuple[torch.Tensor, int]:
        return self.encode_batch([text])[0]
