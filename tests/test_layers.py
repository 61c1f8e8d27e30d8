"""The package is a stack of layers: packing at the bottom, attention on the layout types,
models and training above. Every import statement (top-level, lazy or TYPE_CHECKING) counts."""

import ast
import importlib
import pathlib

import pytest

import flexpack

ROOT = pathlib.Path(flexpack.__file__).parent


def imported_modules(path: pathlib.Path) -> set[str]:
    """Absolute names of every ``flexpack`` module a file imports (relative imports resolved)."""
    package = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}  # `from flexpack import training`
    return {m for m in out if m == "flexpack" or m.startswith("flexpack.")}


def wing_files(wing: str) -> list[pathlib.Path]:
    files = sorted((ROOT / wing).rglob("*.py"))
    assert files, wing
    return files


def test_imported_modules_sees_every_kind_of_import(tmp_path):
    probe = ROOT / "packing" / "_probe_for_test.py"
    probe.write_text("from ..training import loop\nif 1:\n    import flexpack.data.cache\n"
                     "def f():\n    from flexpack.models.wan import WanVA\n")
    try:
        assert {"flexpack.training.loop", "flexpack.data.cache", "flexpack.models.wan"} <= imported_modules(probe)
    finally:
        probe.unlink()


@pytest.mark.parametrize("wing", ["packing", "attention"])
def test_core_wings_never_import_training_data_or_models(wing):
    bad = {f"{p.relative_to(ROOT)}: {m}" for p in wing_files(wing) for m in imported_modules(p)
           if m.split(".")[1:2] and m.split(".")[1] in ("training", "data", "models", "cli", "cli_stats")}
    assert not bad, sorted(bad)


def test_packing_imports_only_itself_and_atomic():
    bad = {f"{p.relative_to(ROOT)}: {m}" for p in wing_files("packing") for m in imported_modules(p)
           if not (m.startswith("flexpack.packing") or m.startswith("flexpack.atomic"))}
    assert not bad, sorted(bad)


def test_attention_takes_only_layout_types_from_packing():
    bad = {f"{p.relative_to(ROOT)}: {m}" for p in wing_files("attention") for m in imported_modules(p)
           if m.startswith("flexpack.packing") and not m.startswith("flexpack.packing.layout")}
    assert not bad, sorted(bad)


def test_models_and_data_never_import_training():
    bad = {f"{p.relative_to(ROOT)}: {m}" for w in ("models", "data") for p in wing_files(w)
           for m in imported_modules(p) if m.startswith("flexpack.training")}
    assert not bad, sorted(bad)


def test_no_import_cycles_between_modules():
    modules = {".".join(p.relative_to(ROOT.parent).with_suffix("").parts): p for p in ROOT.rglob("*.py")}
    modules = {k.removesuffix(".__init__"): v for k, v in modules.items()}
    graph = {m: {d for d in imported_modules(p) if d in modules and d != m and not m.startswith(d + ".")}
             for m, p in modules.items()}
    # a package's __init__ is not an edge target unless it is imported for itself
    seen, stack = set(), []

    def visit(m):
        if m in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(m):] + [m]))
        if m in seen:
            return
        stack.append(m)
        for d in sorted(graph[m]):
            visit(d)
        stack.pop()
        seen.add(m)

    for m in sorted(graph):
        visit(m)


def test_top_level_reexports():
    from flexpack import (FlexAttnFunc, LengthBucketBatchSampler, PackCollate, PadCollate, SequenceLayout,
                          TokenBudgetBatchSampler, WanVA)

    assert PackCollate is importlib.import_module("flexpack.packing.collate").PackCollate
    assert FlexAttnFunc is importlib.import_module("flexpack.attention.flex").FlexAttnFunc
    assert WanVA is importlib.import_module("flexpack.models.wan").WanVA
    assert {LengthBucketBatchSampler, TokenBudgetBatchSampler, PadCollate, SequenceLayout} <= {
        getattr(flexpack, n) for n in flexpack.__all__}
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        flexpack.nope  # noqa: B018


SAMPLING_MAY_IMPORT_FROM_TRAINING = {"flow.objective", "flow.noise", "build", "runstate.checkpoint", "export",
                                     "runstate.resume", "checks", "config", "holdout", "parallel", "plan"}


def test_sampling_imports_only_the_training_parts_it_needs():
    def allowed(rel: str) -> bool:  # a module, a name in it, or the sub-package holding it (`from ..runstate import x`)
        return any(rel == a or rel.startswith(a + ".") or a.startswith(rel + ".")
                   for a in SAMPLING_MAY_IMPORT_FROM_TRAINING)

    bad = {f"{p.relative_to(ROOT)}: {m}" for p in wing_files("sampling") for m in imported_modules(p)
           if m.startswith("flexpack.training.") and not allowed(m.removeprefix("flexpack.training."))}
    assert not bad, sorted(bad)


def test_only_the_training_loop_imports_sampling():
    users = {str(p.relative_to(ROOT)) for w in ("packing", "attention", "models", "data", "training")
             for p in wing_files(w) if any(m.startswith("flexpack.sampling") for m in imported_modules(p))}
    assert users <= {"training/loop.py"}, sorted(users)


def test_objective_and_noise_import_nothing_from_the_harness():
    """Their own wing: the loss and the noise know the batch and layout, never config, loop or checkpoints
    (found by name, so that they keep this rule wherever a move puts them inside training/)."""
    files = [p for p in wing_files("training") if p.stem in ("objective", "noise")]
    assert sorted(p.stem for p in files) == ["noise", "objective"]
    own = {".".join(p.relative_to(ROOT.parent).with_suffix("").parts) for p in files}
    bad = {f"{p.relative_to(ROOT)}: {m}" for p in files for m in imported_modules(p)
           if m.startswith("flexpack.training") and not any(m == o or m.startswith(o + ".") for o in own)}
    assert not bad, sorted(bad)
