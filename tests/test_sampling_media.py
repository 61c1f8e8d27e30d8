"""Sampling media: action plots, latent strips, side-by-side mp4, PSNR, Wan VAE decode of cached
latents, and PNGs logged to TensorBoard / W&B."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from flexpack.run.config import load_config
from flexpack.training.observe import tracking


def _png(path: Path, h: int, w: int, seed: int = 0) -> tuple[Path, np.ndarray]:
    rgb = np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(path)
    return path, rgb


def test_log_images_writes_the_png_into_the_tensorboard_event_file(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    png, rgb = _png(tmp_path / "plot.png", 20, 30)
    cfg = load_config(None, ["runtime.tensorboard=true"])
    with tracking.MetricSinks(tmp_path / "run", cfg) as sinks:
        sinks.log_images(7, {"sample/actions": png})
    acc = EventAccumulator(str(tmp_path / "run" / "tb"), size_guidance={"images": 0})
    acc.Reload()
    assert acc.Tags()["images"] == ["sample/actions"]
    (event,) = acc.Images("sample/actions")
    assert (event.step, event.width, event.height) == (7, 30, 20)
    import io

    back = np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))
    np.testing.assert_array_equal(back, rgb)  # TensorBoard stores PNG: lossless


def test_log_images_goes_to_wandb_as_images_and_only_on_rank_0(tmp_path, monkeypatch):
    logged: list = []

    class FakeRun:
        def log(self, values, step):
            logged.append((step, values))

        def finish(self, exit_code=0):
            pass

    monkeypatch.setitem(sys.modules, "wandb", SimpleNamespace(init=lambda **kw: FakeRun(), Image=lambda p: ("img", p)))
    png, _ = _png(tmp_path / "a.png", 8, 8)
    cfg = load_config(None, ["runtime.wandb=true", "runtime.tensorboard=false"])
    with tracking.MetricSinks(tmp_path / "run", cfg) as sinks:
        sinks.log_images(3, {"sample/a": png})
    with tracking.MetricSinks(tmp_path / "run1", cfg, rank=1) as sinks:
        sinks.log_images(3, {"sample/a": png})
    assert logged == [(3, {"sample/a": ("img", str(png))})]


# ---------------------------------------------------------------------------- plots


def test_action_plot_is_a_png_of_the_expected_size(tmp_path):
    from flexpack.sampling import media

    t = np.linspace(0, 3, 24)
    true = np.stack([np.sin(t), np.cos(t), t / 3], 1)
    out = media.action_plot(tmp_path / "sub" / "a.png", true + 0.1, true, context=8, title="ep 3 cut 2",
                            names=["x", "y", "z"])
    assert out == tmp_path / "sub" / "a.png" and not list(out.parent.glob(".*tmp*"))
    with Image.open(out) as im:
        assert im.format == "PNG" and im.size == media.action_plot_size(3) == (800, 510)
        pix = np.asarray(im.convert("RGB"))
    # red predicted line and the grey context shading are both drawn
    red = (pix[..., 0] > 150) & (pix[..., 1] < 120) & (pix[..., 2] < 120)
    grey = (pix == 224).all(-1)  # matplotlib "0.88" = 224
    assert red.sum() > 50 and grey.sum() > 1000
    # the prediction is drawn only after the context: no red pixel left of the shaded band's right edge
    band = np.nonzero(grey.sum(0) > 100)[0]  # columns of the shading (not the legend's small patch)
    assert red[:, : band.max() + 1].sum() == 0 and red[:, band.max() + 1 :].sum() > 50
    # wide action vectors keep a readable height: past 8 dimensions rows shrink (to half an inch at 24+)
    wide = np.random.default_rng(0).normal(size=(6, 12))
    with Image.open(media.action_plot(tmp_path / "w.png", wide, wide, context=2)) as im:
        assert im.size == media.action_plot_size(12) == (800, 1260)
    assert media.action_plot_size(30) == (800, 1560)
    with pytest.raises(ValueError, match="context must be in"):
        media.action_plot(tmp_path / "b.png", true, true, context=25)
    with pytest.raises(ValueError, match=r"\(T, D\)"):
        media.action_plot(tmp_path / "b.png", true[:, :2], true, context=2)


def test_latent_strip_rows_share_one_scale_and_mark_the_context(tmp_path):
    from flexpack.sampling import media

    rng = np.random.default_rng(0)
    true = rng.normal(size=(48, 5, 2, 2))
    pred = true.copy()
    pred[:, 3:] = 2 * true[:, 3:] + 1  # generated frames differ, context frames equal
    out = media.latent_strip(tmp_path / "s.png", pred, true, context=3)
    with Image.open(out) as im:
        assert im.size == media.latent_strip_size(5, 2, 2) == (5 * 36 + 6 * 2, 2 * 36 + 3 * 2)
        pix = np.asarray(im.convert("RGB"))
    s, b, g = 16, media.STRIP_BORDER, media.STRIP_GAP  # 2x2 cells upscaled 16x to 32 px
    both = np.stack([true[:3], pred[:3]])
    lo, hi = both.min(), both.max()
    for row, src in enumerate((true, pred)):
        for f in range(5):
            y0, x0 = g + row * (2 * s + 2 * b + g), g + f * (2 * s + 2 * b + g)
            assert (pix[y0, x0] == (media.CONTEXT_RGB if f < 3 else media.TARGET_RGB)).all()
            cell = pix[y0 + b : y0 + b + 2 * s : s, x0 + b : x0 + b + 2 * s : s]  # one pixel per latent cell
            expected = np.round((src[:3, f].transpose(1, 2, 0) - lo) / (hi - lo) * 255)
            np.testing.assert_array_equal(cell, expected)
    # context columns look the same in both rows; generated ones do not
    top, bottom = pix[g : g + 36], pix[2 * g + 36 : 2 * g + 72]
    split = g + 3 * (36 + g)
    assert (top[:, :split] == bottom[:, :split]).all() and (top[:, split:] != bottom[:, split:]).any()


# ---------------------------------------------------------------------------- video and PSNR


def test_video_mp4_reads_back_with_frame_count_size_and_sides(tmp_path):
    import av

    from flexpack.sampling import media

    F, H, W = 7, 33, 31  # odd sizes: padded to even for yuv420p
    pred = np.zeros((F, H, W, 3), np.uint8)
    true = np.zeros((F, H, W, 3), np.uint8)
    pred[..., 0] = 200  # predicted: red, left
    true[..., 2] = 200  # true: blue, right
    true[:, :, :, 1] = np.arange(F)[:, None, None] * 30  # frames differ over time
    out = media.video_mp4(tmp_path / "v.mp4", pred, true, fps=7.5)
    with av.open(str(out)) as c:
        stream = c.streams.video[0]
        assert stream.codec_context.name == "h264" and stream.average_rate == 7.5
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(stream)]
    assert len(frames) == F and frames[0].shape == (34, 62, 3)
    for f, img in enumerate(frames):
        left, right = img[4:28, 4:26].astype(int), img[4:28, 36:58].astype(int)
        assert abs(left[..., 0].mean() - 200) < 8 and left[..., 2].mean() < 10
        assert abs(right[..., 2].mean() - 200) < 8 and abs(right[..., 1].mean() - 30 * f) < 8
    with pytest.raises(ValueError, match="uint8"):
        media.video_mp4(tmp_path / "w.mp4", pred.astype(np.float32), true.astype(np.float32), fps=5)


def test_psnr_matches_the_formula():
    from flexpack.sampling import media

    rng = np.random.default_rng(1)
    x = rng.uniform(-1, 1, size=(4, 16, 16, 3))
    assert media.psnr(x, x) == float("inf")
    noise = np.where(rng.random(x.shape) < 0.5, -0.1, 0.1)  # MSE exactly 0.01
    assert media.psnr(x + noise, x) == pytest.approx(10 * np.log10(4 / 0.01))  # 26.02 dB
    y = rng.uniform(-1, 1, size=x.shape)
    assert media.psnr(y, x, data_range=255.0) == pytest.approx(10 * np.log10(255**2 / np.mean((y - x) ** 2)))
    with pytest.raises(ValueError, match="shapes differ"):
        media.psnr(x[:1], x)


# ---------------------------------------------------------------------------- Wan VAE decode


def test_decode_latents_inverts_the_wan_vae_encoder(tmp_path):
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers", reason="diffusers (dev extra) builds the tiny Wan VAE")
    from flexpack.data.encoders import WanVAEEncoder
    from flexpack.sampling import media

    mean, std = [0.1, 0.2, -0.1, 0.0], [1.5, 2.0, 0.5, 1.0]
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                     temperal_downsample=[False, True, True], latents_mean=mean, latents_std=std)
    path = tmp_path / "tiny-wan-vae"
    vae.save_pretrained(path)
    vae.eval()
    gen = torch.Generator().manual_seed(3)
    video_T3HW = torch.randint(0, 256, (9, 3, 32, 32), generator=gen, dtype=torch.uint8)
    latent = WanVAEEncoder(str(path)).encode(video_T3HW)  # normalized, as in the cache
    assert latent.shape == (4, 3, 4, 4)

    frames = media.decode_latents(latent, f"wan-vae:{path}")
    assert frames.dtype == np.uint8 and frames.shape == (9, 32, 32, 3)
    with torch.no_grad():  # diffusers' own decode of the un-normalized posterior mode
        x = (video_T3HW.float() / 127.5 - 1).permute(1, 0, 2, 3).unsqueeze(0)
        ref = vae.decode(vae.encode(x).latent_dist.mode()).sample[0].clamp(-1, 1)
    ref_u8 = ((ref + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).numpy()
    assert np.abs(frames.astype(int) - ref_u8.astype(int)).max() <= 1
    # decoding the normalized latent as if it were raw gives something else: the inversion matters
    with torch.no_grad():
        raw = vae.decode(latent.unsqueeze(0)).sample[0].clamp(-1, 1)
    assert np.abs(frames.astype(float) - ((raw + 1) * 127.5).permute(1, 2, 3, 0).numpy()).mean() > 1.0
    assert media.decode_latents(latent, "pool") is None
