"""The layout rules of issue 19 ("one home per role"), read off the source with `ast`:
nothing of leangrpo is imported, so the test is fast and cannot be
fooled by what an import happens to leave in a namespace.

Rules a-e, over every module under src/leangrpo:
- a (homes): a leangrpo name is imported from the module that defines it, never through
  a module that imported it (a re-export chain); a facade package's `__init__` (a module
  `__getattr__` plus `TYPE_CHECKING` imports saying where each `__all__` name lives) counts
  as defining its facade names. Dotted paths written as strings (`python -m` targets,
  vLLM's worker extension) name a module or a name their module defines.
- b (facades): outside a facade package its facade names come from the facade; inside it,
  from their defining modules; `__all__`, the `TYPE_CHECKING` imports and `_HOMES` agree.
- c (cycles): no import cycle through module-level imports, none through
  function-level imports either (a deferred import is still a dependency: two modules
  that need each other belong in one role, or one name moves to the module that owns
  it), and none once `TYPE_CHECKING` imports count too (a name used only in annotations
  is still one module naming another's types: the lowest floor, contracts.py and
  errors.py, names no higher role's). Importing a package runs its `__init__` first, and
  `from facade import name` imports the name's module right then; for the annotation
  graph a facade imported by name stands for every module it declares (its
  `TYPE_CHECKING` imports), while a facade package that is only the parent of an imported
  submodule adds nothing (its declarations are not a dependency of its submodules).
- d (re-export lines): no module-level import marked `noqa: F401`, no `__all__` entry that
  the module imports rather than defines.
- e (prefixed siblings): no `x_y.py` next to `x.py` or `x_z.py` (the before-stop hook's
  check) or the package `x/`: a role that outgrew one module becomes a package.
- f (paths in prose): every `dir/x.py`, `x.py` and `leangrpo.a.b` written in README, docs,
  benchmarks, scripts, examples and the sources exists, so moves leave no stale pointer.
- g (one code path): the trainer and the step never ask a context whether the run is
  distributed (`ctx.distributed`); what differs is behind the `Strategy`.
- h (the docs map): every relative link of a Markdown file reaches a file and, with an
  `#anchor`, one of its headings; every `dir/x.md` written in prose exists; every
  `docs/page.md ("Title")` citation (in documents, docstrings, comments and the config's
  descriptions, through docs/config.md), and every `[page.md](page.md) ("Title")` between
  pages, names text that page holds; docs/ARCHITECTURE.md
  stays a map under 250 lines, and every page under docs/ is linked from it or README.md.

Each rule is a function from the parsed tree to failure lines ("path:line: what; fix"),
run on the repository and, on small trees written to tmp_path, shown to fail.
See docs/modules.md ("Layout rules").

Besides the rules: `make test` runs every test file that holds vLLM tests (the Makefile
lists them in VLLM_FILES, the vLLM suite's files: docs/testing.md ("How make test runs")).
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "leangrpo"
NOQA_F401 = re.compile(r"#\s*noqa\s*:[\w\s,]*\bF401\b")
Graph = dict[str, dict[str, "Import"]]  # importer -> {imported module: first statement}


@dataclass(frozen=True)
class Import:
    """One imported name (`name` None for `import a.b`) as its statement sits in a module."""

    importer: str
    line: int
    source: str  # the absolute module the statement names
    name: str | None
    level: str  # "module", "function" or "type_checking"
    bound: str | None = None  # the name the statement binds (`as` included)
    noqa_f401: bool = False


@dataclass
class Module:
    name: str
    rel: str  # its path under src/, as failures show it
    is_package: bool
    defined: set[str] = field(default_factory=set)  # bound at module level, not by imports
    imported: set[str] = field(default_factory=set)  # bound at module level by imports
    imports: list[Import] = field(default_factory=list)
    all_names: list[tuple[str, int]] = field(default_factory=list)  # `__all__`, with lines
    has_getattr: bool = False
    homes: dict[str, str] | None = None  # a facade's `_HOMES`, when written as a literal
    type_checking_homes: dict[str, str] = field(default_factory=dict)  # name -> module
    dotted_strings: list[tuple[str, int]] = field(default_factory=list)

    @property
    def is_facade(self) -> bool:
        return self.is_package and self.has_getattr

    @property
    def facade(self) -> dict[str, str]:
        """Facade name -> defining module, for a lazy package facade; {} otherwise."""
        if not self.is_facade:
            return {}
        homes = self.type_checking_homes
        return {name: homes[name] for name, _ in self.all_names if name in homes}

    def where(self, line: int) -> str:
        return f"{self.rel}:{line}"


Modules = dict[str, Module]


# ---------------------------------------------------------------- reading the tree


def load_modules(src: Path, package: str = PACKAGE) -> Modules:
    modules = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        module = Module(name, str(path.relative_to(src)), is_package)
        text = path.read_text()
        _Reader(module, text.splitlines()).visit(ast.parse(text, str(path)))
        modules[name] = module
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Attribute):
        return test.attr == "TYPE_CHECKING"
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"


def _targets(node: ast.Assign, name: str) -> bool:
    return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)


def _string_list(node: ast.expr) -> list[tuple[str, int]] | None:
    if not isinstance(node, (ast.List, ast.Tuple)):
        return None
    items = [(e.value, e.lineno) for e in node.elts if isinstance(e, ast.Constant)]
    return [(v, line) for v, line in items if isinstance(v, str)]


def _homes_literal(node: ast.expr) -> dict[str, str] | None:
    """`{"Name": "module", **dict.fromkeys([...], "module")}` read without evaluating it."""
    if not isinstance(node, ast.Dict):
        return None
    homes: dict[str, str] = {}
    for key, value in zip(node.keys, node.values):
        if isinstance(key, ast.Constant) and isinstance(value, ast.Constant):
            homes[key.value] = value.value
        elif key is None and isinstance(value, ast.Call) and len(value.args) == 2:
            names, home = _string_list(value.args[0]), value.args[1]
            if names is None or not isinstance(home, ast.Constant):
                return None
            homes.update(dict.fromkeys([n for n, _ in names], home.value))
        else:
            return None
    return homes


class _Reader(ast.NodeVisitor):
    """Collects a module's top-level definitions, its imports with the level each runs at,
    its `__all__`, a facade's `_HOMES` and the dotted paths it writes as strings."""

    def __init__(self, module: Module, lines: list[str]) -> None:
        self.module, self.lines = module, lines
        self.root = module.name.split(".")[0]
        self.level = "module"
        self.depth = 0  # function and class nesting: names bound there are not the module's

    def _bind(self, name: str) -> None:
        if self.depth == 0:
            self.module.defined.add(name)

    def _package(self, level: int) -> str:
        parts = self.module.name.split(".")
        if not self.module.is_package:
            parts = parts[:-1]
        return ".".join(parts[: len(parts) - level + 1])

    def _add(self, node: ast.AST, source: str, name: str | None, bound: str | None) -> None:
        text = "\n".join(self.lines[node.lineno - 1 : node.end_lineno])
        noqa = bool(NOQA_F401.search(text))
        imp = Import(self.module.name, node.lineno, source, name, self.level, bound, noqa)
        self.module.imports.append(imp)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node, alias.name, None, alias.asname)
            if self.depth == 0 and self.level != "type_checking":
                self.module.imported.add(alias.asname or alias.name.split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        source = node.module or ""
        if node.level:
            base = self._package(node.level)
            source = f"{base}.{source}" if source else base
        for alias in node.names:
            bound = alias.asname or alias.name
            self._add(node, source, alias.name, bound)
            if self.depth == 0 and self.level == "type_checking":
                self.module.type_checking_homes[bound] = source
            elif self.depth == 0:
                self.module.imported.add(bound)

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        outer, self.level = self.level, "type_checking"
        for stmt in node.body:
            self.visit(stmt)
        self.level = outer
        for stmt in node.orelse:
            self.visit(stmt)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        if not isinstance(node, ast.Lambda):
            self._bind(node.name)
            self.module.has_getattr |= self.depth == 0 and node.name == "__getattr__"
            for decorator in node.decorator_list:
                self.visit(decorator)
        outer = self.level
        self.depth += 1
        self.level = "function" if outer == "module" else outer
        for stmt in node.body if isinstance(node.body, list) else [node.body]:
            self.visit(stmt)
        self.depth -= 1
        self.level = outer

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._bind(node.name)
        self.depth += 1  # the body runs at import time (level stays), its names are the class's
        self.generic_visit(node)
        self.depth -= 1

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store):
            self._bind(node.id)

    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        arg = node.args[0] if node.args else None
        if called in ("import_module", "__import__") and isinstance(arg, ast.Constant):
            self._add(node, str(arg.value), None, None)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and re.fullmatch(rf"{self.root}(\.\w+)+", node.value):
            self.module.dotted_strings.append((node.value, node.lineno))

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        if self.depth == 0 and _targets(node, "_HOMES"):
            self.module.homes = _homes_literal(node.value)
        if self.depth == 0 and _targets(node, "__all__"):
            self.module.all_names = _string_list(node.value) or []


