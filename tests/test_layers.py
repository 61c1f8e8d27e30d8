"""The package is a stack of layers, each importing only from the layers under it (docs/ARCHITECTURE.md):
packing at the bottom; attention on the layout types; models and data; flow and parallel; the run substrate;
training and sampling as siblings; tools; the model families' folders; the command line. Every import statement
(top-level, lazy or TYPE_CHECKING) counts. Generic code never imports a family folder: the registry finds the
built-in families by their package names (``models/registry.py: BUILTIN``), as it would find a plugin, and
the deprecated old paths of moved modules (shim files, and ``flexpack.MOVED_MODULES``) are the only other way in."""

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
                     "def f():\n    from flexpack.families.wan.model import WanVA\n")
    try:
        assert {"flexpack.training.loop", "flexpack.data.cache", "flexpack.families.wan.model"} \
            <= imported_modules(probe)
    finally:
        probe.unlink()


# The flexpack packages (and top-level modules) each package may import besides itself. Top-level helper
# modules (atomic, errors, safenames) sit under everything; `cli` and `commands/` may import anything.
BASE = {"atomic", "errors", "safenames"}
MAY_IMPORT = {
    "packing": {"atomic"},
    "attention": {"packing.layout", "packing.transfer"},
    "models": {"attention", "packing"},
    "data": {"packing"} | BASE,
    "flow": {"packing"},
    "parallel": {"attention", "errors"},
    "run": {"packing", "attention", "models", "data", "flow", "parallel"} | BASE,
    "training": {"packing", "attention", "models", "data", "flow", "parallel", "run"} | BASE,
    "sampling": {"packing", "attention", "models", "data", "flow", "parallel", "run"} | BASE,
    "tools": {"packing", "attention", "models", "data", "flow", "parallel", "run", "training", "sampling"} | BASE,
    # a family folder holds its model, objective, sampler and export writers: it may use every generic layer
    "families": {"packing", "attention", "models", "data", "flow", "parallel", "run", "training", "sampling",
                 "tools"} | BASE,
}
# The family folders another family folder builds on (lingbot-va is LeRobot's model on the Wan backbone).
FAMILY_MAY_IMPORT = {"wan": set(), "lingbot": {"wan"}}
# Imports the stack does not allow yet, each with the reason it is still there.
KNOWN_EXCEPTIONS: dict[str, set[str]] = {}


