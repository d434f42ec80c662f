"""The layer rule of ``docs/architecture.md``, enforced over every import of the package.

An AST pass over every module of ``ckpt_integration`` (imports at the top level and inside
functions alike) fails when

* a module imports from a higher layer, or imports the package root (which re-exports the
  public API and sits above every layer);
* a module has no place in :data:`LAYERS` (a new module must be placed, and documented);
* two or more modules import each other, directly or around a circle;
* a package-internal import sits inside a function without an entry in :data:`LAZY` saying why
  (a lazy import hides a dependency from the reader, and is how circles stay invisible);
* a module uses another module's underscore (private) name.

Edges are the modules named by the import statements: ``from .x import y`` is an edge to ``x``
(or to ``x.y`` when that is a module); the implicit import of parent packages is not counted.
"""

from __future__ import annotations

import ast
import os
import pathlib
import sys
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "ckpt_integration"

#: module (or package prefix; the longest match decides) -> layer. Why each sits where it does:
#: docs/architecture.md, which must name every entry.
LAYERS: Dict[str, int] = {
    # 1 mapping: the data model - pure, imports nothing of the package above it
    "ckpt_integration.errors": 1,
    "ckpt_integration.version": 1,
    "ckpt_integration.dict_utils": 1,
    "ckpt_integration.flat_ranges": 1,
    "ckpt_integration.mapping": 1,
    "ckpt_integration.foreign": 1,
    "ckpt_integration.utils": 1,
    "ckpt_integration.modules": 1,
    "ckpt_integration.dtensors": 1,
    # 2 planning: pure functions over metadata
    "ckpt_integration.planning": 2,
    "ckpt_integration.memory.plan": 2,
    "ckpt_integration.validation": 2,
    # 3 storage: formats, files, filesystems, checksums
    "ckpt_integration.storage": 3,
    "ckpt_integration.strategies": 3,
    "ckpt_integration.core": 3,
    "ckpt_integration.checkpoints": 3,
    "ckpt_integration.memory.slots": 3,
    # 4 execution: collectives, threads, staging, async, commit - and the entry points running them
    "ckpt_integration.execution": 4,
    "ckpt_integration.serialization": 4,
    "ckpt_integration.memory": 4,
    "ckpt_integration.optimizer": 4,
    # 5 integrations
    "ckpt_integration.lightning": 5,
    "ckpt_integration.hydra_config": 5,
    "ckpt_integration.tools": 5,
    "ckpt_integration.cli": 5,
    "ckpt_integration.dcp": 5,
}

#: (importer, imported) -> why that import must stay inside a function
LAZY: Dict[Tuple[str, str], str] = {}


def _modules() -> Dict[str, pathlib.Path]:
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def layer_of(module: str) -> Optional[int]:
    best = None
    for prefix, layer in LAYERS.items():
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, layer)
    return None if best is None else best[1]