# ---------------------------------------------------------------- resolving names


def _root(modules: Modules) -> str:
    return min(modules, key=len)


def _own(modules: Modules, source: str) -> bool:
    """Whether `source` names the tree's root package or something under it."""
    root = _root(modules)
    return source == root or source.startswith(root + ".")


def _in_package(module: str, package: str) -> bool:
    return module.startswith(package + ".")


def _defines(modules: Modules, source: str, name: str) -> bool:
    return name in modules[source].defined or f"{source}.{name}" in modules


def definer(modules: Modules, source: str, name: str, seen: frozenset = frozenset()) -> str | None:
    """The module that defines `name` as reached from `source`, following its imports."""
    module = modules.get(source)
    if module is None or (source, name) in seen:
        return None
    if _defines(modules, source, name):
        return source
    seen |= {(source, name)}
    if name in module.facade:
        return definer(modules, module.facade[name], name, seen)
    for imp in module.imports:
        if imp.level == "module" and imp.bound == name and imp.name and _own(modules, imp.source):
            return definer(modules, imp.source, imp.name, seen)
    return None


def facade_of(modules: Modules, source: str, name: str | None) -> Module | None:
    """The facade package `source`, when `name` is one of its facade names."""
    module = modules.get(source)
    return module if module is not None and name in module.facade else None


# ---------------------------------------------------------------- rule a: homes


def check_homes(modules: Modules) -> list[str]:
    """Every `from leangrpo.x import name` names the module that defines `name`; every
    dotted path written as a string names a module or a name its module defines."""
    failures = []
    for module in modules.values():
        for imp in module.imports:
            if _own(modules, imp.source):
                failures += _home_failures(modules, module, imp)
        for dotted, line in module.dotted_strings:
            head, _, tail = dotted.rpartition(".")
            if dotted not in modules and not (head in modules and _defines(modules, head, tail)):
                failures.append(
                    f"{module.where(line)}: the string {dotted!r} names no module and no name "
                    "its module defines; write the defining module's path"
                )
    return failures


def _home_failures(modules: Modules, module: Module, imp: Import) -> list[str]:
    where = module.where(imp.line)
    source = modules.get(imp.source)
    if source is None:
        what = f"`import {imp.source}`" if imp.name is None else f"imports {imp.name}"
        return [f"{where}: {what} from {imp.source}: no such module"]
    if imp.name == "*":
        return [f"{where}: `from {imp.source} import *`; import each name from its module"]
    if imp.name is None or _defines(modules, imp.source, imp.name) or imp.name in source.facade:
        return []
    home = definer(modules, imp.source, imp.name)
    fix = f"import it from {home}" if home else f"it is defined nowhere in {_root(modules)}"
    return [f"{where}: imports {imp.name} from {imp.source}, which does not define it; {fix}"]


# ---------------------------------------------------------------- rule b: facades


def check_facades(modules: Modules) -> list[str]:
    """Facade names come from the facade outside its package, from their modules inside;
    each facade says, consistently, where each of its names lives."""
    facades = {name: module for name, module in modules.items() if module.is_facade}
    failures = [line for facade in facades.values() for line in _facade_integrity(facade)]
    for module in modules.values():
        for imp in module.imports:
            if imp.name is not None and not (module.is_facade and imp.level == "type_checking"):
                failures += _facade_failures(modules, facades, module, imp)
    return failures