def is_shim(path: pathlib.Path) -> bool:
    """Whether ``path`` is a deprecated old path of a moved module: a docstring, the import of its new module and
    of ``flexpack.training.deprecated.moved``, and ``__getattr__ = moved(__name__, _new)``, nothing else."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    if len(body) != 4 or not isinstance(body[0], ast.Expr):
        return False
    new, helper, assign = body[1:]
    return (isinstance(new, ast.ImportFrom) and [a.asname for a in new.names] == ["_new"]
            and isinstance(helper, ast.ImportFrom) and helper.module == "flexpack.training.deprecated"
            and isinstance(assign, ast.Assign) and ast.unparse(assign) == "__getattr__ = moved(__name__, _new)")


def shims() -> dict[str, str]:
    """Every shim of the package: its module name -> the module it moved to."""
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        if is_shim(p):
            new = ast.parse(p.read_text(encoding="utf-8")).body[1]
            out[".".join(p.relative_to(ROOT.parent).with_suffix("").parts)] = f"{new.module}.{new.names[0].name}"
    return out


def violations(package: str) -> set[str]:
    """``file: module`` for every import of a ``package`` file outside its rule (and the known exceptions); a
    shim is exempt (:func:`is_shim`)."""
    allowed = {f"flexpack.{a}" for a in {package} | MAY_IMPORT[package]}
    out = set()
    for p in wing_files(package):
        if is_shim(p):
            continue
        rel = str(p.relative_to(ROOT))
        for m in imported_modules(p):
            if m == "flexpack" or any(m == e or m.startswith(e + ".") for e in KNOWN_EXCEPTIONS.get(rel, ())):
                continue
            if not any(m == a or m.startswith(a + ".") or a.startswith(m + ".") for a in allowed):
                out.add(f"{rel}: {m}")
    return out


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_each_layer_imports_only_the_layers_under_it(package):
    bad = violations(package)
    assert not bad, sorted(bad)


def test_every_package_has_a_rule():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages == set(MAY_IMPORT) | {"commands"}, sorted(packages ^ (set(MAY_IMPORT) | {"commands"}))


def test_top_level_holds_at_most_five_modules():
    modules = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(modules) <= 5, modules


@pytest.mark.parametrize("package", ["training", "sampling", "run", "flow"])
def test_layer_rules_catch_a_forbidden_import(package):
    """A lazy import of a sibling or of a layer above, placed in the package, is reported."""
    probe = ROOT / package / "_probe_for_test.py"
    upper = "flexpack.sampling.media" if package == "training" else "flexpack.training.loop"
    probe.write_text(f"def f():\n    import {upper}\n")
    try:
        assert violations(package) == {f"{package}/_probe_for_test.py: {upper}"}
    finally:
        probe.unlink()


def test_attention_takes_only_layout_types_from_packing():
    bad = {f"{p.relative_to(ROOT)}: {m}" for p in wing_files("attention") for m in imported_modules(p)
           if m.startswith("flexpack.packing") and not m.startswith(("flexpack.packing.layout",
                                                                      "flexpack.packing.transfer"))}
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
    assert WanVA is importlib.import_module("flexpack.families.wan.model").WanVA
    assert {LengthBucketBatchSampler, TokenBudgetBatchSampler, PadCollate, SequenceLayout} <= {
        getattr(flexpack, n) for n in flexpack.__all__}
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        flexpack.nope  # noqa: B018


# What a sub-package may import from the rest of its package (besides itself): the strongest rule the code
# keeps. training/observe/ reads the config's sections and measures, it never drives a step or holds run state;
# run/state/ persists and restores a run from the config and the shape checks, and knows nothing of the
# composition root, build or the data split. training/runstate/ holds only the deprecated old paths of run/state/'s
# modules (CHANGELOG.md): each reads its names from there, warning through training/deprecated.py.
SUBPACKAGE_MAY_IMPORT = {
    "training/observe": {"flexpack.run.config", "flexpack.run.config_sections"},
    "run/state": {"flexpack.run.config", "flexpack.run.checks", "flexpack.run.resolve"},
    "training/runstate": {"flexpack.run.state", "flexpack.training.deprecated"},
}


def subpackage_violations(sub: str) -> set[str]:
    parent = "flexpack." + sub.split("/")[0]
    own = "flexpack." + sub.replace("/", ".")
    allowed = SUBPACKAGE_MAY_IMPORT[sub] | {own}
    return {f"{p.relative_to(ROOT)}: {m}" for p in wing_files(sub) for m in imported_modules(p)
            if (m.startswith(parent + ".") or m.startswith("flexpack.training.") or m.startswith("flexpack.run."))
            and not any(m == a or m.startswith(a + ".") for a in allowed)}


@pytest.mark.parametrize("sub", sorted(SUBPACKAGE_MAY_IMPORT))
def test_subpackage_rules(sub):
    bad = subpackage_violations(sub)
    assert not bad, sorted(bad)


def test_every_subpackage_has_a_rule_and_a_one_line_init():
    """A sub-package needs its rule here; an ``__init__`` is its rule in one docstring line, no re-exports
    (a re-export would let callers reach a module without naming its sub-package)."""
    inits = sorted(p for p in ROOT.glob("*/*/__init__.py"))
    families = {f"families/{f}" for f in FAMILY_MAY_IMPORT}  # their rule: FAMILY_MAY_IMPORT
    assert {str(p.parent.relative_to(ROOT)) for p in inits} == set(SUBPACKAGE_MAY_IMPORT) | families
    for init in inits:
        text = init.read_text(encoding="utf-8")
        body = ast.parse(text).body
        assert len(text.splitlines()) == 1 and len(body) == 1, init
        assert isinstance(body[0], ast.Expr) and isinstance(body[0].value.value, str), init


@pytest.mark.parametrize("sub", sorted(SUBPACKAGE_MAY_IMPORT))
def test_subpackage_rules_catch_a_forbidden_import(sub):
    probe = ROOT / sub / "_probe_for_test.py"
    probe.write_text("def f():\n    from flexpack.run import root\n    from flexpack.training import loop\n")
    try:
        got = subpackage_violations(sub)
        assert f"{sub}/_probe_for_test.py: flexpack.training.loop" in got
        assert f"{sub}/_probe_for_test.py: flexpack.run.root" in got
    finally:
        probe.unlink()


def family_violations(name: str) -> set[str]:
    """``file: module`` for every import of another family's folder by family ``name``'s files outside its rule."""
    allowed = {f"flexpack.families.{f}" for f in {name} | FAMILY_MAY_IMPORT[name]}
    return {f"{p.relative_to(ROOT)}: {m}" for p in wing_files(f"families/{name}") for m in imported_modules(p)
            if m.startswith("flexpack.families.") and not any(m == a or m.startswith(a + ".") for a in allowed)}


def test_family_folders_import_only_the_families_they_build_on():
    folders = {p.parent.name for p in (ROOT / "families").glob("*/__init__.py")}
    assert folders == set(FAMILY_MAY_IMPORT)
    bad = set().union(*(family_violations(f) for f in FAMILY_MAY_IMPORT))
    assert not bad, sorted(bad)


def test_family_rules_catch_a_forbidden_import():
    probe = ROOT / "families" / "wan" / "_probe_for_test.py"
    probe.write_text("def f():\n    from flexpack.families.lingbot import model\n")
    try:
        assert family_violations("wan") == {f"families/wan/_probe_for_test.py: flexpack.families.lingbot{m}"
                                            for m in ("", ".model")}
    finally:
        probe.unlink()


def test_generic_code_reaches_families_only_through_the_registry_or_a_shim():
    """No module outside ``families/`` imports a family folder but the shims; the registry finds every family folder
    by name (its ``spec`` module, which registers it), so a new folder is one more ``BUILTIN`` entry."""
    from flexpack.models.registry import BUILTIN

    bad = {f"{p.relative_to(ROOT)}: {m}" for p in ROOT.rglob("*.py")
           if p.relative_to(ROOT).parts[0] != "families" and not is_shim(p)
           for m in imported_modules(p) if m.startswith("flexpack.families")}
    assert not bad, sorted(bad)
    assert set(BUILTIN) == {f"flexpack.families.{p.parent.name}.spec" for p in (ROOT / "families").glob("*/spec.py")}
    assert {p.parent.name for p in (ROOT / "families").glob("*/spec.py")} == set(FAMILY_MAY_IMPORT)


FAMILY_CLASSES = {"WanVA", "WanVAConfig", "WanVAOutput", "LingbotVA", "LingbotConfig", "LingbotObjective",
                  "LingbotSampler", "BundleCameras"}


def test_no_generic_code_names_a_family_class():
    """Outside the family folders (and the shims) no code names a family's classes: it asks the registry."""
    bad = set()
    for p in ROOT.rglob("*.py"):
        if p.relative_to(ROOT).parts[0] == "families" or is_shim(p):
            continue
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if name in FAMILY_CLASSES:
                bad.add(f"{p.relative_to(ROOT)}: {name}")
    assert not bad, sorted(bad)