def _imports(module: str, path: pathlib.Path) -> Iterator[Tuple[str, int, bool]]:
    """``(imported module, line, inside a function)`` for every package-internal import of ``module``."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]

    def visit(node: ast.AST, in_function: bool) -> Iterator[Tuple[str, int, bool]]:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package[: len(package) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                if target == PACKAGE or target.startswith(PACKAGE + "."):
                    for alias in child.names:
                        sub = f"{target}.{alias.name}"
                        yield (sub if sub in MODULES else target), child.lineno, in_function
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                        yield alias.name, child.lineno, in_function
            yield from visit(child, nested)

    yield from visit(ast.parse(path.read_text()), False)


EDGES: List[Tuple[str, str, int, bool]] = [
    (m, target, line, lazy) for m, path in MODULES.items() for target, line, lazy in _imports(m, path)
]


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in MODULES if m != PACKAGE and layer_of(m) is None)
    assert not unplaced, f"place these modules in LAYERS (tests/test_layers.py) and docs/architecture.md: {unplaced}"


def test_no_module_imports_from_a_higher_layer():
    bad = []
    for src, dst, line, _ in EDGES:
        if src == PACKAGE:
            continue  # the root re-exports every layer's public names
        if dst == PACKAGE:
            bad.append(f"{src}:{line} imports the package root (import from the module that defines the name)")
        elif layer_of(dst) > layer_of(src):
            bad.append(f"{src}:{line} (layer {layer_of(src)}) imports {dst} (layer {layer_of(dst)})")
    assert not bad, "imports from a higher layer:\n" + "\n".join(bad)


def test_imports_inside_functions_are_listed_with_a_reason():
    found = {(src, dst) for src, dst, _, lazy in EDGES if lazy}
    unlisted = sorted(f"{src}:{line} imports {dst}" for src, dst, line, lazy in EDGES if lazy and (src, dst) not in LAZY)
    assert not unlisted, ("package imports inside functions: move them to the top of the module, or list them in "
                          "LAZY with the reason they must stay lazy:\n" + "\n".join(unlisted))
    stale = sorted(set(LAZY) - found)
    assert not stale, f"LAZY entries without such an import any more: {stale}"


def _private_uses(module: str, path: pathlib.Path) -> Iterator[str]:
    """``from .x import _name`` and ``x._name`` (``x`` a module of the package) in ``module``."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    tree = ast.parse(path.read_text())
    aliases: Dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            target = ".".join(package[: len(package) - (node.level - 1)] + ([node.module] if node.module else []))
            for alias in node.names:
                if f"{target}.{alias.name}" in MODULES:
                    aliases[alias.asname or alias.name] = f"{target}.{alias.name}"
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    yield f"{module}:{node.lineno} imports {target}.{alias.name}"
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            yield f"{module}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}"


def test_no_private_names_across_modules():
    """A name another module uses is part of its module's interface: public (no underscore)."""
    found = sorted(use for m, path in MODULES.items() for use in _private_uses(m, path))
    assert not found, "underscore names used across modules (make them public, or move them):\n" + "\n".join(found)


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_import_cycles():
    graph: Dict[str, Set[str]] = {}
    for src, dst, _, _ in EDGES:
        graph.setdefault(src, set()).add(dst)
    cycles = _cycles(graph)
    assert not cycles, "modules that import each other (around a circle):\n" + "\n".join(map(" <-> ".join, cycles))


def _doc_name(prefix: str) -> str:
    """How docs/architecture.md names a LAYERS entry: ``storage/`` for a package, ``memory/plan.py`` for a module."""
    path = prefix[len(PACKAGE) + 1:].replace(".", "/")
    return f"`{path}/`" if (ROOT / PACKAGE / path).is_dir() else f"`{path}.py`"


def test_architecture_page_places_every_entry():
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = [_doc_name(prefix) for prefix in LAYERS if f"| {_doc_name(prefix)} |" not in page]
    assert not missing, f"docs/architecture.md has no table row for: {missing}"


MADE_UP = {  # a violation of each kind, to show each check fails on it
    "higher": [("ckpt_integration.mapping", "ckpt_integration.serialization", 1, False)],
    "root": [("ckpt_integration.storage.claim", "ckpt_integration", 1, False)],
    "cycle": [("ckpt_integration.planning.boxes", "ckpt_integration.planning.shards", 1, False),
              ("ckpt_integration.planning.shards", "ckpt_integration.planning.boxes", 1, False)],
    "lazy": [("ckpt_integration.tools.convert", "ckpt_integration.tools.writers", 1, True)],
}


@pytest.mark.parametrize("case", ["higher", "root", "cycle", "lazy", "unplaced"])
def test_the_checks_catch_what_they_are_for(case, monkeypatch):
    """So that a green run means the rule holds: each check fails on a made-up violation."""
    check = {
        "higher": test_no_module_imports_from_a_higher_layer,
        "root": test_no_module_imports_from_a_higher_layer,
        "cycle": test_no_import_cycles,
        "lazy": test_imports_inside_functions_are_listed_with_a_reason,
        "unplaced": test_every_module_has_a_layer,
    }[case]
    if case == "unplaced":
        monkeypatch.setitem(MODULES, "ckpt_integration.newcomer", pathlib.Path(os.devnull))
    else:
        monkeypatch.setattr(sys.modules[__name__], "EDGES", EDGES + MADE_UP[case])
    with pytest.raises(AssertionError):
        check()