def _facade_failures(modules: Modules, facades: Modules, module: Module, imp: Import) -> list[str]:
    where = module.where(imp.line)
    via = facade_of(modules, imp.source, imp.name)
    if via is not None and _in_package(module.name, via.name):
        return [
            f"{where}: imports {imp.name} from its own package's facade {via.name}; inside "
            f"the package import it from {via.facade[imp.name]}"
        ]
    return [
        f"{where}: imports {imp.name} from {imp.source}; outside {package} import it from "
        f"the facade: `from {package} import {imp.name}`"
        for package, facade in facades.items()
        if facade.facade.get(imp.name) == imp.source
        and not _in_package(module.name, package)
        and module.name != package
    ]


def _facade_integrity(facade: Module) -> list[str]:
    """`__all__`, the `TYPE_CHECKING` imports and `_HOMES` (what `__getattr__` imports) agree."""
    if not facade.all_names:
        return [f"{facade.where(1)}: lazy facade without `__all__`; list its names there"]
    if facade.homes is None:
        return [f"{facade.where(1)}: write `_HOMES` as a dict literal ({{name: module}})"]
    failures = []
    for name, line in facade.all_names:
        where = facade.type_checking_homes.get(name)
        home = f"{facade.name}.{facade.homes.get(name)}"
        if where is None:
            failures.append(
                f"{facade.where(line)}: facade name {name} has no `TYPE_CHECKING` import saying "
                f"where it lives; add `from {facade.name}.<module> import {name}` under it"
            )
        elif home != where:
            failures.append(
                f"{facade.where(line)}: `_HOMES` sends {name} to {home} but the `TYPE_CHECKING` "
                f"import says {where}; make them agree"
            )
    return failures


# ---------------------------------------------------------------- rule c: cycles


def import_graph(modules: Modules, levels: Iterable[str]) -> Graph:
    """What importing each module imports, at the given levels: the named module, the
    submodule a `from package import module` names, a facade name's defining module, and
    the packages above each of them (their `__init__` runs first)."""
    levels = set(levels)
    graph: Graph = {name: {} for name in modules}
    for module in modules.values():
        for imp in module.imports:
            if imp.level in levels and _own(modules, imp.source):
                for target in _imported_modules(modules, imp):
                    graph[module.name].setdefault(target, imp)
    return graph


def _imported_modules(modules: Modules, imp: Import) -> Iterable[str]:
    targets = [imp.source]
    if imp.name is not None and f"{imp.source}.{imp.name}" in modules:
        targets.append(f"{imp.source}.{imp.name}")
    if (facade := facade_of(modules, imp.source, imp.name)) is not None:
        targets.append(facade.facade[imp.name])
    for target in targets:
        parts = target.split(".")
        for k in range(1, len(parts) + 1):
            step = ".".join(parts[:k])
            # the importer's own packages are already running when its import statement runs
            if step in modules and step != imp.importer and not _in_package(imp.importer, step):
                yield step


def cycles(graph: Graph) -> list[list[str]]:
    """One closed path of modules per strongly connected component (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in graph[node]:
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_closed_path(graph, set(c), c[0]) for c in sorted(components)]


def _closed_path(graph: Graph, component: set[str], start: str) -> list[str]:
    """A shortest path start -> ... -> start inside the component (breadth first)."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(set(graph[node]) & component):
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if succ not in parents:
                    parents[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"{start} is in a component without a cycle through it")


def describe_cycle(modules: Modules, graph: Graph, path: list[str]) -> str:
    steps = []
    for a, b in zip(path, path[1:]):
        imp = graph[a][b]
        steps.append(f"{modules[a].where(imp.line)} ({imp.level}) imports {b}")
    return " -> ".join(steps)


def check_cycles(modules: Modules) -> list[str]:
    """The module-level import graph has no cycle."""
    graph = import_graph(modules, ["module"])
    return [
        f"import cycle {' -> '.join(path)}: {describe_cycle(modules, graph, path)}; move what "
        "one of them needs from the other to the module of its role"
        for path in cycles(graph)
    ]


def check_function_level_cycles(modules: Modules) -> list[str]:
    """No cycle either once function-level imports count too (a deferred import hides a
    cycle from import time, not from the design)."""
    graph = import_graph(modules, ["module", "function"])
    return [
        f"import cycle {' -> '.join(path)} through a function-level import: "
        f"{describe_cycle(modules, graph, path)}; move the name one of them needs to the "
        "module that owns it"
        for path in cycles(graph)
    ]


def annotation_graph(modules: Modules) -> Graph:
    """The import graph with every level (module, function, `TYPE_CHECKING`), a facade
    imported by name standing for every module it declares; a facade's own declarations
    count only there (not for whoever imports one of its submodules)."""
    graph: Graph = {name: {} for name in modules}
    for module in modules.values():
        for imp in module.imports:
            if not _own(modules, imp.source) or (module.is_facade and imp.level == "type_checking"):
                continue
            targets = list(_imported_modules(modules, imp))
            facade = modules.get(imp.source)
            named = facade is not None and (imp.name is None or imp.name in facade.facade)
            if named and facade.is_facade and not _in_package(module.name, facade.name):
                targets += facade.facade.values()
            for target in targets:
                if target != module.name:
                    graph[module.name].setdefault(target, imp)
    return graph


def check_annotation_cycles(modules: Modules) -> list[str]:
    """No cycle either once `TYPE_CHECKING` imports count (annotation_graph)."""
    graph = annotation_graph(modules)
    return [
        f"import cycle {' -> '.join(path)} once TYPE_CHECKING imports count: "
        f"{describe_cycle(modules, graph, path)}; move the type one of them names to the "
        "module that owns it"
        for path in cycles(graph)
    ]


# ---------------------------------------------------------------- rules d and e


