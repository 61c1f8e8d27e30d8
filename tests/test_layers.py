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
    from flexpack import (
        FlexAttnFunc,
        LengthBucketBatchSampler,
        PackCollate,
        PadCollate,
        SequenceLayout,
        TokenBudgetBatchSampler,
        WanVA,
    )

    assert PackCollate is importlib.import_module("flexpack.packing.collate").PackCollate
    assert FlexAttnFunc is importlib.import_module("flexpack.attention.flex").FlexAttnFunc
    assert WanVA is importlib.import_module("flexpack.models.wan").WanVA
    assert {LengthBucketBatchSampler, TokenBudgetBatchSampler, PadCollate, SequenceLayout} <= {
        getattr(flexpack, n) for n in flexpack.__all__}
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        flexpack.nope  # noqa: B018


SAMPLING_MAY_IMPORT_FROM_TRAINING = {"flow.objective", "flow.noise", "build", "runstate.checkpoint", "export",
                                     "runstate.resume", "runstate.trained", "checks", "config", "holdout", "parallel",
                                     "plan"}


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


# What each sub-package of training/ may import from the rest of training/ (besides itself): the strongest rule
# that the code keeps. flow/ is its own wing (the loss and the noise know the batch and the layout, never the
# config, the loop or checkpoints); observe/ reads the config and measures, it never drives a step or holds
# run state; runstate/ persists and restores a run from the config, the shape checks and the rank, and knows
# nothing of meters, the objective or the drivers (loop, step, build, plan, validation, verify).
TRAINING_SUBPACKAGE_MAY_IMPORT = {
    "flow": set(),
    "observe": {"config"},
    "runstate": {"config", "checks", "parallel"},
}


def training_violations(sub: str) -> set[str]:
    """``file: module`` for every import of a ``sub`` file that reaches into training/ outside its rule."""
    allowed = {f"flexpack.training.{a}" for a in {sub} | TRAINING_SUBPACKAGE_MAY_IMPORT[sub]}
    return {f"{p.relative_to(ROOT)}: {m}" for p in wing_files(f"training/{sub}") for m in imported_modules(p)
            if m.startswith("flexpack.training.") and not any(m == a or m.startswith(a + ".") for a in allowed)}


def flow_outside_violations() -> set[str]:
    return {f"{p.relative_to(ROOT)}: {m}" for p in wing_files("training/flow") for m in imported_modules(p)
            if m.split(".")[1:2] and m.split(".")[1] in ("data", "models", "sampling", "cli", "cli_stats")}


def test_flow_imports_nothing_of_the_harness():
    """The objective and the noise: nothing of training/ outside flow/, nor data, models or sampling."""
    assert {p.stem for p in wing_files("training/flow")} >= {"objective", "noise"}
    bad = training_violations("flow") | flow_outside_violations()
    assert not bad, sorted(bad)


def test_observe_imports_only_config_from_training():
    """Observability never imports the drivers (loop, step, build, plan), run state or the objective."""
    bad = training_violations("observe")
    assert not bad, sorted(bad)


def test_runstate_imports_only_config_checks_parallel_from_training():
    """Run state never imports observe/, flow/ or the drivers (loop, step, build, plan, validation)."""
    bad = training_violations("runstate")
    assert not bad, sorted(bad)


def test_every_training_subpackage_has_a_rule_and_a_one_line_init():
    """A new sub-package needs its rule here; an ``__init__`` is its rule in one docstring line, no re-exports
    (a re-export would let callers reach a module without naming its sub-package)."""
    inits = sorted((ROOT / "training").glob("*/__init__.py"))
    assert {p.parent.name for p in inits} == set(TRAINING_SUBPACKAGE_MAY_IMPORT)
    for init in inits:
        text = init.read_text(encoding="utf-8")
        body = ast.parse(text).body
        assert len(text.splitlines()) == 1 and len(body) == 1, init
        assert isinstance(body[0], ast.Expr) and isinstance(body[0].value.value, str), init


@pytest.mark.parametrize("sub", sorted(TRAINING_SUBPACKAGE_MAY_IMPORT))
def test_training_subpackage_rules_catch_a_forbidden_import(sub):
    """Each rule fails on a lazy import of the loop (allowed by none) placed in its sub-package."""
    probe = ROOT / "training" / sub / "_probe_for_test.py"
    probe.write_text("def f():\n    from flexpack.training import loop\n    import flexpack.data.cache\n")
    try:
        assert training_violations(sub) == {f"training/{sub}/_probe_for_test.py: flexpack.training.loop"}
        if sub == "flow":
            assert flow_outside_violations() == {"training/flow/_probe_for_test.py: flexpack.data.cache"}
    finally:
        probe.unlink()
