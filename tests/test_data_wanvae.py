"""`flexpack encode --encoder wan-vae:PATH` with a tiny random diffusers AutoencoderKLWan on disk."""

import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("lerobot")
diffusers = pytest.importorskip("diffusers", reason="diffusers (dev extra) is needed for the wan-vae encoder")

from conftest import VAE_MEAN as MEAN  # noqa: E402  (the tiny_vae fixture's statistics)
from conftest import VAE_STD as STD  # noqa: E402
from flexpack.cli import main  # noqa: E402
from flexpack.data import LatentEpisodeDataset, cache, dataset_latent_frames  # noqa: E402
from flexpack.data.encode import encode_dataset  # noqa: E402
from flexpack.data.episodes import EpisodeSource  # noqa: E402
from flexpack.data.synthetic import make_synthetic_dataset  # noqa: E402

LENGTHS = [9, 14]  # F = 3, 4; episode 1 drops its last video frame


def test_wan_vae_encoder_writes_normalized_posterior_mode(tiny_vae, tmp_path, capsys):
    path, vae = tiny_vae
    root = make_synthetic_dataset(tmp_path / "ds", lengths=LENGTHS, cameras=1, seed=2)
    assert main(["encode", "--dataset", str(root), "--encoder", f"wan-vae:{path}", "--no-progress"]) == 0
    assert "encoded 2 episode(s)" in capsys.readouterr().out
    assert main(["check-dataset", str(root)]) == 0

    cams = ["observation.images.cam0"]
    heads = [cache.read_latent_header(cache.latent_path(root / "latents", cams, e)) for e in range(2)]
    assert [h.frames for h in heads] == dataset_latent_frames(root) == [3, 4]
    assert all(h.encoder == f"wan-vae:{path}" and h.channels == 4 and (h.height, h.width) == (4, 4) for h in heads)

    video = EpisodeSource(root).decode(1, cams[0], 13)  # 14 frames -> the first 13 are encoded
    x = (video.float() / 127.5 - 1).permute(1, 0, 2, 3).unsqueeze(0)
    with torch.no_grad():
        mode = vae.encode(x).latent_dist.mode()[0]
    expected = (mode - torch.tensor(MEAN).view(4, 1, 1, 1)) / torch.tensor(STD).view(4, 1, 1, 1)
    item = LatentEpisodeDataset(root)[1]
    assert item["latent"].shape == (4, 4, 4, 4) and item["length"] == 4
    torch.testing.assert_close(item["latent"], expected.bfloat16().float(), rtol=0.02, atol=0.02)

    # resumable: the same encoder skips; the pool encoder replaces every file
    assert main(["encode", "--dataset", str(root), "--encoder", f"wan-vae:{path}", "--no-progress"]) == 0
    assert "encoded 0 episode(s), skipped 2" in capsys.readouterr().out
    assert main(["encode", "--dataset", str(root), "--no-progress"]) == 0
    assert "encoded 2 episode(s)" in capsys.readouterr().out
    assert LatentEpisodeDataset(root)[1]["latent"].shape == (48, 4, 2, 2)


def test_wan_vae_bad_path_names_it(tmp_path, capsys):
    root = make_synthetic_dataset(tmp_path / "ds", lengths=[5], cameras=1)
    with pytest.raises(FileNotFoundError, match="nope.*config.json"):
        encode_dataset(root, encoder=f"wan-vae:{tmp_path / 'nope'}", progress=False)
    # the command line says the same in one line and exits 2
    assert main(["encode", "--dataset", str(root), "--encoder", f"wan-vae:{tmp_path / 'nope'}", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "config.json" in err and "Traceback" not in err


def test_bf16_tiling_and_slicing_keep_the_latents(tiny_vae, tmp_path):
    from flexpack.data.encoders import WanVAEEncoder, encode_cameras

    path, _ = tiny_vae
    g = torch.Generator().manual_seed(4)
    videos = [torch.randint(0, 256, (9, 3, 64, 64), generator=g, dtype=torch.uint8) for _ in range(2)]
    fp32 = WanVAEEncoder(str(path))
    assert next(fp32.vae.parameters()).dtype == torch.float32
    one_by_one = [fp32.encode(v) for v in videos]
    # cameras of one size: one VAE batch, the same latents; slicing runs them one at a time, the same again
    torch.testing.assert_close(encode_cameras(fp32, videos, ["a", "b"]), torch.cat(one_by_one, -1),
                               rtol=1e-4, atol=1e-4)
    sliced = WanVAEEncoder(str(path), slicing=True)
    assert sliced.vae.use_slicing
    torch.testing.assert_close(encode_cameras(sliced, videos, ["a", "b"]), torch.cat(one_by_one, -1),
                               rtol=1e-4, atol=1e-4)

    bf16 = WanVAEEncoder(str(path), dtype=torch.bfloat16)
    assert next(bf16.vae.parameters()).dtype == torch.bfloat16  # loaded in bf16, not cast after
    z16 = bf16.encode(videos[0])
    assert z16.dtype == torch.float32 and z16.shape == one_by_one[0].shape
    err = (z16 - one_by_one[0]).abs().max() / one_by_one[0].abs().max()
    assert err < 0.05, err

    tiled = WanVAEEncoder(str(path), tiling=True, tile_size=32)
    calls = []
    original = tiled.vae.tiled_encode
    tiled.vae.tiled_encode = lambda x: calls.append(tuple(x.shape)) or original(x)
    zt = tiled.encode(videos[0])
    assert calls and zt.shape == one_by_one[0].shape and torch.isfinite(zt).all()  # 64 px frames went in 32 px tiles
    with pytest.raises(ValueError, match="--tile-size 24"):
        WanVAEEncoder(str(path), tiling=True, tile_size=24)
