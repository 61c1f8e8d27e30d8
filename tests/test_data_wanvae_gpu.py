"""The Wan VAE encoder on CUDA (bf16, with and without tiling) against fp32 on the CPU, with a tiny random
diffusers AutoencoderKLWan on disk. Needs diffusers, not lerobot: it runs on GPU machines without lerobot."""

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.fa4  # diffusers: a wheel of the suite's second shard
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_encode_on_cuda_matches_fp32_on_cpu(tiny_vae):
    from flexpack.data.encoders import WanVAEEncoder

    path, _ = tiny_vae
    video = torch.randint(0, 256, (9, 3, 64, 64), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    ref = WanVAEEncoder(str(path)).encode(video)
    for tiling in (False, True):
        z = WanVAEEncoder(str(path), device="cuda", dtype=torch.bfloat16, tiling=tiling, tile_size=32).encode(video)
        assert z.device.type == "cpu" and z.shape == ref.shape and torch.isfinite(z).all()
        if not tiling:
            assert (z - ref).abs().max() / ref.abs().max() < 0.05
