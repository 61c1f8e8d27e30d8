"""A third model family defined outside flexpack (``tests/test_toy_family.py`` registers it): a few-layer
transformer over a packed micro-batch's latent and action tokens, attention kept inside each episode, with its
own config, preset, objective, export format and export reader. It reuses flexpack's generic pieces (the layout,
the timestep embedder of :mod:`flexpack.models.wan_blocks`, flow matching, the registry's entry) and names no
class of another family."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from flexpack.flow.objectives import FlowObjective
from flexpack.models.registry import ExportFormat, ModelFamily
from flexpack.models.wan_blocks import TimeEmbed

NAME = "toy"


@dataclass(frozen=True, kw_only=True)
class ToyConfig:
    """The toy's shape: what :class:`~flexpack.models.registry.ModelShape` asks, with fields of its own names."""

    width: int = 32
    heads: int = 2
    depth: int = 2
    in_channels: int = 4
    action_channels: int = 7
    text_dim: int = 32
    attn_backend: str = "dense"

    @property
    def patch_size(self) -> tuple[int, int, int]:
        return (1, 1, 1)

    @property
    def out_dim(self) -> int:
        return self.in_channels

    @property
    def dim(self) -> int:
        return self.width

    @property
    def num_heads(self) -> int:
        return self.heads

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def ffn_dim(self) -> int:
        return 2 * self.width

    @property
    def num_layers(self) -> int:
        return self.depth


PRESETS = {"toy": ToyConfig()}


@dataclass
class ToyOutput:
    video: Tensor  # (R, C, Fr, H, W)
    action: Tensor | None  # (R, Ca, Fr, A)


class ToyLayer(nn.Module):
    """Pre-norm self-attention (a boolean mask) and an MLP."""

    def __init__(self, config: ToyConfig) -> None:
        super().__init__()
        D = config.width
        self.heads = config.heads
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, config.ffn_dim), nn.GELU(), nn.Linear(config.ffn_dim, D))

    def forward(self, x: Tensor, allowed: Tensor) -> Tensor:
        q, k, v = rearrange(self.qkv(self.norm1(x)), "r t (three h d) -> three r h t d", three=3, h=self.heads)
        x = x + self.out(rearrange(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None]),
                                   "r h t d -> r t (h d)"))
        return x + self.mlp(self.norm2(x))


class ToyModel(nn.Module):
    """Video tokens (one per latent pixel) and action tokens of each frame, a timestep embedding per frame, the
    episode's pooled text; attention only between tokens of one episode (padding sees only itself)."""

    def __init__(self, config: ToyConfig) -> None:
        super().__init__()
        D = config.width
        self.config = config
        self.video_in, self.video_out = nn.Linear(config.in_channels, D), nn.Linear(D, config.in_channels)
        self.action_in, self.action_out = nn.Linear(config.action_channels, D), nn.Linear(D, config.action_channels)
        self.text_in = nn.Linear(config.text_dim, D)
        self.time = TimeEmbed(16, D)
        self.layers = nn.ModuleList(ToyLayer(config) for _ in range(config.depth))

    def forward(self, batch: Any, layout: Any = None, *, timestep: Tensor, action_timestep: Tensor | None = None,
                mask: str = "document", chunk_size: Any = None, window: Any = None,
                text_slots: int | None = None) -> ToyOutput:
        layout = batch.layout if layout is None else layout
        R, C, Fr, H, W = batch.latent.shape
        video = self.video_in(rearrange(batch.latent, "r c f h w -> r f (h w) c"))
        a_time = timestep if action_timestep is None else action_timestep
        video = video + self.time(timestep.reshape(-1))[0].reshape(R, Fr, 1, -1)
        parts = [video]
        A = 0
        if batch.action is not None:
            A = batch.action.shape[-1]
            act = self.action_in(rearrange(batch.action, "r ca f a -> r f a ca"))
            parts.append(act + self.time(a_time.reshape(-1))[0].reshape(R, Fr, 1, -1))
        x = torch.cat(parts, 2)  # (R, Fr, H*W + A, D)
        doc = layout.frame_doc  # (R, Fr): the episode slot of each frame, -1 on padding
        if batch.text is not None:  # each episode's text, mean-pooled, on its frames
            text = self.text_in(batch.text.mean(1))[doc.clamp(min=0)]
            x = x + torch.where(doc[..., None] >= 0, text, 0.0)[:, :, None]
        n = x.shape[2]
        x = x.flatten(1, 2)
        tok_doc = doc.repeat_interleave(n, 1)  # (R, T)
        same = (tok_doc[:, :, None] == tok_doc[:, None, :]) & (tok_doc[:, :, None] >= 0)
        allowed = same | torch.eye(x.shape[1], dtype=torch.bool, device=x.device)
        for layer in self.layers:
            x = layer(x, allowed)
        x = x.unflatten(1, (Fr, n))
        valid = layout.frame_valid.to(x.dtype)[..., None, None]
        out_v = rearrange(self.video_out(x[:, :, : H * W]) * valid, "r f (h w) c -> r c f h w", h=H)
        out_a = None if not A else rearrange(self.action_out(x[:, :, H * W:]) * valid, "r f a ca -> r ca f a")
        return ToyOutput(video=out_v, action=out_a)


class ToyObjective(FlowObjective):
    """flexpack's flow matching, the toy's own class (the registry builds it with ``from_config``)."""


def write_toy(job: Any, folder: Path) -> None:
    """The ``toy`` export format: the weights and the model config."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in job.model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "toy_config.json").write_text(json.dumps(dataclasses.asdict(job.composed.model_config)))
    (folder / "normalization.json").write_text(json.dumps(job.norm))


def read_toy(folder: str, config: ToyConfig) -> nn.Module:
    """A toy export folder back as a model of ``config``."""
    from safetensors.torch import load_file

    saved = ToyConfig(**json.loads((Path(folder) / "toy_config.json").read_text()))
    if saved != config:
        raise ValueError(f"{folder}: holds a {saved}, not a {config}")
    model = ToyModel(config)
    model.load_state_dict(load_file(str(Path(folder) / "model.safetensors")))
    return model


def toy_family() -> ModelFamily:
    return ModelFamily(name=NAME, config_class=ToyConfig, presets=PRESETS, model_class=ToyModel,
                       aliases={"dim": "width", "num_heads": "heads", "num_layers": "depth"},
                       blocks=lambda model: model.layers, objective=ToyObjective,
                       exports={"toy": ExportFormat(writer=write_toy, package="safetensors",
                                                    load="tests/toy_family.py: read_toy({out!r}, config)")},
                       read_export=read_toy)
