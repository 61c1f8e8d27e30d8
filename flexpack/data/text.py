"""Text encoders for the task embeddings: task string -> (L, Dt) float32 padded with zeros, plus
the number of valid tokens.

``hash`` is a deterministic stand-in (nothing can be downloaded here): lower-cased word tokens,
each mapped to a fixed unit-scale vector seeded by a hash of the token and its position, so equal
tasks give equal embeddings and different tasks differ. A real encoder (e.g. umT5) only needs the
same ``name`` / ``encode`` interface; add it to :func:`make_text_encoder`.
"""

from __future__ import annotations

import hashlib
import re
from typing import Protocol

import numpy as np
import torch


class TextEncoder(Protocol):
    name: str

    def encode(self, text: str) -> tuple[torch.Tensor, int]: ...


class HashTextEncoder:
    def __init__(self, dim: int = 64, max_len: int = 16) -> None:
        if dim < 1 or max_len < 1:
            raise ValueError(f"hash text encoder needs dim >= 1 and max_len >= 1, got {dim}, {max_len}")
        self.dim, self.max_len = dim, max_len
        self.name = f"hash:{dim}x{max_len}"

    def _token(self, token: str, position: int) -> np.ndarray:
        seed = int.from_bytes(hashlib.blake2b(f"{position}:{token}".encode(), digest_size=8).digest(), "little")
        return np.random.default_rng(seed).standard_normal(self.dim).astype(np.float32) / np.sqrt(self.dim)

    def encode(self, text: str) -> tuple[torch.Tensor, int]:
        tokens = re.findall(r"\w+|[^\w\s]", text.lower())[: self.max_len] or ["<empty>"]
        out = np.zeros((self.max_len, self.dim), dtype=np.float32)
        for i, tok in enumerate(tokens):
            out[i] = self._token(tok, i)
        return torch.from_numpy(out), len(tokens)


def make_text_encoder(spec: str, *, device: str = "cpu", max_len: int = 512) -> TextEncoder:
    """``hash`` or ``hash:DIMxLEN`` (default 64x16), ``umt5:PATH`` or ``hf:PATH`` (``max_len`` tokens on ``device``)."""
    if spec == "hash":
        return HashTextEncoder()
    m = re.fullmatch(r"hash:(\d+)x(\d+)", spec)
    if m:
        return HashTextEncoder(int(m.group(1)), int(m.group(2)))
    kind, sep, path = spec.partition(":")
    if sep and path and kind in ("umt5", "hf"):
        from flexpack.data.text_hf import HFTextEncoder

        return HFTextEncoder(kind, path, max_len=max_len, device=device)
    raise ValueError(f"unknown text encoder {spec!r}; use 'hash', 'hash:DIMxLEN', 'umt5:PATH' or 'hf:PATH'")


def text_encoder_named(name: str, *, device: str = "cpu") -> TextEncoder:
    """The encoder whose ``name`` a text cache records (``hash:DIMxLEN``, ``umt5:PATH:LEN``, ``hf:PATH:LEN``)."""
    kind, _, rest = name.partition(":")
    if kind in ("umt5", "hf"):
        path, _, max_len = rest.rpartition(":")
        if not max_len.isdigit():
            raise ValueError(f"text encoder name {name!r}: expected {kind}:PATH:MAX_LEN")
        return make_text_encoder(f"{kind}:{path}", device=device, max_len=int(max_len))
    return make_text_encoder(name)


def encode_texts(encoder: TextEncoder, texts: list[str], batch_size: int = 16) -> list[tuple[torch.Tensor, int]]:
    """Encode ``texts`` ``batch_size`` at a time (``encode_batch`` where the encoder has it)."""
    batch = getattr(encoder, "encode_batch", None)
    if batch is None:
        return [encoder.encode(t) for t in texts]
    return [r for i in range(0, len(texts), batch_size) for r in batch(texts[i : i + batch_size])]
