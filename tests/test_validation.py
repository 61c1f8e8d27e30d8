"""Held-out episodes and the validation loss (fixed noise per episode; comparable across steps and runs)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("lerobot")

from flexpack.run.compose import build_run  # noqa: E402
from flexpack.run.config import DataConfig  # noqa: E402
from flexpack.run.holdout import split_episodes  # noqa: E402
from flexpack.run.model import build_model  # noqa: E402
from flexpack.run.state import checkpoint  # noqa: E402
from flexpack.training.loop import train  # noqa: E402
from flexpack.training.validation import Validator  # noqa: E402
from helpers import tiny_config  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
pytestmark = pytest.mark.usefixtures("one_thread")


def test_split_is_deterministic_disjoint_and_checked():
    eps = list(range(20))
    cfg = DataConfig(val_fraction=0.2, val_episodes=(3,), seed=1)
    train_eps, val = split_episodes(eps, cfg)
    assert split_episodes(eps, cfg) == (train_eps, val)  # a pure function: every rank agrees
    assert 3 in val and len(val) in (4, 5) and not set(train_eps) & set(val) and sorted(train_eps + val) == eps
    assert split_episodes(eps, replace(cfg, seed=2))[1] != val  # the seed chooses
    assert split_episodes(eps, DataConfig()) == (eps, [])
    assert split_episodes(eps, DataConfig(val_fraction=0.01))[1].__len__() == 1  # at least one
    with pytest.raises(ValueError, match=r"data.val_episodes \[42\] are not episodes of ds"):
        split_episodes(eps, DataConfig(val_episodes=(42,)), "ds")
    with pytest.raises(ValueError, match="none is left to train on"):
        split_episodes([0, 1], DataConfig(val_episodes=(0, 1)))
    with pytest.raises(ValueError, match="data.val_fraction must be in"):
        DataConfig(val_fraction=1.0)


@pytest.fixture
def dataset(tiny_dataset) -> Path:
    return tiny_dataset  # the session's dataset: six episodes (only read here)


def _cfg(root, out, *more):
    return tiny_config(root, out, "schedule.steps=4", "data.val_episodes=[1, 4]", "validation.every=2", *more)


def test_validation_loss_is_logged_held_out_and_reproducible(dataset, tmp_path):
    cfg = _cfg(dataset, tmp_path / "a")
    res = train(cfg)
    trained_on = {e for eps in res.episodes for e in eps}
    assert trained_on and not trained_on & {1, 4}  # held out of training
    recs = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 4]
    for r in val:
        assert r["val_loss"] == pytest.approx(r["val_latent_loss"] + r["val_action_loss"], rel=1e-6)
    assert val[0]["val_loss"] != val[1]["val_loss"]  # the weights changed; the noise did not
    # the final model evaluated afresh gives the logged number: fixed noise and timesteps per episode
    model = build_model(cfg)
    checkpoint.load(checkpoint.latest(tmp_path / "a" / "checkpoints"), model, restore_rng=False)
    assert (Validator(build_run(cfg)).evaluate(model)["val_loss"]
            == pytest.approx(val[1]["val_loss"], rel=1e-6))
    # ... however the held-out items are batched, and whatever the run seed
    for other in (["data.mode='pad'", "data.batch_size=1"], ["runtime.seed=5"]):
        again = Validator(build_run(_cfg(dataset, tmp_path / "x", *other))).evaluate(model)
        assert again["val_loss"] == pytest.approx(val[1]["val_loss"], rel=1e-5), other


def test_eval_every_needs_held_out_episodes(dataset, tmp_path):
    with pytest.raises(ValueError, match="validation.every=2 needs held-out episodes"):
        train(_cfg(dataset, tmp_path / "b", "data.val_episodes=[]"))
