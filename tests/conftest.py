import atexit
import os
import shutil
import tempfile

import pytest

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


@pytest.fixture(scope="session")
def train_dataset(tmp_path_factory):
    """A small synthetic LeRobot dataset with its latent cache, built once per test session
    (6 episodes of latent frames 10, 8, 6, 5, 4, 3); tests that damage it copy it first."""
    pytest.importorskip("lerobot")
    from flexpack.data.encode import encode_dataset
    from flexpack.data.synthetic import make_synthetic_dataset

    root = make_synthetic_dataset(tmp_path_factory.mktemp("train_dataset") / "ds", lengths=[37, 29, 21, 17, 13, 9], seed=1)
    encode_dataset(root, progress=False)
    return root