def check_reexport_lines(modules: Modules) -> list[str]:
    """No `noqa: F401` import at module level, no `__all__` entry the module imports."""
    failures = []
    for module in modules.values():
        for imp in module.imports:
            if imp.noqa_f401 and imp.level == "module":
                what = imp.name or imp.source
                failures.append(
                    f"{module.where(imp.line)}: `noqa: F401` import of {what} at module level "
                    f"(a re-export); delete it, importers take {what} from its defining module"
                )
        for name, line in module.all_names:
            if name in module.imported and name not in module.defined:
                failures.append(
                    f"{module.where(line)}: `__all__` lists {name}, which {module.name} imports "
                    "(a re-export); drop it, importers take it from its defining module"
                )
    return failures


def check_prefixed_siblings(src: Path, package: str = PACKAGE) -> list[str]:
    """No `x_y.py` next to `x.py`, `x/` or `x_z.py`."""
    failures = []
    for path in sorted((src / package).rglob("*.py")):
        stem = path.stem
        if "_" not in stem or stem.startswith("_"):
            continue
        head = stem.split("_")[0]
        modules = [q for q in path.parent.glob("*.py") if q != path]
        packages = [q.parent for q in path.parent.glob("*/__init__.py")]
        clash = [q.name for q in sorted(modules) if q.stem == head or q.stem.startswith(head + "_")]
        clash += [f"{q.name}/" for q in sorted(packages) if q.name == head]
        if clash:
            fix = f"move it into `{head}/`" if f"{head}/" in clash else f"make `{head}/` a package"
            failures.append(
                f"{path.relative_to(src)}:1: prefixed sibling of {', '.join(clash)}; {fix} "
                "with one module per role"
            )
    return failures


# ---------------------------------------------------------------- rule f: paths in prose

DOCUMENTED = ["README.md", "Makefile", "pyproject.toml", ".ci", "docs", "benchmarks", "scripts"]
DOCUMENTED += ["examples", "src"]
TEXT_SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ""}
PATH_MENTION = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.py)\b")
PLACEHOLDER = re.compile(r"^path/to/|(^|/)NAME\.py$|^file\.py$")


def _repo_files(repo: Path, roots: Iterable[str]) -> list[Path]:
    """The files under `roots` that belong to the project: in a git checkout what git tracks
    or would track (not build output such as *.egg-info, runs/ or the venvs)."""
    roots = list(roots)
    if (repo / ".git").exists():
        listed = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "--", *roots],
            cwd=repo, capture_output=True, text=True, check=True,
        ).stdout.splitlines()  # fmt: skip
        return sorted(repo / name for name in listed if (repo / name).is_file())
    found = []
    for root in roots:
        top = repo / root
        for path in [top] if top.is_file() else sorted(top.rglob("*")):
            parts = path.relative_to(repo).parts
            hidden = any(p.startswith(".venv") or p == "__pycache__" for p in parts)
            if path.is_file() and not hidden and not any(p.endswith(".egg-info") for p in parts):
                found.append(path)
    return found


def check_path_mentions(repo: Path, modules: Modules, roots: Iterable[str]) -> list[str]:
    """Every `dir/x.py` or `x.py` a document or docstring names exists (next to the file,
    above it, under src/leangrpo, or anywhere for a bare name), and every `leangrpo.a.b`
    names a module or a name its module defines."""
    basenames = {p.name for p in _repo_files(repo, [*roots, "tests"])}
    package = repo / "src" / _root(modules)
    failures = []
    for path in _repo_files(repo, roots):
        if path.suffix not in TEXT_SUFFIXES or path.name.endswith(".lock"):
            continue
        bases = [path.parent, *[d for d in path.parent.parents if repo in (d, *d.parents)], package]
        for number, line in _prose_lines(path):
            line = re.sub(r"https?://\S+", "", line)
            where = f"{path.relative_to(repo)}:{number}"
            for mention in PATH_MENTION.findall(line):
                if PLACEHOLDER.search(mention):
                    continue
                if "/" in mention and not any((base / mention).exists() for base in bases):
                    failures.append(f"{where}: {mention} does not exist; write the path it has now")
                elif "/" not in mention and mention not in basenames:
                    failures.append(f"{where}: no file is named {mention}; write the one meant")
            for dotted in re.findall(rf"(?<![\w.]){_root(modules)}(?:\.\w+)+", line):
                if not _resolves(modules, dotted):
                    failures.append(
                        f"{where}: {dotted} names no module and no name its module defines; "
                        "write the defining module's path"
                    )
    return failures


