"""The layering of docs/design.md section 1, enforced: every module of pyspice/ has one layer,
and imports point down (or sideways, without a cycle).

Every import counts: at module level, inside functions, under TYPE_CHECKING, and
`importlib.import_module("...")` with a literal name. A module missing from the
table fails, so a new module gets its place when it is added.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "pyspice"

# lower layers never import higher ones
LAYERS = ("base", "policy", "mechanism", "engine", "measure", "cli")

# a module's layer: the longest prefix listed here that names it ("pyspice" only itself)
TABLE = {
    # plain utilities
    "pyspice._version": "base",
    "pyspice.units": "base",
    "pyspice.paths": "base",
    "pyspice.outputs": "base",
    "pyspice.interrupts": "base",
    # decisions: pure Python/numpy, imports nothing native
    "pyspice.policy": "policy",
    # what the policy runs on: the binding to libspice, the simulator, the file
    # formats, the fitting of a sidecar, and the models pyspice builds
    "pyspice.runtime": "mechanism",
    "pyspice.build_info": "mechanism",
    "pyspice.stats": "mechanism",
    "pyspice.sim": "mechanism",
    "pyspice.formats": "mechanism",
    "pyspice.calibrate": "mechanism",
    "pyspice.calibrate.lore_fit": "mechanism",
    "pyspice.calibrate.predictor_fit": "mechanism",
    "pyspice.calibrate.evaluate": "mechanism",
    "pyspice.models": "mechanism",
    # one model's engine, and the llama-cpp-python surface over it
    "pyspice.engine": "engine",
    "pyspice.api": "engine",
    "pyspice": "engine",  # the package: `pyspice.Llama`
    # runs of a real model: measurements, and calibration (whose capture runs the model)
    "pyspice.measure": "measure",
    "pyspice.calibrate.capture": "measure",
    "pyspice.calibrate.pipeline": "measure",
    "pyspice.calibrate.run": "measure",
    "pyspice.calibrate.levels_run": "measure",  # measures the levels' grid on the model
    "pyspice.models.default": "measure",  # the default model is calibrated on first use
    # parsing arguments and printing
    "pyspice.cli": "cli",
    "pyspice.__main__": "cli",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer_of(module: str) -> str | None:
    if module == "pyspice":
        return TABLE[module]
    parts = module.split(".")
    for n in range(len(parts), 1, -1):  # "pyspice" alone names only the package
        layer = TABLE.get(".".join(parts[:n]))
        if layer is not None:
            return layer
    return None


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports_of(module: str) -> set[str]:
    """The pyspice modules `module` imports, anywhere in its code."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                target = _resolve(module, path.name == "__init__.py", node.level, node.module)
            found.add(target)
            # `from pyspice.cli import bench_cmd` imports the submodule
            found.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES)
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__"))
            )
        ):
            found.add(node.args[0].value)
    return {m for m in found if m == "pyspice" or m.startswith("pyspice.")} - {module}


def test_every_module_has_a_layer() -> None:
    missing = [m for m in MODULES if layer_of(m) is None]
    assert not missing, f"modules missing from the layer table: {missing}"


def test_every_import_is_a_module() -> None:
    unknown = {f"{m} -> {t}" for m in MODULES for t in imports_of(m) if t not in MODULES}
    assert not unknown, f"imports of no pyspice module: {sorted(unknown)}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module: str) -> None:
    rank = LAYERS.index(layer_of(module) or "cli")
    upward = [
        f"{target} ({layer_of(target)})"
        for target in sorted(imports_of(module))
        if LAYERS.index(layer_of(target) or "cli") > rank
    ]
    assert not upward, f"{module} ({layer_of(module)}) imports upward: {', '.join(upward)}"


def test_policy_imports_nothing_native() -> None:
    for module in MODULES:
        if layer_of(module) == "policy":
            outside = {m for m in imports_of(module) if layer_of(m) not in ("base", "policy")}
            assert not outside, f"{module} imports {outside}"


def test_no_import_cycle() -> None:
    graph = {m: {t for t in imports_of(m) if t in MODULES} for m in MODULES}
    # a package importing its own submodules (re-exports) is the one loop Python
    # resolves by construction; a submodule importing its package back is not counted
    for m in graph:
        graph[m] = {t for t in graph[m] if not m.startswith(t + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycle = [*stack[stack.index(t) :], t]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
