"""DeepSpeed's config keys, read from its source: the list qcompress accepts, and how it was made.

`deepspeed_0_19_keys.json` (beside this file) holds every dotted key path DeepSpeed 0.19's
`DeepSpeedConfig` reads: what its parsing functions look up in the config document (subscripts,
`.get`, `in`, `get_scalar_param` and friends, followed through the functions and classes the
document or one of its sections is passed to) and the fields and aliases of the pydantic models
a section is unpacked into (`DeepSpeedZeroConfig(**section)`). Nothing is imported or run: the
source is parsed, so an installed DeepSpeed is read the same way as its sdist.

Regenerate the committed list (from a DeepSpeed sdist or an installed package folder):

    pip download --no-deps --no-binary :all: deepspeed==0.19.6 -d /tmp/ds && tar xzf /tmp/ds/*.tar.gz -C /tmp/ds
    python -m qcompress.config.deepspeed_schema /tmp/ds/deepspeed-0.19.6/deepspeed --write

A section qcompress reads as free-form (optimizer.params, scheduler.params) or owns
(compression_training: its schema in compression.py) is not descended into (OPAQUE).
"""

from __future__ import annotations

import ast
import json
import os
import sys
from typing import Dict, Iterable, List, Optional, Set, Tuple

COMMITTED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_0_19_keys.json")
ENTRY = ("runtime.config", "DeepSpeedConfig")
# sections whose keys DeepSpeed takes as a dict of defaults its reader updates from the document
# (runtime/config.py get_pipeline_config), or as the keyword arguments of a class the engine builds
# from the section (progressive_layer_drop: ProgressiveLayerDrop(theta, gamma))
DEFAULTS_DICTS = {("pipeline",): ("runtime.config", "get_pipeline_config")}
KWARGS_OF = {("progressive_layer_drop",): ("runtime.progressive_layer_drop", "ProgressiveLayerDrop")}
OPAQUE = (("optimizer", "params"), ("scheduler", "params"), ("compression_training",))
READERS = ("get_scalar_param", "get_dict_param", "get_list_param")

Path = Tuple[str, ...]


class _Module:
    def __init__(self, name: str, file: str):
        self.name = name
        self.package = os.path.basename(file) == "__init__.py"  # `from . import` means itself
        self.tree = ast.parse(open(file, encoding="utf-8").read(), file)
        self.defs: Dict[str, ast.AST] = {}
        self.values: Dict[str, ast.AST] = {}  # module-level NAME = expr
        self.imports: Dict[str, Tuple[str, str]] = {}
        self.star: List[str] = []
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                self.defs[node.name] = node
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                self.values[node.targets[0].id] = node.value
            elif isinstance(node, ast.ImportFrom):
                src = self._absolute(node)
                for alias in node.names:
                    if alias.name == "*":
                        self.star.append(src)
                    else:
                        self.imports[alias.asname or alias.name] = (src, alias.name)

    def _absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = self.name.split(".")
        base = parts[: len(parts) - node.level + (1 if self.package else 0)]
        return ".".join(base + ([node.module] if node.module else []))