def _prose_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of what a reader reads as prose: every line of a document; of a
    Python file its docstrings and comments (string literals in code name whatever the code
    needs, e.g. a file inside another package)."""
    text = path.read_text(errors="ignore")
    lines = text.splitlines()
    if path.suffix != ".py":
        yield from enumerate(lines, 1)
        return
    try:
        tree = ast.parse(text)
    except SyntaxError:
        yield from enumerate(lines, 1)
        return
    prose: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                prose.update(range(value.lineno, (value.end_lineno or value.lineno) + 1))
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            prose.add(token.start[0])
    for number in sorted(prose):
        yield number, lines[number - 1]


def _resolves(modules: Modules, dotted: str) -> bool:
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        head = ".".join(parts[:k])
        if head in modules:
            if k == len(parts) or parts[k].startswith("__"):
                return True
            return _defines(modules, head, parts[k]) or parts[k] in modules[head].facade
    return False


# ---------------------------------------------------------------- rule h: the docs map

DOC_PAGES = "docs"
MAP = "docs/ARCHITECTURE.md"
MAP_LINES = 250
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
MD_MENTION = re.compile(r"(?<![\w./-])((?:[\w.-]+/)+[\w.-]+\.md)\b")
# `[page.md](page.md) ("Title")`, `[page.md](page.md#anchor), "Title"`
LINK_CITATION = re.compile(r"\]\(([\w./-]+\.md)(?:#[\w-]+)?\)((?:[\s,()]*\"[^\"]+\")+)")
MD_PLACEHOLDER = re.compile(r"^(docs/page|dir/x)\.md$")
# `docs/page.md ("Title", "Other")`, `docs/page.md, "Title"`, `docs/page.md, 'Title'`
CITATION = re.compile(r"(?<![\w./-])(docs/[\w.-]+\.md)((?:[\s,()]*\"[^\"]+\"|[\s,(]+'[^'\n]+')*)")


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings (outside code fences)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _joined_prose(path: Path) -> tuple[str, list[int]]:
    """A file's prose as one text (so a citation may wrap), with each line's number."""
    numbered = list(_prose_lines(path))
    return "\n".join(line for _, line in numbered), [number for number, _ in numbered]


def check_doc_links(repo: Path, roots: Iterable[str]) -> list[str]:
    """Every relative link of a Markdown file, and every `dir/x.md` a document or docstring
    names, reaches a file of the repository; a link's `#anchor` is one of its headings; every
    `docs/page.md ("Title")` citation names text the page holds."""
    failures = []
    for path in _repo_files(repo, roots):
        if path.suffix not in TEXT_SUFFIXES or path.name.endswith(".lock"):
            continue
        text, numbers = _joined_prose(path)
        rel = path.relative_to(repo)

        def where(offset: int, text=text, numbers=numbers, rel=rel) -> str:
            return f"{rel}:{numbers[text.count(chr(10), 0, offset)]}"

        if path.suffix == ".md":
            for match in LINK.finditer(text):
                failures += _link_failures(repo, path, match.group(1), where(match.start()))
        bases = [path.parent, *[d for d in path.parent.parents if repo in (d, *d.parents)]]
        for match in MD_MENTION.finditer(text):
            mention = match.group(1)
            if mention.startswith("../") or MD_PLACEHOLDER.search(mention):
                continue  # outside the repository (the workspace's notes), or an example
            if not any((base / mention).exists() for base in bases):
                failures.append(
                    f"{where(match.start())}: {mention} does not exist; write its path now"
                )
        for match in CITATION.finditer(text):
            if not MD_PLACEHOLDER.search(match.group(1)):
                page, titles = repo / match.group(1), match.group(2)
                failures += _citation_failures(page, match.group(1), titles, where(match.start()))
        for match in LINK_CITATION.finditer(text) if path.suffix == ".md" else []:
            page, titles = path.parent / match.group(1), match.group(2)
            failures += _citation_failures(page, match.group(1), titles, where(match.start()))
    return failures


def _link_failures(repo: Path, path: Path, target: str, where: str) -> list[str]:
    if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
        return []
    name, _, anchor = target.partition("#")
    linked = (path.parent / name).resolve() if name else path
    if not linked.is_relative_to(repo.resolve()) or not linked.exists():
        return [f"{where}: the link {target} reaches no file; link the page that exists now"]
    if anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked.read_text()):
        return [
            f"{where}: the link {target} names no heading of {name or path.name}; link a heading it has"
        ]
    return []


def _citation_failures(page: Path, label: str, titles: str, where: str) -> list[str]:
    if not page.is_file():
        return []  # named above, as a path or a link that reaches no file
    held = " ".join(page.read_text().split())
    failures = []
    for double, single in re.findall(r"\"([^\"]+)\"|'([^']+)'", titles):
        title = " ".join((double or single).split())
        if title not in held:
            failures.append(
                f'{where}: {label} holds no "{title}"; cite the page and title that hold it now'
            )
    return failures


def check_docs_map(repo: Path, limit: int = MAP_LINES) -> list[str]:
    """ARCHITECTURE.md stays a map of at most `limit` lines, and every page under docs/ is
    linked from it or from README.md, so no page is out of a reader's reach."""
    failures = []
    lines = len((repo / MAP).read_text().splitlines())
    if lines > limit:
        failures.append(
            f"{MAP}: {lines} lines; keep the map under {limit} and move the detail to a page of "
            "its own under docs/"
        )
    linked = set()
    for source in [repo / MAP, repo / "README.md"]:
        for target in LINK.findall(source.read_text()) if source.exists() else []:
            linked.add((source.parent / target.partition("#")[0]).resolve())
    for page in sorted((repo / DOC_PAGES).glob("*.md")):
        if page.resolve() not in linked and page != repo / MAP:
            failures.append(
                f"{page.relative_to(repo)}: linked from neither {MAP} nor README.md; add it to the "
                "map's table of pages"
            )
    return failures


# ---------------------------------------------------------------- rule g: one code path

ONE_CODE_PATH = ["leangrpo/train/trainer.py", "leangrpo/train/step.py"]


