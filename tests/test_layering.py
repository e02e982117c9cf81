"""The package's import graph against the layering of ../shared/architecture.md.

The graph is read from the source with `ast` (nothing is imported, no third-party tool): every
`import` / `from ... import` statement (and `importlib.import_module` / `__import__` called with a
literal name) in fuser/, codegen/ (package `fuser.codegen`) and patterns/ (package `fuser.patterns`)
that names a module of the package becomes an edge importer -> imported, with its file:line and
whether it sits at module level or inside a function.

Checked here:
  1. every import of a package module is at module level (none hides inside a function);
  2. the module graph has no cycle;
  3. every module has a layer in LAYERS, and every import points to a lower layer (or to its own
     layer where LAYERS says the layer's modules may import each other);
  4. codegen never imports cost or runtime; runtime never imports patterns (directly or through
     another module, as import-linter's "forbidden" contract counts it).

LAYERS below is the one place the layering is written down: a new module fails
`test_every_module_has_a_layer` until it is placed there.
"""
from __future__ import annotations

import ast
import fnmatch
import functools
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Source folder of each package (as mounted by fuser/__init__.py and pyproject.toml's package-dir).
PACKAGE_DIRS = {"fuser": "fuser", "fuser.codegen": "codegen", "fuser.patterns": "patterns"}

# Layers, top to bottom: (name, module patterns, whether the layer's modules may import each other).
# A module may import modules of any lower layer; it may import a module of its own layer only where
# the third field is True (the architecture groups those modules in one layer, and test_no_cycles
# keeps the imports among them acyclic).  Patterns are fnmatch-style on dotted module names.
LAYERS: list[tuple[str, tuple[str, ...], bool]] = [
    # The package root: mounts codegen/ and patterns/, re-exports the api.
    ("package root", ("fuser",), False),
    # fuse(), FusedModule, Options.  fuser.attention (flash_attention: the attention kernel called
    # directly, for tests, benchmarks and users of the kernel alone) is a public entry point that, like
    # the pipeline, pairs codegen's source with the runtime; nothing in the package imports it.
    ("api", ("fuser.api", "fuser.attention"), False),
    # Dynamo -> AOT Autograd; the decompositions are part of that stage.
    ("backend", ("fuser.backend", "fuser.decompositions", "fuser.pregrad", "fuser.sdpa_calls", "fuser.linear_ce", "fuser.attention_op"), True),
    # fuser::dropout, the op the backend claims dropout as: its eager kernel pairs ops' expression
    # with the runtime; ops.py finds the op by its name, so nothing below imports it.
    ("dropout op", ("fuser.dropout",), False),
    ("pipeline", ("fuser.pipeline",), False),
    # graph passes before the partition; fuser.embedding also holds the function its marked nodes call
    ("fold, padding, epilogue, split, gqa, embedding", ("fuser.fold", "fuser.padding", "fuser.epilogue", "fuser.split",
                                                        "fuser.gqa", "fuser.embedding"), True),
    ("patterns/", ("fuser.patterns", "fuser.patterns.*"), True),
    ("partition", ("fuser.partition",), False),
    ("codegen/", ("fuser.codegen", "fuser.codegen.*"), True),
    ("rewrite", ("fuser.rewrite",), False),
    ("runtime", ("fuser.runtime",), False),
    ("report", ("fuser.report",), False),
    ("cost, plan", ("fuser.cost", "fuser.plan"), True),
    ("region", ("fuser.region",), False),
    ("graph", ("fuser.graph",), False),
    ("ops, dtypes, indexing", ("fuser.ops", "fuser.dtypes", "fuser.indexing"), True),
]

# Imports of package modules allowed inside a function, as {(importer, imported): why}.  None is
# needed: fuser/__init__.py mounts codegen/ and patterns/ with importlib.util.spec_from_file_location
# on file paths (not an import of a module name), which this walk does not count as an import.
FUNCTION_LEVEL_ALLOWED: dict[tuple[str, str], str] = {}

# The architecture's explicit rules: (importer pattern, imported pattern, the rule in words).
FORBIDDEN = [
    ("fuser.codegen*", "fuser.cost", "codegen never calls cost (it receives the Cost)"),
    ("fuser.codegen*", "fuser.runtime", "codegen never imports runtime"),
    ("fuser.runtime", "fuser.patterns*", "runtime never imports patterns"),
]


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    path: str  # relative to the repository root
    line: int
    in_function: bool

    def __str__(self) -> str:
        where = " (inside a function)" if self.in_function else ""
        return f"{self.path}:{self.line}: {self.importer} -> {self.imported}{where}"


@dataclass(frozen=True)
class Graph:
    modules: dict[str, Path]  # module name -> source file
    imports: tuple[Import, ...]
    unresolved: tuple[str, ...]  # imports naming a package module that does not exist


def _discover() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGE_DIRS.items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


class _Walker(ast.NodeVisitor):
    def __init__(self, name: str, modules: dict[str, Path]):
        self.name = name
        self.modules = modules
        self.rel = modules[name].relative_to(ROOT).as_posix()
        self.package = name if _is_package(name, modules) else name.rpartition(".")[0]
        self.depth = 0  # function nesting
        self.found: list[Import] = []
        self.unresolved: list[str] = []

    def _add(self, target: str, node: ast.AST) -> None:
        if target == self.name:  # a package's __init__ reading its own names: no edge
            return
        self.found.append(Import(self.name, target, self.rel, node.lineno, self.depth > 0))

    def _add_name(self, dotted: str, node: ast.AST, attrs: tuple[str, ...] = ()) -> None:
        """`import dotted` / `from dotted import attrs`: a submodule named in attrs is the target."""
        if dotted != "fuser" and not dotted.startswith("fuser."):
            return
        if dotted not in self.modules:
            self.unresolved.append(f"{self.rel}:{node.lineno}: {self.name} imports {dotted}, which is no module of the package")
            return
        subs = [f"{dotted}.{a}" for a in attrs if f"{dotted}.{a}" in self.modules]
        for sub in subs:
            self._add(sub, node)
        if len(subs) < len(attrs) or not attrs:  # some names are attributes of the module itself
            self._add(dotted, node)

    def visit_FunctionDef(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_Import(self, node: ast.Import):
        for alias in node.names:
            self._add_name(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom):
        if node.level:
            parts = self.package.split(".")
            if node.level - 1 >= len(parts):
                self.unresolved.append(f"{self.rel}:{node.lineno}: relative import beyond the top package")
                return
            base = ".".join(parts[: len(parts) - (node.level - 1)])
            dotted = f"{base}.{node.module}" if node.module else base
        else:
            dotted = node.module
        self._add_name(dotted, node, tuple(a.name for a in node.names if a.name != "*"))

    def visit_Call(self, node: ast.Call):
        # importlib.import_module("fuser.x") / __import__("fuser.x"): an import all the same.
        func = node.func
        fname = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if fname in ("import_module", "__import__") and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                self._add_name(arg.value, node)
        self.generic_visit(node)


@functools.lru_cache(maxsize=None)
def graph() -> Graph:
    modules = _discover()
    imports, unresolved = [], []
    for name, path in modules.items():
        walker = _Walker(name, modules)
        walker.visit(ast.parse(path.read_text(), filename=str(path)))
        imports += walker.found
        unresolved += walker.unresolved
    return Graph(modules, tuple(imports), tuple(unresolved))


def layer_of(module: str) -> list[int]:
    return [i for i, (_, pats, _) in enumerate(LAYERS) if any(fnmatch.fnmatchcase(module, p) for p in pats)]


def _fail(title: str, lines: list[str]) -> None:
    pytest.fail(f"{title} ({len(lines)}):\n  " + "\n  ".join(lines), pytrace=False)


# --------------------------------------------------------------------------------------------------


def test_package_dirs_match_pyproject():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["tool"]["setuptools"]["package-dir"] == PACKAGE_DIRS


def test_the_graph_is_read():
    g = graph()
    assert {"fuser", "fuser.api", "fuser.codegen", "fuser.patterns"} <= set(g.modules)
    assert any(i.importer == "fuser" and i.imported == "fuser.api" for i in g.imports), "fuser/__init__.py imports api"
    if g.unresolved:
        _fail("imports of package modules that do not exist", list(g.unresolved))


def test_every_module_has_a_layer():
    g = graph()
    problems = []
    for module in sorted(g.modules):
        found = layer_of(module)
        if not found:
            problems.append(f"{module} ({g.modules[module].relative_to(ROOT)}) has no layer: place it in LAYERS in tests/test_layering.py")
        elif len(found) > 1:
            problems.append(f"{module} matches several layers: {[LAYERS[i][0] for i in found]}")
    for name, pats, _ in LAYERS:
        for p in pats:
            if not any(fnmatch.fnmatchcase(m, p) for m in g.modules):
                problems.append(f"LAYERS entry {p!r} (layer {name!r}) matches no module: rename or remove it")
    if problems:
        _fail("LAYERS does not describe the package's modules", problems)


def test_no_import_inside_a_function():
    bad = [
        str(i) for i in graph().imports
        if i.in_function and (i.importer, i.imported) not in FUNCTION_LEVEL_ALLOWED
    ]
    if bad:
        _fail("imports of package modules inside a function (move them to module level; if that makes a cycle, "
              "the layering is wrong)", bad)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (or a self-import), via Tarjan."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _path(edges: dict[str, set[str]], start: str, goal: str, within: set[str] | None = None) -> list[str] | None:
    """A shortest path start -> ... -> goal (BFS), optionally within a set of modules."""
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges.get(v, ())):
                if within is not None and w not in within:
                    continue
                if w == goal:
                    path = [w, v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return path[::-1]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return None


def _edges(imports) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for i in imports:
        edges.setdefault(i.importer, set()).add(i.imported)
    return edges


def _hops(path: list[str]) -> list[str]:
    first = {}
    for i in graph().imports:
        first.setdefault((i.importer, i.imported), i)
    return [str(first[a, b]) for a, b in zip(path, path[1:])]


def test_no_cycles():
    # Every import counts, module level or not: an import inside a function still closes a cycle.
    edges = _edges(graph().imports)
    problems = []
    for comp in _cycles(edges):
        start = comp[0]
        cycle = _path(edges, start, start, within=set(comp))
        problems.append(f"cycle {' -> '.join(cycle)}:\n    " + "\n    ".join(_hops(cycle)))
    if problems:
        _fail("import cycles", problems)


def test_imports_point_down():
    problems = []
    for i in graph().imports:
        a, b = layer_of(i.importer), layer_of(i.imported)
        if len(a) != 1 or len(b) != 1 or i.importer == i.imported:
            continue  # unplaced modules fail test_every_module_has_a_layer
        (a,), (b,) = a, b
        if b > a:
            continue
        if b == a and LAYERS[a][2]:
            continue
        why = ("imports a higher layer" if b < a else "imports a module of its own layer, whose modules do not import each other")
        problems.append(f"{i}: layer {LAYERS[a][0]!r} {why} ({LAYERS[b][0]!r})")
    if problems:
        _fail("imports against the layering (each layer imports only from layers below it)", problems)


@pytest.mark.parametrize("importer, imported, rule", FORBIDDEN, ids=[r for _, _, r in FORBIDDEN])
def test_forbidden_imports(importer, imported, rule):
    g = graph()
    edges = _edges(g.imports)
    problems = []
    for src in sorted(m for m in g.modules if fnmatch.fnmatchcase(m, importer)):
        for dst in sorted(m for m in g.modules if fnmatch.fnmatchcase(m, imported)):
            path = _path(edges, src, dst)
            if path:
                kind = "imports" if len(path) == 2 else "imports, through " + ", ".join(path[1:-1]) + ","
                problems.append(f"{src} {kind} {dst}:\n    " + "\n    ".join(_hops(path)))
    if problems:
        _fail(f"{rule}", problems)
