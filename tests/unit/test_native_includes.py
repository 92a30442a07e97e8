"""libspice's sources depend on each other one way: no header includes itself back
through others, no group of .c files calls each other round in a circle, and the plan
validator (spice-plan.c) sees spice.h's types, not the runtime's internals.

A cycle is where a newcomer cannot read one file before the other. The runtime's
feature files (asynchronous planning, surrogates) call the hook's file, which reaches
asynchronous planning through a table of functions (spice-runtime-internal.h); the
store's rule and plan files call the store, which only frees the rule's state.

The call graph is read from the text: functions defined at the start of a line
without `static`, and `name(` anywhere else once comments and strings are gone. That
is how libspice is written; a call through a function pointer is not seen, by design.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "native" / "src"
INCLUDE = SRC.parent / "include"

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
_DEFINITION = re.compile(r"^(?!static\b)[A-Za-z_][\w \*]*?\b(spice_\w+)\s*\([^;{]*\)\s*\{", re.M)
_CALL = re.compile(r"\b(spice_\w+)\s*\(")


def find_cycle(graph: Mapping[str, set[str] | list[str]]) -> list[str] | None:
    """A cycle of `graph` (node -> nodes it points to) as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found is not None:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found is not None:
                return found
    return None


def _strip(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r'"(\\.|[^"\\\n])*"', '""', text)


def _includes(src: Path = SRC, include: Path = INCLUDE) -> dict[str, set[str]]:
    """Every source and header of libspice -> the libspice headers it includes."""
    ours = {p.name for p in src.glob("*.h")} | {p.name for p in include.glob("*.h")}
    graph: dict[str, set[str]] = {}
    for path in sorted([*src.glob("*.c"), *src.glob("*.h"), *include.glob("*.h")]):
        graph[path.name] = {name for name in _INCLUDE.findall(path.read_text()) if name in ours}
    return graph


def _calls(src: Path = SRC) -> dict[str, set[str]]:
    """Every .c file of libspice -> the other .c files whose functions it calls."""
    text = {p.name: _strip(p.read_text()) for p in sorted(src.glob("*.c"))}
    defined_in: dict[str, str] = {}
    for name, body in text.items():
        for fn in _DEFINITION.findall(body):
            defined_in.setdefault(fn, name)
    return {
        name: {defined_in[fn] for fn in _CALL.findall(body) if defined_in.get(fn, name) != name}
        for name, body in text.items()
    }


def _reachable(graph: Mapping[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), set()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_cycle_finder_finds_cycles_and_only_cycles() -> None:
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["a"]}) == ["a", "a"]
    assert find_cycle({"top": ["x", "y"], "x": ["y"], "y": ["z"], "w": ["x", "z"]}) is None
    assert find_cycle({"top": ["left", "right"], "left": ["base"], "right": ["base"], "base": ["right"]}) == [
        "base",
        "right",
        "base",
    ]
    assert find_cycle({}) is None


def test_the_parsers_see_includes_definitions_and_calls() -> None:
    # a parser that found nothing would pass every test below
    includes, calls = _includes(), _calls()
    assert "spice-store.h" in includes["spice-store-impl.h"]
    assert "spice-store-impl.h" in includes["spice-store.c"]
    assert "spice-store.c" in calls["spice-store-plan.c"]
    assert "spice-runtime.c" in calls["spice-runtime-async.c"]


def test_a_made_up_tree_with_cycles_is_caught(tmp_path: Path) -> None:
    # the shape libspice's runtime had: two files calling each other through one shared
    # header, and a header pair including each other
    (tmp_path / "core.h").write_text('#include "feature.h"\nvoid spice_core_step(void);\n')
    (tmp_path / "feature.h").write_text('#include "core.h"\n')
    (tmp_path / "core.c").write_text(
        '#include "core.h"\n/* spice_feature_run(x) in a comment is no call */\n'
        "void spice_core_step(void) {\n    spice_feature_run();\n}\n"
    )
    (tmp_path / "feature.c").write_text(
        '#include "core.h"\nstatic void helper(void) {}\n'
        "void spice_feature_run(void) {\n    spice_core_step();\n}\n"
    )
    (tmp_path / "lone.c").write_text('void spice_lone(void) {\n    puts("spice_core_step()");\n}\n')
    assert find_cycle(_calls(tmp_path)) == ["core.c", "feature.c", "core.c"]
    assert _calls(tmp_path)["lone.c"] == set()
    assert find_cycle(_includes(tmp_path, tmp_path)) == ["core.h", "feature.h", "core.h"]


def test_no_header_includes_itself_back() -> None:
    assert find_cycle(_includes()) is None


def test_no_source_files_call_each_other_round_in_a_circle() -> None:
    cycle = find_cycle(_calls())
    assert cycle is None, "libspice's files call each other in a circle: " + " -> ".join(cycle or [])


def test_the_plan_validator_sees_no_runtime_internals() -> None:
    includes = _includes()
    assert "spice-runtime-internal.h" not in _reachable(includes, "spice-plan.c")
    assert "spice-runtime-internal.h" in _reachable(includes, "spice-runtime.c")
