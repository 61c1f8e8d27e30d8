"""Video encoders for the latent cache: video (T, 3, H, W) uint8 -> latent (C, F, h, w) float32.

* ``pool`` — a deterministic stand-in with the Wan 2.2 VAE's strides (4 in time, causal: the
  first frame alone; 16 in space; 48 channels): mean over each temporal group, 16×16 average
  pooling, then a fixed seeded linear map RGB -> 48 channels. For tests and the demo.
* ``wan-vae:PATH`` — diffusers' ``AutoencoderKLWan.from_pretrained(PATH)`` from a local folder;
  the latent is the posterior mode, normalized with the config's ``latents_mean/std``.

Both consume ``stride·(F−1)+1`` frames of an episode of T frames (F = (T−1)//stride + 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as Fnn

from flexpack.data.lengths import latent_frames


class VideoEncoder(Protocol):
    name: str  # recorded in each latent file's header
    stride: int  # temporal stride

    def encode(self, video_T3HW: torch.Tensor) -> torch.Tensor: ...


def _crop(video_T3HW: torch.Tensor, stride: int) -> tuple[torch.Tensor, int]:
    if video_T3HW.ndim != 4 or video_T3HW.shape[1] != 3:
        raise ValueError(f"video must be (T, 3, H, W), got shape {tuple(video_T3HW.shape)}")
    frames = latent_frames(video_T3HW.shape[0], stride)
    return video_T3HW[: stride * (frames - 1) + 1], frames


class PoolEncoder:
    """Deterministic stand-in encoder (see the module docstring)."""

    def __init__(self, channels: int = 48, stride: int = 4, spatial: int = 16, seed: int = 0) -> None:
        self.channels, self.stride, self.spatial = channels, stride, spatial
        self.name = "pool"
        gen = torch.Generator().manual_seed(seed)
        self.proj_C3 = torch.randn(channels, 3, generator=gen) / 3**0.5

    @torch.no_grad()
    def encode(self, video_T3HW: torch.Tensor) -> torch.Tensor:
        video, frames = _crop(video_T3HW, self.stride)
        _, _, H, W = video.shape
        if H < self.spatial or W < self.spatial:
            raise ValueError(f"video {H}x{W} is smaller than the spatial stride {self.spatial}")
        x = video.float() / 127.5 - 1.0  # (T, 3, H, W) in [-1, 1]
        rest = x[1:].reshape(frames - 1, self.stride, 3, H, W).mean(1)  # causal groups of `stride`
        groups_F3HW = torch.cat([x[:1], rest], 0)
        pooled_F3hw = Fnn.avg_pool2d(groups_F3HW, self.spatial)  # floor: a remainder < 16 px is dropped
        return torch.einsum("cd,fdhw->cfhw", self.proj_C3, pooled_F3hw).contiguous()


class WanVAEEncoder:
    """diffusers ``AutoencoderKLWan`` loaded from a local folder (never downloads).

    ``dtype``: the VAE's weights and activations (``torch.bfloat16`` halves memory and time on a
    GPU; the latent is stored in bf16 either way). ``tiling``: encode frames larger than ``tile_size``
    px (default 256) in overlapping spatial tiles (diffusers' ``enable_tiling``, stride 3/4 of a
    tile), so large frames fit in memory.
    ``slicing``: several cameras of one size are encoded as one batch; slicing runs them one at a
    time through the VAE (``enable_slicing``), for memory."""

    def __init__(self, path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 *, tiling: bool = False, slicing: bool = False, tile_size: int = 256) -> None:
        try:
            from diffusers import AutoencoderKLWan
        except ImportError as exc:  # diffusers is an extra
            raise ImportError("the wan-vae encoder needs diffusers: pip install 'flexpack[hf]'") from exc
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"{path}: no config.json; wan-vae:PATH needs a local AutoencoderKLWan folder "
                                    "(as written by save_pretrained)")
        self.device, self.dtype = torch.device(device), dtype
        # loaded in the wanted dtype (no float32 copy cast afterwards, which diffusers warns about)
        self.vae = (AutoencoderKLWan.from_pretrained(path, local_files_only=True, torch_dtype=dtype)
                    .to(self.device).eval())
        if tiling:
            if tile_size < 32 or tile_size % 16:
                raise ValueError(f"--tile-size {tile_size}: must be a multiple of 16 and >= 32 pixels")
            stride = tile_size * 3 // 4 // 16 * 16
            self.vae.enable_tiling(tile_sample_min_height=tile_size, tile_sample_min_width=tile_size,
                                   tile_sample_stride_height=stride, tile_sample_stride_width=stride)
        if slicing:
            self.vae.enable_slicing()
        cfg = self.vae.config
        self.name = f"wan-vae:{path}"
        self.stride = 2 ** sum(bool(t) for t in cfg.temperal_downsample)
        mean, std = cfg.latents_mean, cfg.latents_std
        if mean is not None and std is not None:
            if len(mean) != cfg.z_dim or len(std) != cfg.z_dim:
                raise ValueError(f"{path}/config.json: latents_mean/latents_std have {len(mean)}/{len(std)} "
                                 f"entries, z_dim is {cfg.z_dim}")
            self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1, 1)
            self.inv_std = 1.0 / torch.tensor(std, dtype=torch.float32).view(-1, 1, 1, 1)
        else:
            self.mean, self.inv_std = None, None

    @torch.no_grad()
    def encode_many(self, videos: list[torch.Tensor]) -> list[torch.Tensor]:
        """Videos of one shape (T, 3, H, W) as one VAE batch; their latents (C, F, h, w)."""
        cropped = [_crop(v, self.stride)[0] for v in videos]
        x_B3THW = torch.stack([(v.float() / 127.5 - 1.0).permute(1, 0, 2, 3) for v in cropped])
        z_BCFHW = self.vae.encode(x_B3THW.to(self.device, self.dtype)).latent_dist.mode().float().cpu()
        if self.mean is not None:
            z_BCFHW = (z_BCFHW - self.mean) * self.inv_std
        return [z.contiguous() for z in z_BCFHW]

    def encode(self, video_T3HW: torch.Tensor) -> torch.Tensor:
        return self.encode_many([video_T3HW])[0]


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_video_encoder(spec: str, device: str = "cpu", *, dtype: str = "float32", tiling: bool = False,
                       slicing: bool = False, tile_size: int = 256) -> VideoEncoder:
    """``pool`` or ``wan-vae:PATH``; ``dtype`` (``float32``, ``bfloat16``, ``float16``), ``tiling``
    and ``slicing`` apply to the Wan VAE."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {sorted(DTYPES)}")
    if spec == "pool":
        return PoolEncoder()
    if spec.startswith("wan-vae:") and len(spec) > len("wan-vae:"):
        return WanVAEEncoder(spec[len("wan-vae:") :], device=device, dtype=DTYPES[dtype], tiling=tiling,
                             slicing=slicing, tile_size=tile_size)
    raise ValueError(f"unknown encoder {spec!r}; use 'pool' or 'wan-vae:PATH'")


def encode_cameras(encoder: VideoEncoder, videos: list[torch.Tensor], cameras: list[str]) -> torch.Tensor:
    """Encode each camera's video and join the latents along width (LingBot-VA style)."""
    many = getattr(encoder, "encode_many", None)
    if many is not None and len(videos) > 1 and len({tuple(v.shape) for v in videos}) == 1:
        latents = many(videos)  # one VAE batch for same-sized cameras
    else:
        latents = [encoder.encode(v) for v in videos]
    shapes = {cam: tuple(z.shape[:3]) for cam, z in zip(cameras, latents)}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"cameras give latents of different (C, F, H): {shapes}; they must match to join along width")
    return torch.cat(latents, dim=-1)
