"""Loss parts by name: an objective defined here, outside flexpack, that returns one more part gets it logged in
metrics.jsonl (training rows and validation rows) without a change to flexpack."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch

pytest.importorskip("lerobot")

from flexpack.commands.train import train  # noqa: E402
from flexpack.flow.noise import noise_seeds  # noqa: E402
from flexpack.flow.objective import LossPart  # noqa: E402
from flexpack.flow.objectives import FlowObjective  # noqa: E402
from flexpack.models import registry  # noqa: E402
from flexpack.run.compose import build_run  # noqa: E402
from flexpack.run.model import build_model  # noqa: E402
from flexpack.run.state import checkpoint  # noqa: E402
from flexpack.training.step import accumulate, part_names  # noqa: E402
from flexpack.training.validation import Validator  # noqa: E402
from helpers import tiny_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
FAMILY = "wanva-speed"


class SpeedObjective(FlowObjective):
    """flexpack's flow matching plus a part that is logged, not trained on: the mean square of the predicted
    latent velocity over the elements the latent loss counts."""

    def counts(self, batch: Any) -> dict[str, torch.Tensor]:
        counts = super().counts(batch)
        return {**counts, "speed": counts["latent_loss"]}

    def loss(self, pred: Any, sample: Any, batch: Any) -> Any:
        fl = super().loss(pred, sample, batch)
        valid = batch.layout.frame_valid[:, None, :, None, None]
        speed = torch.where(valid, pred.video.float().square(), 0.0).sum()
        return fl.with_parts(speed=LossPart(speed, fl.latent_count))


@pytest.fixture
def speed_family():
    """WanVA with the objective above, as a family of its own (registered here, removed afterwards)."""
    registry.register(FAMILY, lambda: dataclasses.replace(registry.family("wanva"), name=FAMILY,
                                                          objective=SpeedObjective))
    yield FAMILY
    registry._FAMILIES.pop(FAMILY)


def test_an_extra_loss_part_is_logged_in_training_and_validation(speed_family, tiny_dataset, tmp_path, capsys):
    cfg = tiny_config(tiny_dataset, tmp_path / "a", f"model.family='{FAMILY}'", "schedule.steps=4",
                      "data.val_episodes=[1, 4]", "validation.every=2")
    run = build_run(cfg)
    assert isinstance(run.objective, SpeedObjective)
    batch = run.collate([run.dataset[i] for i in next(iter(run.sampler))])
    assert part_names(run.objective, batch) == ("loss", "latent_loss", "action_loss", "speed")

    # the step's values: the loss (the part is logged only: it adds nothing), then every part by name
    torch.manual_seed(0)
    model = run.build_model()
    sums = accumulate(model, [batch], run, step=0)
    assert sums.shape == (4,)
    assert float(sums[0]) == pytest.approx(float(sums[1] + sums[2]), rel=1e-6)
    with torch.no_grad():  # the same noise: the step's seeds
        sample = run.objective.sample(batch, noise_seeds(batch.layout, cfg.runtime.seed, 0))
        pred = run.forward(model, sample)
    valid = batch.layout.frame_valid[:, None, :, None, None]
    want = torch.where(valid, pred.video.float().square(), 0.0).sum() / run.objective.counts(batch)["speed"]
    assert float(sums[3]) == pytest.approx(float(want), rel=1e-5) and float(sums[3]) > 0

    capsys.readouterr()
    train(cfg)
    last = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step 4/4")]
    assert last and " (latent " in last[0] and ", speed " in last[0], last  # the progress line names the parts
    recs = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in recs if "grad_norm" in r]
    val = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 4] and len(rows) == 4
    assert all(r["speed"] > 0 and r["loss"] == pytest.approx(r["latent_loss"] + r["action_loss"], rel=1e-5)
               for r in rows)
    for r in val:  # the validation loss is the trained loss: the logged-only part is not in it
        assert r["val_speed"] > 0
        assert r["val_loss"] == pytest.approx(r["val_latent_loss"] + r["val_action_loss"], rel=1e-6)
    # the logged number is the final model's, evaluated afresh
    model = build_model(cfg)
    checkpoint.load(checkpoint.latest(tmp_path / "a" / "checkpoints"), model, restore_rng=False)
    again = Validator(build_run(cfg)).evaluate(model)
    assert again["val_speed"] == pytest.approx(val[-1]["val_speed"], rel=1e-6)


def test_a_weighted_extra_part_is_trained_on():
    """``with_parts`` with a weight adds the part to the loss and to the accumulated share."""
    one = torch.tensor(1.0)
    base = dataclasses.replace(_flow_loss(), extra={})
    more = base.with_parts(extra=LossPart(torch.tensor(6.0), torch.tensor(3.0), weight=0.5))
    assert float(more.loss) == pytest.approx(float(base.loss) + 0.5 * 2.0)
    totals = {"latent_loss": 4.0, "action_loss": 2.0, "extra": 6.0}
    assert float(more.accumulation_loss(totals)) == pytest.approx(float(base.accumulation_loss(totals)) + 0.5)
    with pytest.raises(ValueError, match="loss part 'extra' has no count"):
        more.accumulation_loss({"latent_loss": one, "action_loss": one})
    with pytest.raises(ValueError, match=r"shadow the built-in names"):
        base.with_parts(latent_loss=LossPart(one, one)).parts()


def _flow_loss() -> Any:
    from flexpack.flow.objective import FlowLoss

    lat, act = torch.tensor(8.0), torch.tensor(2.0)
    n_lat, n_act = torch.tensor(4.0), torch.tensor(2.0)
    return FlowLoss(lat / n_lat + act / n_act, lat / n_lat, act / n_act, lat, act, n_lat, n_act, 1.0, 1.0)
