"""The import graph of ``elastor_mcore``, read with ``ast`` (nothing is imported).

Packages are layered; a module may import its own package and any package below it,
never one above. The order is the module table of ``docs/architecture.md``. Within a
package, modules import each other without cycles as well.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "elastor_mcore"

LAYERS = [
    "cli",
    "elastic",
    "integrations",
    "convert",
    "runtime",
    "data",
    "planner",
    "checkpoint",
    "parallel",
    "geometry",
    "config",
    "compat",
]
"""Top to bottom: each entry may import only itself and the entries after it."""


@dataclass(frozen=True)
class Import:
    """One import statement's target as seen from ``path`` (line ``line``)."""

    path: Path
    line: int
    module: str
    names: tuple[str, ...]

    def where(self) -> str:
        names = f" ({', '.join(self.names)})" if self.names else ""
        return f"{self.path.relative_to(ROOT)}:{self.line} imports {self.module}{names}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


MODULES = modules()


def resolve(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package.pop()
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(path: Path) -> list[Import]:
    """Every import in the file, at module level or inside functions alike."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [Import(path, node.lineno, a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = resolve(path, node)
            found.append(Import(path, node.lineno, module, tuple(a.name for a in node.names)))
    return found


ALL_IMPORTS = {name: imports_of(path) for name, path in MODULES.items()}


def layer_of(module: str) -> str | None:
    """The layer of one of our modules (``None`` for the package root and others)."""
    parts = module.split(".")
    if parts[0] != PACKAGE or len(parts) < 2:
        return None
    return parts[1]


def targets(imp: Import) -> list[str]:
    """Our modules an import reaches: ``from pkg import mod`` reaches ``pkg.mod``."""
    if imp.module.split(".")[0] != PACKAGE:
        return []
    reached = [imp.module]
    reached += [f"{imp.module}.{n}" for n in imp.names if f"{imp.module}.{n}" in MODULES]
    return reached


def test_every_package_is_in_a_layer():
    unknown = sorted({layer_of(m) for m in MODULES} - set(LAYERS) - {None})
    assert not unknown, f"packages missing from LAYERS: {unknown}"


ROOT_IMPORTS = {f"{PACKAGE}.compat", f"{PACKAGE}.compat.deferred_compile"}
"""What the package root may import: the import hook it installs (stdlib only)."""


def test_imports_flow_downward():
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    bad = []
    for module, found in ALL_IMPORTS.items():
        mine = layer_of(module)
        for imp in found:
            for target in targets(imp):
                theirs = layer_of(target)
                if mine is None:
                    if target not in ROOT_IMPORTS:
                        bad.append(f"{imp.where()}: the package root imports only "
                                   f"{sorted(ROOT_IMPORTS)} of ours")
                elif theirs is not None and rank[theirs] < rank[mine]:
                    bad.append(f"{imp.where()}: {mine} may not import {theirs} (above it)")
    assert not bad, "upward imports:\n" + "\n".join(sorted(set(bad)))


def test_no_private_names_of_other_modules():
    bad = []
    for module, found in ALL_IMPORTS.items():
        for imp in found:
            if imp.module.split(".")[0] != PACKAGE or imp.module == module:
                continue
            private = [n for n in imp.names if n.startswith("_") and not n.startswith("__")]
            if any(part.startswith("_") and not part.startswith("__")
                   for part in imp.module.split(".")):
                private.append(imp.module)
            if private:
                bad.append(f"{imp.where()}: private {', '.join(private)}")
    for module, path in MODULES.items():
        bad += private_attributes(module, path)
    assert not bad, "private names used across modules:\n" + "\n".join(sorted(bad))


def private_attributes(module: str, path: Path) -> list[str]:
    """``mod._name`` where ``mod`` is bound to another of our modules."""
    tree = ast.parse(path.read_text(), str(path))
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(PACKAGE + ".") and a.asname:
                    bound[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            base = resolve(path, node)
            for a in node.names:
                if f"{base}.{a.name}" in MODULES:
                    bound[a.asname or a.name] = f"{base}.{a.name}"
    bad = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and bound[node.value.id] != module
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno} uses "
                       f"{bound[node.value.id]}.{node.attr}")
    return bad


def test_no_cycles_between_packages():
    edges: dict[str, set[str]] = {layer: set() for layer in LAYERS}
    why: dict[tuple[str, str], str] = {}
    for module, found in ALL_IMPORTS.items():
        mine = layer_of(module)
        for imp in found:
            for target in targets(imp):
                theirs = layer_of(target)
                if mine and theirs and theirs != mine:
                    edges[mine].add(theirs)
                    why.setdefault((mine, theirs), imp.where())
    cycles = []
    for start in LAYERS:
        stack = [(start, [start])]
        while stack:
            node, trail = stack.pop()
            for nxt in sorted(edges[node]):
                if nxt == start:
                    cycles.append(" -> ".join(trail + [start]) + "\n  " + "\n  ".join(
                        why[(a, b)] for a, b in zip(trail, trail[1:] + [start])))
                elif nxt not in trail and nxt > start:
                    stack.append((nxt, trail + [nxt]))
    assert not cycles, "import cycles between packages:\n" + "\n".join(cycles)


def module_edges() -> dict[str, dict[str, str]]:
    """Module -> the modules of ours it imports -> where (function-level imports
    included). ``from pkg import mod`` reaches ``pkg.mod``, and ``pkg`` itself only if
    it also imports a name defined there: a package's ``__init__`` runs for every
    module inside it anyway, so that is no edge."""
    edges: dict[str, dict[str, str]] = {module: {} for module in MODULES}
    for module, found in ALL_IMPORTS.items():
        for imp in found:
            reached = targets(imp)
            if imp.names and len(reached) == len(imp.names) + 1:  # submodules only
                reached = reached[1:]
            for target in reached:
                if target in MODULES and target != module:
                    edges[module].setdefault(target, imp.where())
    return edges


def strongly_connected(edges: dict[str, dict[str, str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of the graph ``edges``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return components


def test_no_cycles_between_modules():
    edges = module_edges()
    cycles = []
    for component in strongly_connected(edges):
        if len(component) > 1:
            members = set(component)
            cycles.append(" <-> ".join(component) + "\n  " + "\n  ".join(
                where for module in component for target, where in sorted(edges[module].items())
                if target in members))
    assert not cycles, "import cycles between modules:\n" + "\n".join(cycles)


PARALLEL_STATE_WRITERS = {
    "install_parallel_state": {f"{PACKAGE}.compat.mcore", f"{PACKAGE}.parallel.groups"},
    "destroy_model_parallel": set(),
}
"""Names that change mcore's ``parallel_state`` -> the modules that may use them:
``compat.mcore`` writes the globals, ``parallel.groups.install`` is its one caller."""


def test_one_writer_of_parallel_state():
    bad = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            used = (node.id if isinstance(node, ast.Name) else node.attr
                    if isinstance(node, ast.Attribute) else None)
            if isinstance(node, ast.alias):
                used = node.name
            if used in PARALLEL_STATE_WRITERS and module not in PARALLEL_STATE_WRITERS[used]:
                bad.append(f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')} uses "
                           f"{used}")
    assert not bad, ("only parallel.groups.install changes mcore's parallel_state:\n"
                     + "\n".join(sorted(bad)))


RANK_SIDE = f"{PACKAGE}.elastic.rank"
"""The part of ``elastic/`` that runs inside torchrun's rank processes."""
PROTOCOL = f"{PACKAGE}.elastic.protocol"
"""The supervisor-rank file protocol: a leaf both sides import."""


def supervisor_side(module: str) -> bool:
    return layer_of(module) == "elastic" and not (module == RANK_SIDE
                                                   or module.startswith(RANK_SIDE + "."))


def test_the_supervisor_side_never_imports_torch_distributed():
    bad = []
    for module, found in ALL_IMPORTS.items():
        if not supervisor_side(module):
            continue
        for imp in found:
            if (imp.module == "torch.distributed" or imp.module.startswith("torch.distributed.")
                    or (imp.module == "torch" and "distributed" in imp.names)):
                bad.append(imp.where())
    assert not bad, "elastic/ (outside elastic/rank/) imports torch.distributed:\n" + \
        "\n".join(bad)


def test_the_supervisor_side_never_imports_the_rank_side():
    """It starts the rank side's modules by name (torchrun ``-m``), so that the
    supervisor process never loads what ranks load."""
    bad = [f"{imp.where()}" for module, found in ALL_IMPORTS.items() if supervisor_side(module)
           for imp in found for target in targets(imp)
           if target == RANK_SIDE or target.startswith(RANK_SIDE + ".")]
    assert not bad, "the supervisor side imports elastic/rank/:\n" + "\n".join(bad)


def test_the_file_protocol_is_a_leaf():
    ours = [imp.where() for imp in ALL_IMPORTS[PROTOCOL] if targets(imp)]
    assert not ours, f"{PROTOCOL} must import nothing of ours:\n" + "\n".join(ours)
