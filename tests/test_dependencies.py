"""Dependencies point one way, read from the import statements of every simtree module:

    simtree core (errors, trees, costs, acceptance, planning, reporting, machine, data, ...)
      <- simtree.kernels (kernels/) <- simtree.runtime (runtime/), simtree.profiler (profiler/)
      <- simtree.cli (and ``python -m simtree``)

The core imports none of the layers above it; kernels import only the core; runtime and
profiler never import each other; nothing imports a private (underscore) name of another
package; no simtree modules import each other in a circle (function-level imports
included: a circle is a tangle even where it happens not to deadlock at import time), nor do
simtree's subpackages and top-level modules taken as wholes (``simtree.costs``,
``simtree.deploy``, ``simtree.models``, ``simtree.kernels.gdn``, ...); reporting renders what
planning made and never plans, planning never reports; and no file under kernels/ reads the
environment (a caller passes the choice).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# installed package -> folder in the repository (setup.py's package_dir)
FOLDERS = {"simtree": "simtree", "simtree.kernels": "kernels", "simtree.runtime": "runtime",
           "simtree.profiler": "profiler"}
ALLOWED = {"core": {"core"}, "kernels": {"core", "kernels"}, "runtime": {"core", "kernels", "runtime"},
           "profiler": {"core", "kernels", "profiler"},
           "cli": {"core", "kernels", "runtime", "profiler", "cli"}}
# Edges allowed although they break a rule (none today): (importer, imported).
PENDING: set[tuple[str, str]] = set()


def modules(root: Path = ROOT, folders: dict = FOLDERS) -> dict[str, Path]:
    """{dotted module name: file} of every module that installs under simtree."""
    out = {}
    for package, folder in folders.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if package == "simtree" and parts and f"simtree.{parts[0]}" in folders:
                continue   # a folder that installs as its own package
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def imports(mods: dict[str, Path]) -> list[tuple[str, str, str | None]]:
    """(importer, imported simtree module, the name taken from it or None) for every import
    statement, at any depth of the file; a ``from X import Y`` of a submodule Y is an import of
    X.Y."""
    out = []
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out += [(name, a.name, None) for a in node.names if a.name.split(".")[0] == "simtree"]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
                if base.split(".")[0] != "simtree":
                    continue
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    out.append((name, sub, None) if sub in mods else (name, base, a.name))
    return out


def layer(module: str) -> str:
    part = module.split(".")[1] if "." in module else ""
    if module == "simtree.__main__":
        return "cli"
    return part if part in ("kernels", "runtime", "profiler", "cli") else "core"


def package_of(module: str, mods: dict[str, Path]) -> str:
    return module if mods.get(module, Path()).name == "__init__.py" else module.rsplit(".", 1)[0]


def violations(mods: dict[str, Path], pending=frozenset()) -> list[str]:
    """One line per import that breaks a rule of the module docstring."""
    bad = []
    for src, dst, name in imports(mods):
        if (src, dst) in pending:
            continue
        if layer(dst) not in ALLOWED[layer(src)]:
            bad.append(f"{src} ({layer(src)}) imports {dst} ({layer(dst)})")
        if name and name.startswith("_") and not name.startswith("__"):
            if not package_of(src, mods).startswith(package_of(dst, mods)):
                bad.append(f"{src} imports the private name {name} of {dst}")
    return bad


def cycles(mods: dict[str, Path], pending=frozenset(), edges=None) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), over the import edges of
    ``mods`` (or ``edges``, (importer, imported, name) triples)."""
    graph = {m: set() for m in mods}
    for src, dst, _ in imports(mods) if edges is None else edges:
        if dst in mods and dst != src and (src, dst) not in pending:
            graph[src].add(dst)
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_dependencies_point_one_way():
    mods = modules()
    assert len(mods) > 50 and {"simtree.planning.planner", "simtree.kernels.gdn", "simtree.runtime.full.engine",
                                "simtree.profiler.sweep", "simtree.cli"} <= set(mods)
    assert violations(mods, PENDING) == []


def test_no_import_cycles():
    assert cycles(modules(), PENDING) == []


def unit(module: str) -> str:
    """The subpackage (or top-level module) a module belongs to: simtree.costs.model ->
    simtree.costs, simtree.models -> simtree.models, simtree.kernels.gdn.verify ->
    simtree.kernels.gdn (kernels/, runtime/ and profiler/ count one level deeper)."""
    parts = module.split(".")
    depth = 3 if len(parts) > 2 and parts[1] in ("kernels", "runtime", "profiler") else 2
    return ".".join(parts[:depth])


def package_cycles(mods: dict[str, Path]) -> list[list[str]]:
    """Circles between subpackages: ``cycles`` over the graph of ``unit``s."""
    units = {unit(m): Path(f"{unit(m)}.py") for m in mods}
    collapsed = [(unit(src), unit(dst), None) for src, dst, _ in imports(mods)]
    return cycles(units, edges=collapsed)


