"""Every Python example of the README runs as written (in a folder holding ``make demo``'s dataset)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("lerobot")

README = Path(__file__).resolve().parents[1] / "README.md"


def python_examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_examples():
    assert python_examples(), "README.md lost its Python example"


@pytest.mark.parametrize("index", range(len(python_examples())))
def test_readme_python_example_runs_as_written(index, tiny_dataset, tmp_path, monkeypatch):
    shutil.copytree(tiny_dataset, tmp_path / "out" / "demo-data")  # what `make demo` leaves in out/
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(python_examples()[index], f"README.md python example {index}", "exec"), namespace)
    if "batch" in namespace:  # the packing example: whole episodes, one fixed frame budget, token layout
        batch, tokens = namespace["batch"], namespace["tokens"]
        assert tuple(batch.latent.shape) == (1, 48, 20, 2, 2)
        assert tokens.doc.shape[0] == 20 * (1 + 4)
    if "out" in namespace:  # the attention line: each episode's tokens attend only to their own episode
        import torch
        import torch.nn.functional as F

        q, k, v, out, doc = namespace["q"], namespace["k"], namespace["v"], namespace["out"], namespace["tokens"].doc
        assert out.shape == q.shape
        episodes = sorted(set(doc.tolist()) - {-1})
        assert len(episodes) >= 1
        for e in episodes:
            own = doc == e
            alone = F.scaled_dot_product_attention(q[:, :, own], k[:, :, own], v[:, :, own])
            torch.testing.assert_close(out[:, :, own], alone)
