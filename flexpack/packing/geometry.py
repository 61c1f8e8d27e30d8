"""Token geometry: how many tokens a latent frame is, and how many frames a micro-batch holds.

One latent frame of an episode is ``video_tokens`` patches plus ``action_tokens`` action steps
(:attr:`TokenGeometry.tokens_per_frame`, the unit of ``max_tokens``); under teacher forcing the
model sees every frame twice (a noisy and a clean copy: ``copies = 2``). A pack holds
``frame_budget = max_tokens // tokens_per_frame`` frames of one copy, and an episode longer than
that is "too long" (an error, or cropped to the budget). :func:`frame_budget` and
:func:`too_long` are the one place these two rules are written: the token-budget sampler, the
pack collate, the training plan (:mod:`flexpack.run.root`) and the validation packing all
call them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def frame_budget(max_tokens: int, tokens_per_frame: int) -> int:
    """Latent frames of one pack: ``max_tokens // tokens_per_frame`` (``ValueError`` below one frame)."""
    if tokens_per_frame <= 0:
        raise ValueError(f"tokens_per_frame must be positive, got {tokens_per_frame}")
    if max_tokens < tokens_per_frame:
        raise ValueError(f"max_tokens={max_tokens} is less than one frame (tokens_per_frame={tokens_per_frame})")
    return max_tokens // tokens_per_frame


def too_long(lengths: Sequence[int], budget: int) -> list[int]:
    """Positions of the ``lengths`` (latent frames) that exceed a pack of ``budget`` frames."""
    return [i for i, f in enumerate(lengths) if f > budget]


@dataclass(frozen=True, kw_only=True)
class TokenGeometry:
    """Tokens of one latent frame and the pack they fill.

    Attributes:
        video_tokens:  patches of one latent frame (``(H // ph) * (W // pw)``).
        action_tokens: action steps of one latent frame (0 for a model without actions).
        copies:        2 under teacher forcing (noisy + clean copy of every frame), else 1.
        max_tokens:    the token budget of a pack (``data.max_tokens``); None: no budget (pad mode
                       still has one in the config, but nothing is packed against it).
    """

    video_tokens: int
    action_tokens: int = 0
    copies: int = 1
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.video_tokens < 0 or self.action_tokens < 0 or self.tokens_per_frame <= 0:
            raise ValueError(f"need video_tokens, action_tokens >= 0 with a positive sum, got "
                             f"{self.video_tokens}, {self.action_tokens}")
        if self.copies not in (1, 2):
            raise ValueError(f"copies must be 1 or 2, got {self.copies}")

    @property
    def tokens_per_frame(self) -> int:
        """Tokens of one latent frame of one copy: the unit of ``max_tokens``."""
        return self.video_tokens + self.action_tokens

    @property
    def frame_budget(self) -> int:
        """Latent frames of one pack (:func:`frame_budget`)."""
        if self.max_tokens is None:
            raise ValueError("this token geometry has no max_tokens, so no frame budget")
        return frame_budget(self.max_tokens, self.tokens_per_frame)

    def too_long(self, lengths: Sequence[int]) -> list[int]:
        """Positions of the episodes (``lengths`` in latent frames) longer than one pack."""
        return too_long(lengths, self.frame_budget)

    def fitted(self, length: int) -> int:
        """Frames of an episode of ``length`` frames as a pack holds it (cut to the budget: ``crop``)."""
        return min(int(length), self.frame_budget)

    def computed_tokens(self, frames: int) -> int:
        """Tokens the model computes for ``frames`` latent frames, every copy counted."""
        return int(frames) * self.tokens_per_frame * self.copies