def test_shims_are_found_and_each_old_path_names_an_existing_module():
    """File shims (an old module's file kept) and the old paths :data:`flexpack.MOVED_MODULES` answers without a
    file (so that git follows each moved file): no old path is both, and each names a module that exists."""
    found = shims()
    assert found["flexpack.training.config"] == "flexpack.run.config"
    assert not set(found) & set(flexpack.MOVED_MODULES)
    for old, new in {**found, **flexpack.MOVED_MODULES}.items():
        assert (ROOT.parent / (new.replace(".", "/") + ".py")).is_file(), new
        assert not (ROOT.parent / (old.replace(".", "/") + ".py")).exists() or old in found, old


def test_no_import_strings_name_a_callable():
    """No ``"module:Name"`` string stands for a callable (such strings would import past the rules above): a
    registry entry holds the objects themselves."""
    import re

    pattern = re.compile(r"^flexpack(\.\w+)+:\w+$")
    bad = {f"{p.relative_to(ROOT)}: {node.value}" for p in ROOT.rglob("*.py")
           for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
           if isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.match(node.value)}
    assert not bad, sorted(bad)


# Where the config class itself may be named: run/ (it builds, checks and composes it), commands/ (they load it and
# hand over a Run) and the package's re-export. Everything else takes a Run (flexpack.run.compose) or the plain section
# it needs (the loop's start-up before any data: flexpack.run.start). Modules that still name it would be listed here,
# each with its reason; none may be added.
TRAIN_CONFIG_OWNERS = ("run/", "commands/", "__init__.py")
TRAIN_CONFIG_KNOWN: set[str] = set()


def train_config_importers() -> set[str]:
    """Files of the package that import the name ``TrainConfig`` (any import statement: top level, lazy or
    ``TYPE_CHECKING``; from ``flexpack.run.config`` or the package)."""
    out = set()
    for p in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flexpack")
                    and any(a.name == "TrainConfig" for a in node.names)):
                out.add(str(p.relative_to(ROOT)))
    return out


def test_train_config_is_imported_only_by_run_commands_and_the_package():
    found = train_config_importers()
    outside = {f for f in found if not f.startswith(TRAIN_CONFIG_OWNERS)}
    assert outside <= TRAIN_CONFIG_KNOWN, sorted(outside - TRAIN_CONFIG_KNOWN)
    assert TRAIN_CONFIG_KNOWN <= outside, sorted(TRAIN_CONFIG_KNOWN - outside)  # one that stopped: drop it here
    assert {"sampling/solver.py", "sampling/evaluate.py", "tools/verify.py", "families/lingbot/sampler.py"}.isdisjoint(
        found)


def test_the_train_config_rule_catches_an_import():
    probe = ROOT / "sampling" / "_probe_for_test.py"
    probe.write_text("def f():\n    from flexpack.run.config import TrainConfig\n")
    try:
        assert "sampling/_probe_for_test.py" in train_config_importers()
    finally:
        probe.unlink()
