import atexit
import os
import shutil
import tempfile

# A TorchInductor cache of this test run alone (unless one is chosen). The compiled CPU FlexAttention
# kernel sizes its per-thread scratch buffers by the thread count at compile time, and torch 2.11's graph
# cache key leaves that count out: a kernel that a one-thread run (OMP_NUM_THREADS=1) left in the shared
# default cache (/tmp/torchinductor_$USER), run on two threads, writes past its buffers and aborts.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _inductor_cache = tempfile.mkdtemp(prefix="flexpack-tests-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _inductor_cache
    atexit.register(shutil.rmtree, _inductor_cache, ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402

# One intra-op thread for the whole run, whatever OMP_NUM_THREADS says: the same compile-time thread count
# for every compiled CPU kernel of the process (see above), and the tests' tiny ops gain nothing from a pool.
torch.set_num_threads(1)

# Tests never reach a hub: datasets are built locally, models are small and random.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# lerobot reads parquet through `datasets`, which caches arrow files per dataset; keep those out of
# the user's home folder and remove them after the run.
_hf_cache = tempfile.mkdtemp(prefix="flexpack-tests-hf-")
os.environ["HF_DATASETS_CACHE"] = _hf_cache
atexit.register(shutil.rmtree, _hf_cache, ignore_errors=True)


@pytest.fixture
def one_thread():
    """One intra-op thread: the tiny model's ops are far too small for a thread pool; on shared
    cores it only adds waits (train/verify tests use it)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


TINY_VIDEO_FRAMES = [37, 29, 21, 17, 13, 9]  # latent frames 10, 8, 6, 5, 4, 3


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory):
    """A synthetic LeRobot dataset with its pool-encoded latent cache, built once per test run
    (for configs/tiny_cpu.toml: 48-channel 2x2 latents, 6 action columns). Do not modify it:
    copy it (shutil.copytree) to break it."""
    pytest.importorskip("lerobot")
    from flexpack.data.encode import encode_dataset
    from flexpack.data.synthetic import make_synthetic_dataset

    root = make_synthetic_dataset(tmp_path_factory.mktemp("tiny") / "ds", lengths=TINY_VIDEO_FRAMES, seed=1)
    encode_dataset(root, progress=False)
    return root


@pytest.fixture(scope="session")
def train_dataset(tiny_dataset):
    """The same dataset under the name the fault and resume tests use; tests that damage it copy it first."""
    return tiny_dataset


VAE_MEAN, VAE_STD = [0.1, 0.2, -0.1, 0.0], [1.5, 2.0, 0.5, 1.0]  # per latent channel, as the Wan VAE config stores them


@pytest.fixture(scope="session")
def tiny_vae(tmp_path_factory):
    """A tiny random diffusers AutoencoderKLWan saved to disk: (path, model)."""
    diffusers = pytest.importorskip("diffusers", reason="diffusers (dev extra) is needed for the wan-vae encoder")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
        temperal_downsample=[False, True, True], latents_mean=VAE_MEAN, latents_std=VAE_STD,
    )
    path = tmp_path_factory.mktemp("vae") / "tiny-wan-vae"
    vae.save_pretrained(path)
    return path, vae.eval()
