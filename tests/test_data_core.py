"""flexpack.data pieces that need no LeRobot dataset: frame counts, action alignment and
normalization, the stand-in encoders, atomic cache writes, and importing without lerobot."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"

from flexpack.data import cache  # noqa: E402
from flexpack.data.actions import ActionNormalizer, align_actions, channel_map, step_frames  # noqa: E402
from flexpack.data.encoders import PoolEncoder, encode_cameras, make_video_encoder  # noqa: E402
from flexpack.data.lengths import latent_frames, used_video_frames  # noqa: E402
from flexpack.data.text import HashTextEncoder, make_text_encoder  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_latent_frames_formula():
    assert [latent_frames(n) for n in [1, 2, 4, 5, 6, 8, 9, 13, 17]] == [1, 1, 1, 2, 2, 2, 3, 4, 5]
    assert [used_video_frames(n) for n in [1, 4, 5, 8, 9, 12]] == [1, 1, 5, 5, 9, 9]
    assert latent_frames(9, stride=2) == 5
    with pytest.raises(ValueError, match="n=0"):
        latent_frames(0)
    import flexpack.packing.lengths

    assert flexpack.packing.lengths.latent_frames is latent_frames  # one definition, shared by stats and data


def test_step_frames_pins_the_alignment():
    # latent frame 0 = video frame 0 in its last step; frame f>=1 = video frames 4f-3 .. 4f.
    assert step_frames(3, 4, 4).tolist() == [[-3, -2, -1, 0], [1, 2, 3, 4], [5, 6, 7, 8]]
    # A = 2 keeps the last frame of each pair.
    assert step_frames(3, 2, 4).tolist() == [[-2, 0], [2, 4], [6, 8]]
    with pytest.raises(ValueError, match="must divide"):
        step_frames(3, 3, 4)


def test_align_actions_places_columns_and_masks_absent_steps():
    T = 7  # 7 video frames -> F = 2; frames 5 and 6 have no latent frame
    actions = np.stack([np.arange(T), 100 + np.arange(T)], 1).astype(np.float32)
    act, mask = align_actions(actions, frames=2, action_steps=4, stride=4, action_dim=5, channels=np.array([3, 1]))
    assert act.shape == mask.shape == (5, 2, 4) and act.dtype == torch.float32 and mask.dtype == torch.bool
    assert act[3].tolist() == [[0, 0, 0, 0], [1, 2, 3, 4]]
    assert act[1].tolist() == [[0, 0, 0, 100], [101, 102, 103, 104]]
    assert mask[3].tolist() == [[False, False, False, True], [True] * 4]
    assert not mask[[0, 2, 4]].any() and not act[[0, 2, 4]].any()
    # a step past the episode's end is absent (F asked beyond what T gives)
    act, mask = align_actions(actions[:5], frames=3, action_steps=4, stride=4, action_dim=2, channels=np.arange(2))
    assert mask[0, 2].tolist() == [False] * 4 and act[0, 2].tolist() == [0] * 4


def test_channel_map_checks():
    assert channel_map(3, 8, None).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="more than action_dim=2"):
        channel_map(3, 2, None)
    with pytest.raises(ValueError, match="distinct"):
        channel_map(2, 4, [1, 1])


def test_normalizer_quantile_and_meanstd():
    stats = {"q01": np.array([0.0, 5.0]), "q99": np.array([10.0, 5.0]),
             "mean": np.array([1.0, 1.0]), "std": np.array([2.0, 2.0])}
    norm = ActionNormalizer.from_stats(stats, 2)
    x = np.array([[0.0, 5.0], [5.0, 7.0], [20.0, 1.0]])
    assert norm.mode == "quantile"
    np.testing.assert_allclose(norm(x), [[-1, 0], [0, 0], [1, 0]])  # clipped; zero-width column -> 0
    norm = ActionNormalizer.from_stats({"mean": [1.0, 1.0], "std": [2.0, 0.0]}, 2)
    np.testing.assert_allclose(norm(x), [[-0.5, 4.0], [2.0, 6.0], [9.5, 0.0]])
    with pytest.raises(ValueError, match="neither q01/q99 nor mean/std"):
        ActionNormalizer.from_stats({"min": [0.0]}, 1)
    with pytest.raises(ValueError, match="3 columns, the feature has 2"):
        ActionNormalizer.from_stats({"mean": [0, 0, 0], "std": [1, 1, 1]}, 2)


def test_pool_encoder_strides_and_temporal_groups():
    enc = PoolEncoder()
    T, H, W = 10, 32, 48  # F = 3; frame 9 is dropped
    video = (torch.arange(T).view(T, 1, 1, 1) * 20).expand(T, 3, H, W).to(torch.uint8).contiguous()
    z = enc.encode(video)
    assert z.shape == (48, 3, 2, 3) and z.dtype == torch.float32
    x = torch.arange(T, dtype=torch.float32) * 20 / 127.5 - 1
    groups = torch.stack([x[0], x[1:5].mean(), x[5:9].mean()])  # causal groups 0 | 1..4 | 5..8
    expected = enc.proj_C3.sum(1)[:, None] * groups[None]
    torch.testing.assert_close(z[:, :, 1, 2], expected)
    assert torch.equal(enc.encode(video), PoolEncoder().encode(video))  # deterministic
    two = encode_cameras(enc, [video, 255 - video], ["a", "b"])
    assert two.shape == (48, 3, 2, 6) and torch.equal(two[..., :3], z)
    with pytest.raises(ValueError, match="different"):
        encode_cameras(enc, [video, video[:, :, :16]], ["a", "b"])
    with pytest.raises(ValueError, match="unknown encoder"):
        make_video_encoder("vae")


def test_hash_text_encoder():
    enc = make_text_encoder("hash:8x4")
    a, n = enc.encode("Open the drawer")
    assert a.shape == (4, 8) and n == 3 and not a[3:].any() and a[:3].abs().sum(1).min() > 0
    b, _ = HashTextEncoder(8, 4).encode("open the drawer")
    c, _ = enc.encode("open the door")
    assert torch.equal(a, b) and not torch.equal(a, c) and torch.equal(a[:2], c[:2])
    assert enc.encode("a b c d e f")[1] == 4
    assert enc.encode("")[1] == 1  # never zero valid tokens


def test_atomic_write_leaves_old_file_on_failure(tmp_path, monkeypatch):
    import safetensors.torch

    path = tmp_path / "x" / "e.safetensors"
    cache.write_safetensors_atomic(path, {"t": torch.ones(2)}, {"k": "1"})
    before = path.read_bytes()

    def broken(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        cache.write_safetensors_atomic(path, {"t": torch.zeros(2)}, {"k": "2"})
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["e.safetensors"]


def test_latent_file_roundtrip_header(tmp_path):
    path = cache.latent_path(tmp_path, ["observation.images.top", "wrist"], 7)
    assert path == tmp_path / "video" / "top+wrist" / "episode_000007.safetensors"
    z = torch.randn(4, 3, 2, 5)
    cache.write_latent(path, z, episode_index=7, fps=15, encoder="pool", cameras=["a", "b"], video_frames=10, stride=4)
    head = cache.read_latent_header(path)
    assert (head.episode_index, head.frames, head.channels, head.height, head.width) == (7, 3, 4, 2, 5)
    assert (head.fps, head.encoder, head.cameras, head.video_frames, head.stride) == (15.0, "pool", ["a", "b"], 10, 4)
    torch.testing.assert_close(cache.read_tensor(path, "latent"), z.bfloat16().float())


def test_core_imports_without_lerobot(tmp_path):
    code = textwrap.dedent(
        """
        import importlib, pkgutil, sys
        sys.modules["lerobot"] = None  # any `import lerobot...` now raises ImportError
        import flexpack, flexpack.cli, flexpack.data
        from flexpack.data import latent_frames, LatentEpisodeDataset
        assert latent_frames(9) == 3
        failed = []
        for m in pkgutil.walk_packages(flexpack.__path__, "flexpack."):
            try:
                importlib.import_module(m.name)
            except Exception as exc:  # only lerobot-related failures are this test's business
                if "lerobot" in repr(exc) or m.name.startswith("flexpack.data"):
                    failed.append((m.name, repr(exc)))
        assert not failed, failed
        loaded = [k for k, v in sys.modules.items() if k.split(".")[0] == "lerobot" and v is not None]
        assert not loaded, loaded
        from flexpack.data.lengths import dataset_latent_frames
        import pathlib; root = pathlib.Path(sys.argv[1]); (root / "meta").mkdir()
        (root / "meta" / "info.json").write_text("{}")
        try:
            dataset_latent_frames(root)
        except ImportError:
            print("OK")
        """
    )
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("OK")
