"""Sampling media: action plots, latent figures, labelled side-by-side mp4, PSNR, Wan VAE decode of cached
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
    cfg = load_config(None, ["log.tensorboard=true"])
    with tracking.MetricSinks(tmp_path / "run", cfg.log) as sinks:
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
    cfg = load_config(None, ["log.wandb=true", "log.tensorboard=false"])
    with tracking.MetricSinks(tmp_path / "run", cfg.log) as sinks:
        sinks.log_images(3, {"sample/a": png})
    with tracking.MetricSinks(tmp_path / "run1", cfg.log, rank=1) as sinks:
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
        assert im.format == "PNG" and im.size == media.action_plot_size(3) == (800, 570)
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
        assert im.size == media.action_plot_size(12) == (800, 1320)
    assert media.action_plot_size(30) == (800, 1620)
    with pytest.raises(ValueError, match="context must be in"):
        media.action_plot(tmp_path / "b.png", true, true, context=25)
    with pytest.raises(ValueError, match=r"\(K, T, D\)"):
        media.action_plot(tmp_path / "b.png", true[:, :2], true, context=2)
    with pytest.raises(ValueError, match="baseline 'last' must be"):
        media.action_plot(tmp_path / "b.png", true, true, context=2, baselines={"last": true[:3]})


def _drawn(pix: np.ndarray, rgb: tuple[int, int, int], tol: int = 40) -> np.ndarray:
    return (np.abs(pix.astype(int) - np.array(rgb)) < tol).all(-1)


def test_action_plot_draws_samples_baselines_and_chunk_boundaries_on_the_time_axis(tmp_path):
    from matplotlib.colors import to_rgb

    from flexpack.sampling import media

    T = 20
    t = np.arange(T) * 0.1 + 0.3  # seconds
    true = np.stack([np.sin(t * 3)], 1)
    samples = np.stack([true + 0.3, true - 0.3])  # (K, T, D): their mean is the truth
    last = np.full((T, 1), np.nan)
    last[8:] = 0.9
    plain = media.action_plot(tmp_path / "plain.png", true + 0.3, true, context=8, t=t)
    full = media.action_plot(tmp_path / "full.png", samples, true, context=8, t=t, baselines={"last": last},
                             boundaries=[1.45, 1.85], xlabel="time (s)")
    with Image.open(plain) as a, Image.open(full) as b:
        pa, pb = np.asarray(a.convert("RGB")), np.asarray(b.convert("RGB"))
    blue = tuple(round(255 * c) for c in to_rgb("tab:blue"))
    assert _drawn(pb, blue, 30).sum() > 30 and _drawn(pa, blue, 30).sum() == 0  # the baseline: a blue dotted line
    # the samples: faint red lines beside the dashed mean
    pink = (pb[..., 0] > 200) & (pb[..., 1] > 150) & (pb[..., 1] < 235) & (pb[..., 2] > 150) & (pb[..., 2] < 235)
    assert pink.sum() > 100
    # chunk boundaries: vertical light-grey lines spanning the axes (in the white part after the context)
    def grey_columns(pix):
        g = pix.astype(int)
        light = (g[..., 0] == g[..., 1]) & (g[..., 1] == g[..., 2]) & (g[..., 0] > 150) & (g[..., 0] < 235)
        return np.nonzero(light.sum(0) > 100)[0]

    assert len(set(grey_columns(pb)) - set(grey_columns(pa))) == 2  # the shading is grey in both
    with pytest.raises(ValueError, match="t must have one position per time step"):
        media.action_plot(tmp_path / "b.png", true, true, context=2, t=t[:5])


def test_latent_rgb_maps_pool_latents_back_to_their_cell_colours():
    import torch

    from flexpack.data.encoders import PoolEncoder
    from flexpack.sampling import frames

    rng = np.random.default_rng(0)
    video = torch.from_numpy(rng.integers(0, 256, size=(9, 3, 32, 32), dtype=np.uint8))
    z = PoolEncoder().encode(video).numpy()  # (48, 3, 2, 2)
    (rgb, other), note = frames.latent_rgb([z, z * 0.5], "pool")
    assert rgb.shape == (3, 32, 32, 3) and "16x16-pixel cell's mean colour" in note
    # the cells' mean colours, stretched linearly onto [0, 1] on one scale for both latents
    x = video.float().numpy() / 127.5 - 1
    cells = np.stack([x[:1].mean(0), x[1:5].mean(0), x[5:9].mean(0)])  # latent frames (causal groups of 4)
    means = cells.reshape(3, 3, 2, 16, 2, 16).mean((3, 5)).transpose(0, 2, 3, 1)  # (F, 2, 2, 3)
    lo, hi = min(means.min(), (means * 0.5).min()), max(means.max(), (means * 0.5).max())
    np.testing.assert_allclose(rgb[:, ::16, ::16], (means - lo) / (hi - lo), atol=1e-5)
    assert (rgb[:, :16, :16] == rgb[:, :1, :1]).all()  # each cell drawn 16 px wide
    (a, b), note = frames.latent_rgb([z[:5], z[:5] + 1], "wan-vae:/x")  # other encoders: channels 0-2
    assert a.shape == (3, 2, 2, 3) and "channels 0-2" in note and a.min() == 0 and b.max() == 1


def test_latent_figure_and_labelled_side_by_side_frames(tmp_path):
    from flexpack.sampling import frames

    rng = np.random.default_rng(0)
    true = rng.uniform(size=(5, 32, 32, 3))
    pred = true.copy()
    pred[3:] = 1 - pred[3:]
    out = frames.latent_figure(tmp_path / "l.png", pred, true, context=3, times=[0, .4, .8, 1.2, 1.6],
                               title="forecast | episode 3", note="a note")
    with Image.open(out) as im:
        assert im.size == (600, 400) and im.format == "PNG"
        pix = np.asarray(im.convert("RGB"))
    assert _drawn(pix, frames.CONTEXT_COLOR, 10).sum() > 500  # context frames framed orange
    with pytest.raises(ValueError, match="context must be in"):
        frames.latent_figure(tmp_path / "b.png", pred, true, context=6)
    u8 = lambda x: frames.to_uint8(x)  # noqa: E731
    video = frames.side_by_side(u8(pred), u8(true), context=2, fps=10, scale=3, title="forecast | episode 3\nsecond")
    F, H, W, _ = video.shape
    assert F == 5 and H % 2 == 0 and W % 2 == 0 and W == 2 * (96 + 8) + 24
    # the context frames are framed orange, the generated grey; the panels hold the frames upscaled 3 times
    orange = lambda f: _drawn(video[f], frames.CONTEXT_COLOR, 10).sum()  # noqa: E731
    assert orange(0) > 800 and orange(4) < 50
    assert _drawn(video[4], frames.TARGET_COLOR, 10).sum() > 800
    top = H - 8 - 4 - 96  # the panels' first row of pixels
    np.testing.assert_array_equal(video[1, top:top + 96:3, 12:12 + 96:3], u8(pred)[1])
    np.testing.assert_array_equal(video[1, top:top + 96:3, 124:124 + 96:3], u8(true)[1])  # 8 + 104 + 8 + 4
    assert frames.video_rate(np.zeros((3, 2, 2, 3)), 4).shape[0] == 9  # frame 0 once, then 4 video frames each


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