class Extractor:
    def __init__(self, package_dir: str):
        self.root = os.path.abspath(package_dir)
        self.pkg = os.path.basename(self.root)  # "deepspeed"
        self.modules: Dict[str, Optional[_Module]] = {}
        self.keys: Set[Path] = set()
        self.seen: Set[tuple] = set()
        self._strs: Dict[str, str] = {}  # the walked function's parameters that name a key

    # --- modules and names ---------------------------------------------------------------------
    def module(self, name: str) -> Optional[_Module]:
        if name.startswith(self.pkg + "."):
            name = name[len(self.pkg) + 1 :]
        elif name == self.pkg:
            name = ""
        if name not in self.modules:
            rel = name.replace(".", os.sep)
            found = None
            for cand in (os.path.join(self.root, rel + ".py"), os.path.join(self.root, rel, "__init__.py")):
                if os.path.isfile(cand):
                    found = _Module(self.pkg + ("." + name if name else ""), cand)
                    break
            self.modules[name] = found
        return self.modules[name]

    def resolve(self, mod: _Module, name: str, depth: int = 0):
        """(module, definition or value expression) of `name` as `mod` sees it, or None."""
        if depth > 12:
            return None
        if name in mod.defs:
            return mod, mod.defs[name]
        if name in mod.values:
            return mod, mod.values[name]
        if name in mod.imports:
            src, orig = mod.imports[name]
            other = self.module(src) if src.split(".")[0] == self.pkg or src.startswith(".") else None
            if other is None and src.startswith(self.pkg):
                return None
            if other is not None:
                return self.resolve(other, orig, depth + 1)
            return None
        for src in mod.star:
            if src.split(".")[0] != self.pkg:
                continue
            other = self.module(src)
            if other is not None:
                got = self.resolve(other, name, depth + 1)
                if got is not None:
                    return got
        return None

    def string(self, mod: _Module, node, strs: Optional[Dict[str, str]] = None) -> Optional[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name) and strs and node.id in strs:
            return strs[node.id]  # a parameter bound to a key name (its default or the caller's)
        if isinstance(node, ast.Name):
            got = self.resolve(mod, node.id)
            if got is not None and isinstance(got[1], ast.expr):
                return self.string(got[0], got[1])
        return None

    # --- pydantic models -----------------------------------------------------------------------
    def is_model(self, mod: _Module, cls: ast.ClassDef, depth: int = 0) -> bool:
        if depth > 10:
            return False
        for base in cls.bases:
            name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
            if name in ("BaseModel", "DeepSpeedConfigModel"):
                return True
            got = self.resolve(mod, name) if name else None
            if got is not None and isinstance(got[1], ast.ClassDef) and self.is_model(got[0], got[1], depth + 1):
                return True
        return False

    def model_keys(self, mod: _Module, cls: ast.ClassDef, path: Path, depth: int = 0) -> None:
        """Every field (and alias) of a pydantic model under `path`, nested models below it."""
        if depth > 8 or path in OPAQUE:
            return
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id not in ("BaseModel", "DeepSpeedConfigModel"):
                got = self.resolve(mod, base.id)
                if got is not None and isinstance(got[1], ast.ClassDef) and self.is_model(*got):
                    self.model_keys(got[0], got[1], path, depth + 1)
        for node in cls.body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            name = node.target.id
            if name.startswith("_") or name == "model_config" or "ClassVar" in ast.dump(node.annotation):
                continue
            names = [name]
            if isinstance(node.value, ast.Call):
                for kw in node.value.keywords:
                    if kw.arg == "alias":
                        alias = self.string(mod, kw.value)
                        if alias:
                            names.append(alias)
            nested = [self.resolve(mod, n.id) for n in ast.walk(node.annotation) if isinstance(n, ast.Name)]
            nested = [g for g in nested if g is not None and isinstance(g[1], ast.ClassDef) and self.is_model(*g)]
            for key in names:
                self.add(path + (key,))
                for got in nested:
                    self.model_keys(got[0], got[1], path + (key,), depth + 1)

    # --- following the document through the readers --------------------------------------------
    def add(self, path: Path) -> None:
        if path and not any(path[: len(o)] == o and len(path) > len(o) for o in OPAQUE):
            self.keys.add(path)

    def walk(
        self,
        mod: _Module,
        func: ast.FunctionDef,
        env: Dict[str, Path],
        cls: Optional[ast.ClassDef],
        depth: int = 0,
        strs: Optional[Dict[str, str]] = None,
    ) -> None:
        strs = strs or {}
        sig = (mod.name, func.name, id(func), tuple(sorted(env.items())), tuple(sorted(strs.items())))
        if depth > 10 or sig in self.seen:
            return
        self.seen.add(sig)
        saved, self._strs = self._strs, strs
        try:
            self._walk(mod, func, dict(env), cls, depth)
        finally:
            self._strs = saved

    def _walk(self, mod, func, env, cls, depth) -> None:
        for _ in range(3):  # local names bound to sections of the document
            for node in ast.walk(func):
                if isinstance(node, ast.Assign) and len(node.targets) == 1:
                    target = node.targets[0]
                    p = self.path(mod, node.value, env)
                    if p is not None and isinstance(target, (ast.Name, ast.Attribute)):
                        env.setdefault(_name(target), p)
        for node in ast.walk(func):
            self.reads(mod, node, env)
            if isinstance(node, ast.Call):
                self.call(mod, node, env, cls, depth)

    def path(self, mod: _Module, node, env: Dict[str, Path]) -> Optional[Path]:
        """The document path an expression stands for (None: not a part of the document)."""
        if isinstance(node, (ast.Name, ast.Attribute)):
            got = env.get(_name(node))
            if got is not None:
                return got
        if isinstance(node, ast.Subscript):
            base = self.path(mod, node.value, env)
            key = self.string(mod, node.slice, self._strs)
            if base is not None and key is not None:
                self.add(base + (key,))
                return base + (key,)
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "get" and node.args:
                base = self.path(mod, f.value, env)
                key = self.string(mod, node.args[0], self._strs)
                if base is not None and key is not None:
                    self.add(base + (key,))
                    return base + (key,)
            if isinstance(f, ast.Attribute) and f.attr in ("copy", "deepcopy") and node.args:
                return self.path(mod, node.args[0], env)  # copy.copy(section)
            if isinstance(f, ast.Name) and f.id == "dict" and node.args:
                return self.path(mod, node.args[0], env)
        if isinstance(node, ast.BoolOp):
            for v in node.values:
                got = self.path(mod, v, env)
                if got is not None:
                    return got
        if isinstance(node, ast.DictComp) and len(node.generators) == 1:
            gen = node.generators[0]  # {k: doc.get(k, {}) for k in ("a", "b")}: the document
            if isinstance(gen.iter, (ast.Tuple, ast.List)) and isinstance(node.value, ast.Call):
                f = node.value.func
                if isinstance(f, ast.Attribute) and f.attr == "get":
                    base = self.path(mod, f.value, env)
                    if base is not None:
                        for elt in gen.iter.elts:
                            key = self.string(mod, elt, self._strs)
                            if key:
                                self.add(base + (key,))
                        return base
        return None

    def reads(self, mod: _Module, node, env: Dict[str, Path]) -> None:
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            target = node.comparators[0]
            if isinstance(target, ast.Call) and isinstance(target.func, ast.Attribute) and target.func.attr == "keys":
                target = target.func.value
            base = self.path(mod, target, env)
            key = self.string(mod, node.left, self._strs)
            if base is not None and key is not None:
                self.add(base + (key,))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in READERS
            and len(node.args) >= 2
        ):
            base = self.path(mod, node.args[0], env)
            key = self.string(mod, node.args[1], self._strs)
            if base is not None and key is not None:
                self.add(base + (key,))
        elif isinstance(node, (ast.Subscript, ast.Call)):
            self.path(mod, node, env)

    def call(self, mod: _Module, node: ast.Call, env: Dict[str, Path], cls, depth: int) -> None:
        args = [(i, self.path(mod, a, env)) for i, a in enumerate(node.args)]
        star = [self.path(mod, kw.value, env) for kw in node.keywords if kw.arg is None]
        if not any(p is not None for _, p in args) and not any(p is not None for p in star):
            return
        target = None
        if isinstance(node.func, ast.Name):
            target = self.resolve(mod, node.func.id)
        elif (
            isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self"
            and cls is not None
        ):
            method = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == node.func.attr), None)
            if method is not None:
                target = (mod, method)
        if target is None:
            return
        tmod, tdef = target
        if isinstance(tdef, ast.ClassDef):
            if self.is_model(tmod, tdef):
                for p in star:
                    if p is not None:
                        self.model_keys(tmod, tdef, p)
                return
            init = next((n for n in tdef.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            if init is not None:
                self.bind_and_walk(mod, node, tmod, init, args, tdef, depth, skip_self=True)
            return
        if isinstance(tdef, ast.FunctionDef):
            inner_cls = cls if tmod is mod and tdef in (cls.body if cls is not None else []) else None
            self.bind_and_walk(mod, node, tmod, tdef, args, inner_cls, depth, skip_self=inner_cls is not None)

    def bind_and_walk(self, mod, node, tmod, func, args, cls, depth, skip_self=False):
        """Walk `func` with its parameters bound to the caller's document sections, and to the key
        names the caller passes or the parameters' defaults give (get_communication_data_type's
        comm_type=COMMUNICATION_DATA_TYPE)."""
        params = [a.arg for a in func.args.args][1 if skip_self else 0 :]
        env = {params[i]: p for i, p in args if p is not None and i < len(params)}
        if not env:
            return
        strs = {}
        defaults = func.args.defaults
        for name, default in zip([a.arg for a in func.args.args][-len(defaults) :] if defaults else [], defaults):
            value = self.string(tmod, default)
            if value is not None:
                strs[name] = value
        for i, a in enumerate(node.args):
            value = self.string(mod, a, self._strs)
            if value is not None and i < len(params):
                strs[params[i]] = value
        for kw in node.keywords:
            value = self.string(mod, kw.value, self._strs) if kw.arg else None
            if value is not None:
                strs[kw.arg] = value
        self.walk(tmod, func, env, cls, depth + 1, strs)

    # --- the whole schema ----------------------------------------------------------------------
    def required(self, name: str) -> _Module:
        """The module `name`, which the schema walk cannot do without."""
        mod = self.module(name)
        if mod is None:
            raise FileNotFoundError(f"{name}: no such module under {self.root} (not a DeepSpeed 0.19 source tree?)")
        return mod

    def required_def(self, mod: _Module, name: str, kind: type):
        node = mod.defs.get(name)
        if not isinstance(node, kind):
            raise LookupError(f"{mod.name}.{name}: expected a {kind.__name__} (not a DeepSpeed 0.19 source tree?)")
        return node

    def run(self) -> List[str]:
        mod = self.required(ENTRY[0])
        cls = self.required_def(mod, ENTRY[1], ast.ClassDef)
        for method in cls.body:  # __init__ parses; other methods read self._param_dict too
            if isinstance(method, ast.FunctionDef):
                self.walk(mod, method, {"self._param_dict": ()}, cls)
        for path, (mname, fname) in DEFAULTS_DICTS.items():
            dmod = self.required(mname)
            for node in ast.walk(self.required_def(dmod, fname, ast.FunctionDef)):
                if isinstance(node, ast.Dict):
                    for k in node.keys:
                        key = self.string(dmod, k)
                        if key:
                            self.add(path + (key,))
        for path, (mname, cname) in KWARGS_OF.items():
            kcls = self.required_def(self.required(mname), cname, ast.ClassDef)
            init = next(n for n in kcls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
            for a in init.args.args[1:]:
                self.add(path + (a.arg,))
        return sorted(".".join(p) for p in self.keys)


def _name(node) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"
    return ""


def version_of(package_dir: str) -> str:
    for name in ("version.txt",):
        p = os.path.join(package_dir, "..", name)
        if os.path.isfile(p):
            return open(p).read().strip()
    p = os.path.join(package_dir, "git_version_info_installed.py")
    if os.path.isfile(p):
        for line in open(p):
            if line.startswith("version="):
                return line.split("=", 1)[1].strip().strip("'\"")
    return "unknown"


def extract(package_dir: str) -> List[str]:
    """Every dotted key path DeepSpeed's config reads, from the `deepspeed` package folder."""
    return Extractor(package_dir).run()


def installed_package_dir() -> Optional[str]:
    """The folder of an installed `deepspeed` package (not imported), or None."""
    import importlib.util

    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def committed() -> dict:
    with open(COMMITTED, encoding="utf-8") as fh:
        return json.load(fh)


def main(argv: Optional[Iterable[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("package_dir", help="the `deepspeed` package folder (sdist or installed)")
    ap.add_argument("--write", action="store_true", help=f"write {os.path.basename(COMMITTED)}")
    args = ap.parse_args(list(argv) if argv is not None else None)
    keys = extract(args.package_dir)
    doc = {
        "deepspeed": version_of(args.package_dir),
        "command": "python -m qcompress.config.deepspeed_schema DEEPSPEED_PACKAGE_DIR --write",
        "keys": keys,
    }
    text = json.dumps(doc, indent=1) + "\n"
    if args.write:
        tmp = COMMITTED + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, COMMITTED)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