def distributed_branches(src: Path, rels: Iterable[str]) -> list[str]:
    """Reads of a context's `distributed` flag (`ctx.distributed`, `self.ctx.distributed`)."""
    failures = []
    for rel in rels:
        for node in ast.walk(ast.parse((src / rel).read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr == "distributed"):
                continue
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name == "ctx":
                failures.append(
                    f"{rel}:{node.lineno}: reads ctx.distributed; put what differs between one "
                    "process and torchrun behind the Strategy (contracts.Strategy)"
                )
    return failures


# ---------------------------------------------------------------- the repository


@pytest.fixture(scope="module")
def modules() -> Modules:
    found = load_modules(SRC)
    assert len(found) > 50 and "leangrpo.train.trainer" in found, sorted(found)
    return found


def _report(failures: list[str]) -> str:
    return "\n" + "\n".join(failures)


def test_names_are_imported_from_their_home(modules):
    assert not (failures := check_homes(modules)), _report(failures)


def test_facade_names_come_through_the_facade_from_outside_only(modules):
    facades = {m.name for m in modules.values() if m.facade}
    assert facades >= {"leangrpo.config", "leangrpo.train", "leangrpo.rewards"}
    assert not (failures := check_facades(modules)), _report(failures)


def test_no_module_level_import_cycle(modules):
    assert not (failures := check_cycles(modules)), _report(failures)


def test_no_import_cycle_through_function_level_imports(modules):
    assert not (failures := check_function_level_cycles(modules)), _report(failures)


def test_no_import_cycle_once_type_checking_imports_count(modules):
    assert not (failures := check_annotation_cycles(modules)), _report(failures)


def test_the_lowest_floor_imports_nothing_of_leangrpo(modules):
    """contracts.py and errors.py are what every role builds on: they name no other
    module's types or functions, at any level (a type they need is declared in them)."""
    floor = [modules[f"{PACKAGE}.contracts"], modules[f"{PACKAGE}.errors"]]
    lines = [f"{m.where(i.line)} ({i.level}) imports {i.source}"
             for m in floor for i in m.imports if _own(modules, i.source)]  # fmt: skip
    assert not lines, _report(list(dict.fromkeys(lines)))


# Found in the packages the other issue-19 worktree restructures (wt/train: checkpoint/);
# the coordinator empties this set when merging it. An entry that no longer fails fails.
def test_no_reexport_lines(modules):
    assert not (failures := check_reexport_lines(modules)), _report(failures)


def test_no_prefixed_sibling_modules():
    assert not (failures := check_prefixed_siblings(SRC)), _report(failures)


def test_the_trainer_has_one_code_path_for_one_process_and_torchrun():
    assert not (failures := distributed_branches(SRC, ONE_CODE_PATH)), _report(failures)


def test_paths_written_in_docs_and_docstrings_exist(modules):
    failures = check_path_mentions(SRC.parent, modules, DOCUMENTED)
    assert not failures, _report(failures)


def test_links_and_section_citations_in_docs_and_docstrings_hold():
    failures = check_doc_links(SRC.parent, [*DOCUMENTED, "tests"])
    assert not failures, _report(failures)


def test_the_architecture_map_is_short_and_links_every_page():
    failures = check_docs_map(SRC.parent)
    assert not failures, _report(failures)


# ---------------------------------------------------------------- each rule can fail

FACADE = """
from typing import TYPE_CHECKING, Any
if TYPE_CHECKING:
    from pkg.fac.impl import Thing
__all__ = ["Thing"]
_HOMES = {"Thing": "impl"}
def __getattr__(name: str) -> Any:
    raise AttributeError(name)
"""


@pytest.fixture
def tree(tmp_path):
    def write(files: dict[str, str]) -> Modules:
        for rel, text in {"pkg/__init__.py": "", **files}.items():
            path = tmp_path / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return load_modules(tmp_path, "pkg")

    return write


def test_homes_rule_names_the_defining_module(tree):
    mods = tree(
        {
            "pkg/a.py": "def thing(): ...\n",
            "pkg/b.py": "from pkg.a import thing\n",
            "pkg/c.py": "x = 1\n\n\ndef f():\n    from pkg.b import thing\n",
            "pkg/d.py": "from pkg.a import nothing\nfrom pkg.gone import x\n",
            "pkg/e.py": "from pkg.b import thing as t\n",
            "pkg/f.py": "from pkg.e import t\nEXT = 'pkg.a.thing'\nBAD = 'pkg.b.thing'\n",
        }
    )
    assert check_homes(mods) == [
        "pkg/c.py:5: imports thing from pkg.b, which does not define it; import it from pkg.a",
        "pkg/d.py:1: imports nothing from pkg.a, which does not define it; it is defined "
        "nowhere in pkg",
        "pkg/d.py:2: imports x from pkg.gone: no such module",
        "pkg/e.py:1: imports thing from pkg.b, which does not define it; import it from pkg.a",
        "pkg/f.py:1: imports t from pkg.e, which does not define it; import it from pkg.a",
        "pkg/f.py:3: the string 'pkg.b.thing' names no module and no name its module defines; "
        "write the defining module's path",
    ]


def test_homes_rule_accepts_definitions_submodules_and_facade_names(tree):
    mods = tree(
        {
            "pkg/fac/__init__.py": FACADE,
            "pkg/fac/impl.py": "class Thing: ...\n",
            "pkg/a.py": "import sys\nif sys:\n    X = 1\nelse:\n    def X(): ...\n(Y, Z) = 1, 2\n",
            "pkg/b.py": "from pkg.a import X, Y, Z\nfrom pkg import a\nfrom . import a as aa\n",
            "pkg/c.py": "from pkg.fac import Thing\nimport pkg.fac.impl\nM = 'pkg.fac.impl'\n",
        }
    )
    assert check_homes(mods) == []


def test_facade_rule_both_directions(tree):
    mods = tree(
        {
            "pkg/fac/__init__.py": FACADE,
            "pkg/fac/impl.py": "class Thing: ...\n",
            "pkg/fac/user.py": "from pkg.fac import Thing\n",
            "pkg/fac/fine.py": "from pkg.fac.impl import Thing\n",
            "pkg/out.py": "def f():\n    from pkg.fac.impl import Thing\n",
            "pkg/good.py": "from pkg.fac import Thing\n",
        }
    )
    assert check_facades(mods) == [
        "pkg/fac/user.py:1: imports Thing from its own package's facade pkg.fac; inside the "
        "package import it from pkg.fac.impl",
        "pkg/out.py:2: imports Thing from pkg.fac.impl; outside pkg.fac import it from the "
        "facade: `from pkg.fac import Thing`",
    ]


def test_facade_rule_wants_every_name_placed_consistently(tree):
    listed = FACADE.replace('["Thing"]', '["Thing", "Other"]')
    mods = tree({"pkg/fac/__init__.py": listed.replace('"impl"}', '"gone"}')})
    assert check_facades(mods) == [
        "pkg/fac/__init__.py:5: `_HOMES` sends Thing to pkg.fac.gone but the `TYPE_CHECKING` "
        "import says pkg.fac.impl; make them agree",
        "pkg/fac/__init__.py:5: facade name Other has no `TYPE_CHECKING` import saying where "
        "it lives; add `from pkg.fac.<module> import Other` under it",
    ]
    homes = "_HOMES = {**dict.fromkeys(['Thing'], 'impl')}"
    mods = tree({"pkg/fac/__init__.py": FACADE.replace('_HOMES = {"Thing": "impl"}', homes)})
    assert check_facades(mods) == []


def test_cycle_rules_see_module_and_function_level_imports(tree):
    mods = tree(
        {
            "pkg/a.py": "from pkg.b import g\n\n\ndef f(): ...\n",
            "pkg/b.py": "def g():\n    from pkg.a import f\n",
            "pkg/c.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg.a import f\n",
            "pkg/d.py": "def h():\n    import pkg.e\n",
            "pkg/e.py": "class E:\n    def m(self):\n        from pkg.d import h\n",
        }
    )
    assert check_cycles(mods) == []  # deferred imports do not run at import time
    assert check_function_level_cycles(mods) == [
        "import cycle pkg.a -> pkg.b -> pkg.a through a function-level import: pkg/a.py:1 "
        "(module) imports pkg.b -> pkg/b.py:2 (function) imports pkg.a; move the name one of "
        "them needs to the module that owns it",
        "import cycle pkg.d -> pkg.e -> pkg.d through a function-level import: pkg/d.py:2 "
        "(function) imports pkg.e -> pkg/e.py:3 (function) imports pkg.d; move the name one "
        "of them needs to the module that owns it",
    ]
    # a function-level import answered by a TYPE_CHECKING import is no cycle
    mods = tree({"pkg/b.py": "def g():\n    from pkg.c import x\n", "pkg/c.py": "import typing\n"
                 "if typing.TYPE_CHECKING:\n    from pkg.b import g\nx = 1\n"})  # fmt: skip
    assert [line.split(":")[0] for line in check_function_level_cycles(mods)] == [
        "import cycle pkg.d -> pkg.e -> pkg.d through a function-level import"
    ]
    mods = tree({"pkg/b.py": "import pkg.a\n\n\nclass G:\n    from pkg.c import f\n"})
    assert check_cycles(mods) == [
        "import cycle pkg.a -> pkg.b -> pkg.a: pkg/a.py:1 (module) imports pkg.b -> "
        "pkg/b.py:1 (module) imports pkg.a; move what one of them needs from the other to the "
        "module of its role"
    ]


def test_annotation_cycle_rule_sees_type_checking_imports_and_whole_facades(tree):
    mods = tree(
        {
            "pkg/a.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg.b import B\nA = 1\n",
            "pkg/b.py": "from pkg.a import A\n\n\nclass B: ...\n",
            "pkg/fac/__init__.py": FACADE,
            "pkg/fac/impl.py": "class Thing: ...\n",
            "pkg/fac/other.py": "from pkg.low import f\n",
            "pkg/low.py": "def f():\n    from pkg.fac import Thing\n",
            "pkg/below.py": "from pkg.fac.impl import Thing\n",  # the parent facade: no edge
        }
    )
    assert check_cycles(mods) == [] and check_function_level_cycles(mods) == []
    assert [line.split(":")[0] for line in check_annotation_cycles(mods)] == [
        "import cycle pkg.a -> pkg.b -> pkg.a once TYPE_CHECKING imports count"
    ]
    declared = FACADE.replace("    from pkg.fac.impl import Thing\n",
                              "    from pkg.fac.impl import Thing\n    from pkg.fac.other import g\n")  # fmt: skip
    declared = declared.replace('["Thing"]', '["Thing", "g"]').replace(
        '"impl"}', '"impl", "g": "other"}'
    )
    mods = tree(
        {"pkg/fac/__init__.py": declared, "pkg/fac/other.py": "from pkg.low import f\ng = 1\n"}
    )
    assert [line.split(":")[0] for line in check_annotation_cycles(mods)] == [
        "import cycle pkg.a -> pkg.b -> pkg.a once TYPE_CHECKING imports count",
        "import cycle pkg.fac.other -> pkg.low -> pkg.fac.other once TYPE_CHECKING imports count",
    ]


def test_cycle_rule_sees_through_facades_and_parent_packages(tree):
    mods = tree(
        {
            "pkg/fac/__init__.py": FACADE,
            "pkg/fac/impl.py": "from pkg.other import helper\n\n\nclass Thing: ...\n",
            "pkg/other.py": "from pkg.fac import Thing\n\n\ndef helper(): ...\n",
            "pkg/sub/__init__.py": "from pkg.top import T\n",
            "pkg/sub/leaf.py": "L = 1\n",
            "pkg/sub/inner.py": "from pkg.sub.leaf import L\n",  # its own package: no edge
            "pkg/top.py": "from pkg.sub.leaf import L\nT = L\n",
        }
    )
    assert [line.split(":")[0] for line in check_cycles(mods)] == [
        "import cycle pkg.fac.impl -> pkg.other -> pkg.fac.impl",
        "import cycle pkg.sub -> pkg.top -> pkg.sub",
    ]


def test_reexport_rule(tree):
    mods = tree(
        {
            "pkg/a.py": "X = 1\n",
            "pkg/b.py": "from pkg.a import X  # noqa: F401\n"
            "def f():\n    import os  # noqa: F401\n",
            "pkg/c.py": "from pkg.a import X\n\n__all__ = ['X', 'Y']\nY = X\n",
        }
    )
    assert check_reexport_lines(mods) == [
        "pkg/b.py:1: `noqa: F401` import of X at module level (a re-export); delete it, "
        "importers take X from its defining module",
        "pkg/c.py:3: `__all__` lists X, which pkg.c imports (a re-export); drop it, importers "
        "take it from its defining module",
    ]


def test_one_code_path_rule(tmp_path):
    (tmp_path / "t.py").write_text(
        "def f(self, ctx, cfg):\n    init(cfg.distributed)\n    if ctx.distributed:\n"
        "        pass\n    return self.ctx.distributed and self.cfg.distributed\n"
    )
    assert [line.split(": ")[0] for line in distributed_branches(tmp_path, ["t.py"])] == [
        "t.py:3", "t.py:5"
    ]  # fmt: skip


def test_prefixed_sibling_rule(tmp_path):
    files = ["pkg/x.py", "pkg/x_y.py", "pkg/sub/kv_cache.py", "pkg/sub/a_b.py", "pkg/sub/a_c.py"]
    packages = ["pkg/sub/p/__init__.py", "pkg/sub/p_q.py", "pkg/sub/kv/data.txt"]
    for rel in [*files, *packages, "pkg/_p_q.py", "pkg/_p.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    failures = check_prefixed_siblings(tmp_path, "pkg")
    flagged = ["pkg/sub/a_b.py", "pkg/sub/a_c.py", "pkg/sub/p_q.py", "pkg/x_y.py"]
    assert [f.split(":")[0] for f in failures] == flagged
    assert "prefixed sibling of p/; move it into `p/` with one module per role" in failures[2]
    assert failures[-1] == (
        "pkg/x_y.py:1: prefixed sibling of x.py; make `x/` a package with one module per role"
    )


def test_path_rule(tmp_path):
    (tmp_path / "src" / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    (tmp_path / "src" / "pkg" / "__init__.py").write_text("")
    (tmp_path / "src" / "pkg" / "sub" / "__init__.py").write_text("")
    (tmp_path / "src" / "pkg" / "sub" / "mod.py").write_text(
        '"""Next to run.py (missing); see sub/mod.py, mod.py and pkg.sub.mod.f."""\ndef f(): ...\n'
    )
    (tmp_path / "docs" / "a.md").write_text(
        "`sub/mod.py`, `src/pkg/sub/mod.py`, `pkg.sub.mod.f`, path/to/file.py, NAME.py\n"
        "`old/mod.py`, `pkg.sub.gone`, `pkg.sub.mod.g`, https://x.org/a/b.py\n"
    )
    mods = load_modules(tmp_path / "src", "pkg")
    assert check_path_mentions(tmp_path, mods, ["docs", "src"]) == [
        "docs/a.md:2: old/mod.py does not exist; write the path it has now",
        "docs/a.md:2: pkg.sub.gone names no module and no name its module defines; write the "
        "defining module's path",
        "docs/a.md:2: pkg.sub.mod.g names no module and no name its module defines; write the "
        "defining module's path",
        "src/pkg/sub/mod.py:1: no file is named run.py; write the one meant",
    ]


def test_doc_link_rule(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "src").mkdir()
    (tmp_path / "docs" / "guide.md").write_text(
        "# A page\n\n## Per-step cost (issue 12)\n\n- **Replay** swaps\n"
    )
    (tmp_path / "docs" / "map.md").write_text(
        "[ok](guide.md#per-step-cost-issue-12) [web](https://x.org/a.md) [gone](old.md)\n"
        '[bad anchor](guide.md#per-step-cost) docs/guide.md ("Replay") docs/gone.md\n'
        'docs/guide.md, "Re-rolls"\n'
        '[guide.md](guide.md) ("Replay") [guide.md](guide.md#a-page), "Streaming"\n'
    )
    (tmp_path / "src" / "mod.py").write_text(
        '"""See docs/guide.md ("Per-step cost (issue 12)",\n"Replay") and docs/guide.md, \'Sampling\'."""\n'
    )
    assert check_doc_links(tmp_path, ["docs", "src"]) == [
        "docs/map.md:1: the link old.md reaches no file; link the page that exists now",
        "docs/map.md:2: the link guide.md#per-step-cost names no heading of guide.md; link a "
        "heading it has",
        "docs/map.md:2: docs/gone.md does not exist; write its path now",
        'docs/map.md:3: docs/guide.md holds no "Re-rolls"; cite the page and title that hold '
        "it now",
        'docs/map.md:4: guide.md holds no "Streaming"; cite the page and title that hold it now',
        'src/mod.py:2: docs/guide.md holds no "Sampling"; cite the page and title that hold it now',
    ]


def test_heading_anchors_follow_github():
    text = "# leangrpo check (issue 38)\n## async_overlap\n```\n# not a heading\n```\n## `a` b\n## `a` b\n"
    assert heading_anchors(text) == {"leangrpo-check-issue-38", "async_overlap", "a-b", "a-b-1"}


def test_docs_map_rule(tmp_path):
    (tmp_path / "docs").mkdir()
    for name in ["a.md", "b.md", "c.md"]:
        (tmp_path / "docs" / name).write_text("# page\n")
    (tmp_path / "docs" / "ARCHITECTURE.md").write_text("# map\n[a](a.md#page)\n" + "line\n" * 8)
    (tmp_path / "README.md").write_text("[b](docs/b.md)\n")
    assert check_docs_map(tmp_path, limit=9) == [
        "docs/ARCHITECTURE.md: 10 lines; keep the map under 9 and move the detail to a page of "
        "its own under docs/",
        "docs/c.md: linked from neither docs/ARCHITECTURE.md nor README.md; add it to the map's "
        "table of pages",
    ]
    assert [f.split(":")[0] for f in check_docs_map(tmp_path, limit=10)] == ["docs/c.md"]


def test_the_architecture_tree_names_every_module():
    """docs/ARCHITECTURE.md's layout tree matches src/: every module is written in it under
    its package, and every package of src is in it."""
    text = (SRC.parent / "docs" / "ARCHITECTURE.md").read_text()
    package_root = SRC / "leangrpo"
    tree = text.split("## Layout", 1)[1].split("```", 2)[1]
    blocks: dict[str, list[str]] = {}
    top = current = ""
    for line in tree.splitlines()[1:]:
        indent, words = len(line) - len(line.lstrip()), line.split()
        if words and indent == 2:  # a top-level package or module line
            top = current = words[0] if words[0].endswith("/") else ""
        elif words and indent == 4:  # a subpackage, or a module of the package above it
            current = top + words[0] if words[0].endswith("/") else top
        blocks.setdefault(current, []).append(line)  # deeper lines continue the current one
    missing = []
    for path in sorted(package_root.rglob("*.py")):
        rel = path.relative_to(package_root)
        if rel.name == "__init__.py":
            continue
        package = "/".join(rel.parts[:-1]) + "/" if len(rel.parts) > 1 else ""
        words = {w for line in blocks.get(package, []) for w in line.replace(",", " ").split()}
        if rel.name not in words:
            missing.append(
                f"{rel}: not in docs/ARCHITECTURE.md's layout tree under {package or 'the top'}"
            )
    assert not missing, "\n".join(missing)


def test_make_test_runs_every_file_with_vllm_tests():
    """A vLLM test file missing from VLLM_FILES would never run: the main venv has no vLLM."""
    repo = SRC.parent
    makefile = (repo / "Makefile").read_text().replace("\\\n", " ")
    (listed,) = re.findall(r"^VLLM_FILES := (.*)$", makefile, flags=re.M)
    marked = [
        str(path.relative_to(repo))
        for path in sorted((repo / "tests").rglob("test_*.py"))
        if re.search(r"^\s*@pytest\.mark\.vllm\b", path.read_text(), flags=re.M)
    ]
    assert marked and sorted(listed.split()) == marked, (listed, marked)
