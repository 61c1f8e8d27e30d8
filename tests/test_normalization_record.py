"""The action statistics as one typed record (:class:`flexpack.data.normalization.ActionStats`): the JSON it writes
is the ``{"mode", "low", "high"}`` object checkpoints and exports have always carried, a checkpoint or export in
that format loads unchanged, and a malformed record is one line naming its file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flexpack.data.actions import ActionNormalizer
from flexpack.data.normalization import ActionStats
from flexpack.run.state import resume

QUANTILE = ActionNormalizer("quantile", np.array([-1.25, 0.0, 0.1]), np.array([2.5, 1.0, 0.30000000000000004]))


def _old_record(n: ActionNormalizer) -> dict:
    """The record as checkpoints and exports stored it before the typed record (``normalizer_state`` then)."""
    return {"mode": n.mode, "low": np.asarray(n.low).tolist(), "high": np.asarray(n.high).tolist()}


@pytest.mark.parametrize("n", [QUANTILE, ActionNormalizer("meanstd", np.array([0.5, -3.0]), np.array([2.0, 0.0])),
                               ActionNormalizer.identity(4)])
def test_the_record_writes_the_old_format_and_reads_it_back(n):
    class Holder:
        normalizer = n

    stats = resume.normalizer_state(Holder())
    assert resume.stats_extra(stats) == {"action_normalizer": _old_record(n)}
    text = json.dumps(resume.stats_extra(stats))  # as train_state.json holds it
    again = resume.saved_stats({"extra": json.loads(text)}, "RUN/train_state.json", width=len(n.low))
    assert again == stats and again.to_json() == _old_record(n)
    back = again.normalizer()
    x = np.linspace(-2, 3, 3 * len(n.low)).reshape(3, len(n.low))
    np.testing.assert_array_equal(back(x), n(x))  # the same map, bit for bit
    assert resume.saved_stats({"extra": {"action_normalizer": None}}, "X") is None  # a run without actions
    assert resume.saved_stats({"step": 3}, "X") is None  # a checkpoint older than the statistics


def test_an_exports_normalization_json_reads_with_its_layout_keys():
    record = {"action_key": "action", **_old_record(QUANTILE), "columns": 3, "channels": [0, 1, 2],
              "action_steps": 4, "stride": 4, "dataset": "d", "formula": "2 (x - low) / (high - low) - 1"}
    stats = ActionStats.from_json(record, "EXPORT/normalization.json")
    assert stats == ActionStats(mode="quantile", low=(-1.25, 0.0, 0.1), high=(2.5, 1.0, 0.30000000000000004))
    assert stats.matches(ActionStats.of(QUANTILE)) and not stats.matches(None)
    assert not stats.matches(ActionStats(mode="quantile", low=(-1.25, 0.0, 0.2), high=stats.high))


@pytest.mark.parametrize("record,message", [
    ([1, 2], "the 'action' normalization is not {mode: quantile | meanstd | none, low, high}"),
    ({"mode": "minmax", "low": [0.0], "high": [1.0]}, "the 'action' normalization is not {mode:"),
    ({"mode": "quantile", "high": [1.0]}, "the 'action' normalization has no list of low values"),
    ({"mode": "quantile", "low": ["a"], "high": [1.0]}, "feature 'action': q01 is not a list of numbers"),
    ({"mode": "quantile", "low": [0.0, 0.0], "high": [1.0]}, "feature 'action': q99 has 1 values, the feature has 2"),
    ({"mode": "meanstd", "low": [float("nan")], "high": [1.0]}, "feature 'action' column 0: mean is nan"),
    ({"mode": "none", "low": [0.0]}, "the 'action' normalization has no list of high values"),
    ({"mode": "none", "low": [0.0, 0.0], "high": [1.0]}, "has 2 low and 1 high values"),
    ({"mode": "none", "low": [0.0], "high": ["x"]}, "the 'action' normalization's high is not a list of numbers"),
])
def test_a_malformed_record_is_one_line_naming_its_file(record, message):
    with pytest.raises(ValueError) as exc:
        ActionStats.from_json(record, "RUN/step_2/train_state.json (extra.action_normalizer)")
    text = str(exc.value)
    assert text.startswith("RUN/step_2/train_state.json (extra.action_normalizer): ") and "\n" not in text
    assert message in text


def test_a_record_of_another_width_is_refused():
    with pytest.raises(ValueError, match=r"^F: feature 'action': q01 has 3 values, the feature has 2 columns"):
        ActionStats.from_json(_old_record(QUANTILE), "F", width=2)


def test_a_checkpoint_in_the_old_format_loads_for_sample_and_resume(tiny_dataset, tmp_path, capsys):
    """A checkpoint whose train_state.json holds the record as plain JSON (written here without the record
    type) gives sample its statistics, and a resume keeps them on a dataset whose own statistics differ."""
    from flexpack.commands.sample import load_weights
    from flexpack.data import LatentEpisodeDataset
    from flexpack.run.compose import compose
    from flexpack.run.model import build_model
    from flexpack.run.state import checkpoint
    from helpers import tiny_config

    dataset = LatentEpisodeDataset(tiny_dataset, action_dim=6)
    old = _old_record(dataset.normalizer)
    old["low"] = [v - 0.5 for v in old["low"]]  # statistics the weights were trained with, not the dataset's today
    cfg = tiny_config(tiny_dataset, tmp_path / "run")
    checkpoint.save(tmp_path / "run" / "checkpoints", 2, build_model(cfg), None, config=cfg.to_dict(),
                    extra={"action_normalizer": old})
    found = tmp_path / "run" / "checkpoints" / "step_00000002"
    _, stats, label = load_weights(compose(cfg, "export"), found)  # the model alone: no data
    assert label == str(found) and stats == ActionStats(mode=old["mode"], low=tuple(old["low"]),
                                                        high=tuple(old["high"]))
    resume._restore_normalizer(found, dataset, old, rank=0)
    assert "keeping the checkpoint's" in capsys.readouterr().err
    assert resume.normalizer_state(dataset) == stats and dataset.normalizer.mode == old["mode"]
    np.testing.assert_array_equal(dataset.normalizer.low, np.asarray(old["low"]))