def test_no_import_cycles_between_subpackages():
    mods = modules()
    assert {"simtree.costs", "simtree.deploy", "simtree.models", "simtree.kernels.gdn",
            "simtree.runtime.full"} <= {unit(m) for m in mods}
    assert package_cycles(mods) == []


def test_reporting_renders_and_planning_plans():
    # the planner's entries (plan, plan_bundles) are planning's to call: reporting imports
    # none, and planning imports no report
    mods = modules()
    entries = {("simtree.planning.planner", "plan"), ("simtree.planning.bundles", "plan_bundles")}
    bad = [f"{src} imports {dst}" + (f".{name}" if name else "") for src, dst, name in imports(mods)
           if (src.startswith("simtree.reporting") and (dst, name) in entries)
           or (src.startswith("simtree.planning") and dst.startswith("simtree.reporting"))]
    assert bad == []


def test_no_kernel_reads_the_environment():
    # which form a kernel runs is an argument or a caller-set config (kernels/layers/forms.py);
    # the interpreter is Triton's own state (kernels/_triton.py), the CUDA toolchain's folders
    # simtree.machine.toolchain's
    hits = []
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                    a.name in ("environ", "environb", "getenv") for a in node.names):
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno} from os import ...")
            elif isinstance(node, ast.Attribute) and node.attr in ("environ", "environb", "getenv"):
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert hits == [], hits


def test_runtime_and_profiler_share_nothing_but_the_layers_below():
    # the rule as a grep would check it: no file of one names the other
    for folder, other in (("runtime", "simtree.profiler"), ("profiler", "simtree.runtime")):
        hits = [f"{p.relative_to(ROOT)}:{i}" for p in (ROOT / folder).rglob("*.py")
                for i, line in enumerate(p.read_text().splitlines(), 1)
                if other in line]
        assert hits == [], hits


@pytest.fixture
def fake_tree(tmp_path):
    """A miniature repository laid out like simtree's, whose files a test fills in."""
    files = {"simtree/__init__.py": "", "simtree/core_a.py": "", "simtree/core_b.py": "",
             "simtree/cli/__init__.py": "", "kernels/__init__.py": "", "kernels/k.py": "_helper = 1\n",
             "runtime/__init__.py": "", "runtime/r.py": "", "profiler/__init__.py": "", "profiler/p.py": ""}

    def make(**sources):
        for rel, text in {**files, **{k.replace("__", "/") + ".py": v for k, v in sources.items()}}.items():
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / rel).write_text(text)
        return modules(tmp_path)
    return make


@pytest.mark.parametrize("sources, expected", [
    ({"simtree__core_a": "from simtree.runtime import r\n"}, "simtree.core_a (core) imports simtree.runtime.r"),
    ({"kernels__k": "def f():\n    from simtree.profiler.p import x\n"}, "simtree.kernels.k (kernels) imports"),
    ({"runtime__r": "import simtree.profiler.p\n"}, "simtree.runtime.r (runtime) imports simtree.profiler.p"),
    ({"profiler__p": "from simtree.runtime.r import y\n"}, "simtree.profiler.p (profiler) imports simtree.runtime"),
    ({"runtime__r": "from simtree.kernels.k import _helper\n"}, "imports the private name _helper"),
    ({"simtree__core_b": "from simtree.cli import main\n"}, "simtree.core_b (core) imports simtree.cli"),
])
def test_each_rule_catches_its_violation(fake_tree, sources, expected):
    bad = violations(fake_tree(**sources))
    assert any(expected in line for line in bad), bad


def test_allowed_imports_pass_and_circles_are_found(fake_tree):
    ok = fake_tree(runtime__r="from simtree.kernels.k import f\nfrom simtree import core_a\n",
                   profiler__p="from . import r\nfrom simtree.kernels import k\n",
                   simtree__cli__main="from simtree.runtime.r import x\n",
                   kernels__k="_helper = 1\nfrom ._own import _x\n")
    assert violations(ok) == [] and cycles(ok) == []
    tangled = fake_tree(simtree__core_a="from simtree.core_b import x\n",
                        simtree__core_b="def f():\n    from simtree import core_a\n")
    assert cycles(tangled) == [["simtree.core_a", "simtree.core_b"]]


def test_circles_between_subpackages_are_found(fake_tree):
    # no module circle, but costs -> deploy -> costs as packages
    mods = fake_tree(simtree__costs__fit="from simtree.deploy.comm import x\n",
                     simtree__costs__table="", simtree__costs____init__="",
                     simtree__deploy____init__="", simtree__deploy__comm="x = 1\n",
                     simtree__deploy__costs="from simtree.costs.table import y\n")
    assert cycles(mods) == []
    assert package_cycles(mods) == [["simtree.costs", "simtree.deploy"]]
