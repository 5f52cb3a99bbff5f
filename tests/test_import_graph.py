"""No import cycle inside qcompress/.

The graph is read from the source, not from sys.modules: every .py file under qcompress/ is parsed
(ast) and each `import` / `from ... import` naming another qcompress module is an edge, resolved
the way Python resolves it (relative levels; `from pkg import name` is an edge to the submodule
pkg.name when there is one, to pkg otherwise; a compiled extension such as qcompress._C is no
module of the graph).

Module-level imports may form no cycle. Function-level (lazy) imports are allowed, to keep
`import qcompress` light and to defer optional dependencies, but they count as edges as well: a
cycle closed by a lazy import is still two modules that each need the other, only discovered at
call time. The one kind of edge left out is a function-level import of one of the module's own
ancestor packages (`import qcompress` for the public facade, `from .. import __version__`): a
function of qcompress.export.cli can only run once qcompress has finished importing, and the
package importing its own subpackages is its structure, not a cycle between peers. The tests
print how many lazy imports there are.
"""

from __future__ import annotations

import ast
import os
import textwrap
from typing import Dict, List, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def modules_of(root: str, package: str) -> Dict[str, str]:
    """Dotted module name -> file, for every .py file of `package` under `root`."""
    out = {}
    for folder, dirs, files in os.walk(os.path.join(root, package)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _targets(node, here: str, is_package: bool, modules: Dict[str, str]) -> List[str]:
    """The graph modules one import statement of module `here` imports."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    if node.level:
        parts = here.split(".") if is_package else here.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    out = []
    for a in node.names:
        sub = f"{base}.{a.name}"
        if sub in modules:
            out.append(sub)
        elif base in modules and not _is_extension(modules[base], a.name):
            out.append(base)
    return out


def _is_extension(package_file: str, name: str) -> bool:
    folder = os.path.dirname(package_file)
    return any(f.split(".")[0] == name and f.endswith((".so", ".pyd")) for f in os.listdir(folder))


def import_edges(modules: Dict[str, str]) -> Tuple[Dict[str, Set[str]], List[Tuple[str, str]]]:
    """(module -> the modules it imports, [(module, target) of each function-level import])."""
    edges: Dict[str, Set[str]] = {m: set() for m in modules}
    lazy: List[Tuple[str, str]] = []
    for here, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        is_package = path.endswith("__init__.py")

        def walk(node, in_function: bool):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _targets(child, here, is_package, modules):
                        if in_function:
                            lazy.append((here, target))
                            if here.startswith(target + "."):  # an ancestor package: see above
                                continue
                        if target != here:
                            edges[here].add(target)
                else:
                    walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        walk(tree, False)
    return edges, lazy


def cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _describe(comp: List[str], edges, lazy) -> str:
    lazy_set = set(lazy)
    lines = [
        f"{a} -> {b}" + (" (inside a function)" if (a, b) in lazy_set else "")
        for a in comp
        for b in sorted(edges[a])
        if b in comp
    ]
    return "import cycle among " + ", ".join(comp) + ":\n  " + "\n  ".join(lines)


def test_qcompress_has_no_import_cycle():
    modules = modules_of(ROOT, "qcompress")
    edges, lazy = import_edges(modules)
    print(
        f"{len(modules)} modules, {sum(map(len, edges.values()))} import edges, "
        f"{len(lazy)} of the imports inside functions"
    )
    # the walk sees the package's real structure (an empty or misread graph would pass vacuously)
    assert len(modules) > 50, sorted(modules)
    assert "qcompress.export.quantized" in edges["qcompress.export.reader"]
    assert "qcompress.export.quantized" in edges["qcompress.export.fast"]
    assert ("qcompress", "qcompress.engine") in lazy  # qcompress.__getattr__
    found = cycles(edges)
    assert not found, "\n".join(_describe(c, edges, lazy) for c in found)


def _package(tmp_path, files: Dict[str, str]) -> Dict[str, str]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return modules_of(str(tmp_path), "pkg")


def test_the_walk_finds_module_level_and_lazy_cycles(tmp_path):
    """The checker itself: a module-level cycle, a cycle closed inside a function, and a lazy import
    of the package facade (allowed), in a throwaway package."""
    modules = _package(
        tmp_path,
        {
            "pkg/__init__.py": "def __getattr__(name):\n    from . import c\n    return c\n",
            "pkg/a.py": "from .b import thing\n",
            "pkg/b.py": "from . import a\nthing = 1\n",
            "pkg/c.py": "from .d import x\n",
            "pkg/d.py": "x = 1\ndef f():\n    from .c import y\n    import pkg\n",
            "pkg/sub/__init__.py": "from ..a import thing\nfrom . import leaf\n",
            "pkg/sub/leaf.py": "def g():\n    from pkg import sub\n",
        },
    )
    edges, lazy = import_edges(modules)
    assert edges["pkg.a"] == {"pkg.b"} and edges["pkg.b"] == {"pkg.a"}
    assert edges["pkg.d"] == {"pkg.c"}  # `import pkg` in a function: no edge
    assert edges["pkg.sub"] == {"pkg.a", "pkg.sub.leaf"}
    assert edges["pkg.sub.leaf"] == set()  # its own package, lazily: no edge
    assert ("pkg.d", "pkg.c") in lazy and ("pkg.sub.leaf", "pkg.sub") in lazy
    assert sorted(cycles(edges)) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]
    assert "(inside a function)" in _describe(["pkg.c", "pkg.d"], edges, lazy)
