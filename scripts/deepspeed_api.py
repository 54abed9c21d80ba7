#!/usr/bin/env python3
"""Generates python/uckpt/_deepspeed_tree.py: DeepSpeed 0.14.5's module tree and its names, read from its source.

    scripts/deepspeed_api.py DEEPSPEED_0_14_5_DIR [--later DEEPSPEED_GIT_DIR] [--out FILE]
    scripts/deepspeed_api.py DEEPSPEED_0_14_5_DIR --check FILE     (exit 1 when FILE's 0.14.5 part differs)

DEEPSPEED_0_14_5_DIR holds the `deepspeed` package of DeepSpeed 0.14.5 (an installed one: site-packages, or
`git archive v0.14.5 deepspeed op_builder`). Nothing is imported: every file is parsed (ast), so the modules that
need CUDA, Triton or a compiler are read as well as the others.

What is recorded, per module of the package (every .py file, every folder of them):
  its public names (not starting with "_") defined at its top level (also inside top-level if/try/with blocks):
    "c"  a class                    "f"  a function
    ("k", value)  a constant whose value is a literal (ast.literal_eval) or another such constant of the module,
                  the same in every branch (in straight-line code the last assignment counts, as at import), and
                  that the module's code neither rebinds (`global`) nor changes in place; else "v"
    ("e", mixin, ((member, value), ...))  an Enum class whose body is only literal members
    "v"  any other value
    ("m", module)  a DeepSpeed module bound to the name (`import deepspeed.comm as dist`, `from . import ops`)
    ("i", module, name)  a name imported from another DeepSpeed module (resolved at run time by uckpt); a
                         `from deepspeed.x import *` is expanded into these
  Names imported from other packages (torch, typing, ...) are not DeepSpeed's and are not recorded.

With --later, the DeepSpeed repository's release tags after v0.14.5 (v0.15.0 ...) and its HEAD are read the same
way (`git show`, nothing checked out), and each module, and each name of a module 0.14.5 has, that first
appears after 0.14.5 is recorded with the first release that has it ("HEAD" for none yet): uckpt names that
release when a script asks for one. The engine's methods and attributes are read the same way
(DeepSpeedEngine's public names at each release).

The class member lists of python/uckpt/runtime/_deepspeed_names.py are generated here too (CLASSES below).
"""
import argparse
import ast
import os
import pprint
import re
import subprocess
import sys

VERSION = "0.14.5"
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "..", "python", "uckpt", "_deepspeed_tree.py")
LITERAL_LIMIT = 400  # longer literals are recorded as "v" (values uckpt refuses), to keep the file readable

# Classes whose public members python/uckpt/runtime/_deepspeed_names.py lists (module, class), by the key there.
CLASSES = {
    "ENGINE": ("deepspeed.runtime.engine", "DeepSpeedEngine"),
    "DeepSpeedZeroOptimizer": ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"),
    "DeepSpeedZeroOptimizer_Stage3": ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"),
    "BF16_Optimizer": ("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer"),
    "FP16_Optimizer": ("deepspeed.runtime.fp16.fused_optimizer", "FP16_Optimizer"),
    "FP16_UnfusedOptimizer": ("deepspeed.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer"),
    "LRRangeTest": ("deepspeed.runtime.lr_schedules", "LRRangeTest"),
    "OneCycle": ("deepspeed.runtime.lr_schedules", "OneCycle"),
    "WarmupCosineLR": ("deepspeed.runtime.lr_schedules", "WarmupCosineLR"),
    "WarmupDecayLR": ("deepspeed.runtime.lr_schedules", "WarmupDecayLR"),
    "WarmupLR": ("deepspeed.runtime.lr_schedules", "WarmupLR"),
    "ACCELERATOR": ("deepspeed.accelerator.abstract_accelerator", "DeepSpeedAccelerator"),
    "CONFIG": ("deepspeed.runtime.config", "DeepSpeedConfig"),
}


# ---------------------------------------------------------------------------------------------------------------
# One module's names


def _module_of_path(rel):
    """deepspeed/a/b.py -> (deepspeed.a.b, False); deepspeed/a/__init__.py -> (deepspeed.a, True)."""
    parts = rel[:-3].split("/")
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _resolve(module, is_pkg, level, target):
    """The absolute module of `from <level dots><target> import ...` in `module`."""
    if level == 0:
        return target or ""
    base = module.split(".")
    if not is_pkg:
        base = base[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _top_statements(body):
    """The statements run at import: the module's, and those inside its top-level if/try/with blocks."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _top_statements(node.body)
            yield from _top_statements(node.orelse)
        elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            yield from _top_statements(node.body)
            for h in node.handlers:
                yield from _top_statements(h.body)
            yield from _top_statements(node.orelse)
            yield from _top_statements(node.finalbody)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            yield from _top_statements(node.body)
        else:
            yield node


def _literal(node):
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None, False
    if isinstance(value, (set, frozenset)) or len(repr(value)) > LITERAL_LIMIT:
        return None, False
    try:  # only values whose repr reads back (no -0.0/inf/nan surprises)
        if ast.literal_eval(repr(value)) != value:
            return None, False
    except (ValueError, SyntaxError):
        return None, False
    return value, True


def _enum(node):
    """("e", mixin, members) for an Enum class whose body is only literal members (and a docstring)."""
    bases = [ast.unparse(b) for b in node.bases]
    enum_bases = {"Enum", "enum.Enum", "IntEnum", "enum.IntEnum"}
    if not any(b in enum_bases for b in bases) or node.keywords or node.decorator_list:
        return None
    mixin = "int" if any(b in ("IntEnum", "enum.IntEnum", "int") for b in bases) else (
        "str" if "str" in bases else "")
    members = []
    for stmt in node.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
            continue  # a docstring
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            value, ok = _literal(stmt.value)
            if ok and not stmt.targets[0].id.startswith("_"):
                members.append((stmt.targets[0].id, value))
                continue
        return None
    return ("e", mixin, tuple(members)) if members else None


def _targets(target):
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for t in target.elts:
            yield from _targets(t)
    elif isinstance(target, ast.Starred):
        yield from _targets(target.value)


FOREIGN = "x"  # a name bound by an import from another package: not recorded, but it makes a constant unknown
MUTATORS = {"append", "extend", "insert", "update", "setdefault", "pop", "popitem", "clear", "remove", "add",
            "discard"}


def _merge(old, new):
    """Two bindings of one name (an if/else, a try/except): the same entry, else the more general one."""
    if old is None or old == new:
        return new
    if FOREIGN in (old, new):
        other = new if old == FOREIGN else old
        # `try: import x / except ImportError: x = None`: the value depends on the machine; but a class, function
        # or DeepSpeed import beside another package's (`from op_builder.builder import OpBuilder` in a source tree,
        # functools' cached_property or its own) is still that
        return other if other in ("c", "f") or other[0] in ("i", "m") else "v"
    for kind in ("c", "f"):
        if kind in (old, new):
            return kind
    return "v"


def _changed_at_run_time(tree):
    """The names the module's code rebinds through `global` or changes in place (`N[k] = v`, `del N[k]`,
    `N.append(...)`, `N += ...`), anywhere in it: their import-time value is not the one a script reads."""
    changed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            changed.update(node.names)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            changed.add(node.target.id)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)) and \
                isinstance(node.value, ast.Name):
            changed.add(node.value.id)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in MUTATORS and isinstance(node.func.value, ast.Name):
            changed.add(node.func.value.id)
    return changed


def module_names(source, module, is_pkg, tree_modules):
    """{name: entry} for one module's source, plus its `import *` sources (absolute DeepSpeed module names)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}, []
    names, stars = {}, []
    straight = {id(node) for node in tree.body}  # run in order: a later binding replaces an earlier one
    star_in_branch, in_branch = False, set()  # `try: from .x import *` / `except: A = 1`: A is either

    def bind(name, entry):
        if not name.startswith("_"):
            names[name] = entry if id(node) in straight else _merge(names.get(name), entry)
            if id(node) not in straight:
                in_branch.add(name)

    for node in _top_statements(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            bind(node.name, "f")
        elif isinstance(node, ast.ClassDef):
            bind(node.name, _enum(node) or "c")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            if isinstance(node, ast.AnnAssign) and node.value is None:
                continue
            value, ok = _literal(node.value)
            if isinstance(node.value, ast.Name) and isinstance(names.get(node.value.id), tuple) and \
                    names[node.value.id][0] == "k":
                value, ok = names[node.value.id][1], True  # `A_DEFAULT = A_MODE`: another constant's value
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                simple = isinstance(t, ast.Name)
                for n in _targets(t):
                    bind(n, ("k", value) if ok and simple else "v")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "deepspeed":
                    continue  # `import deepspeed` itself
                if not a.name.startswith("deepspeed."):
                    bind(a.asname or a.name.split(".")[0], FOREIGN)
                elif a.asname:
                    bind(a.asname, ("m", a.name))
        elif isinstance(node, ast.ImportFrom):
            source_module = _resolve(module, is_pkg, node.level, node.module)
            if source_module != "deepspeed" and not source_module.startswith("deepspeed."):
                for a in node.names:
                    if a.name != "*":
                        bind(a.asname or a.name, FOREIGN)
                continue
            for a in node.names:
                if a.name == "*":
                    stars.append(source_module)
                    star_in_branch |= id(node) not in straight
                    continue
                sub = source_module + "." + a.name
                bind(a.asname or a.name, ("m", sub) if sub in tree_modules else ("i", source_module, a.name))
    changed = _changed_at_run_time(tree)
    for name, entry in list(names.items()):
        if entry == FOREIGN:
            del names[name]
        elif (name in changed or (star_in_branch and name in in_branch)) and isinstance(entry, tuple) and \
                entry[0] == "k":
            names[name] = "v"
    return names, stars


def tree_of(files):
    """{module: {name: entry}} (each module's own names), {module: [its `import *` sources]} and the packages,
    from {relative path: source} of a deepspeed tree."""
    modules, packages, stars = {}, set(), {}
    all_modules = set()
    for rel in files:
        module, is_pkg = _module_of_path(rel)
        all_modules.add(module)
        parts = module.split(".")
        for i in range(1, len(parts)):  # folders without __init__.py are (namespace) packages too
            all_modules.add(".".join(parts[:i]))
            packages.add(".".join(parts[:i]))
        if is_pkg:
            packages.add(module)
    for rel, source in files.items():
        module, is_pkg = _module_of_path(rel)
        modules[module], found = module_names(source, module, is_pkg, all_modules)
        if found:
            stars[module] = found
    for module in all_modules:
        modules.setdefault(module, {})
    return modules, stars, packages


def expanded(modules, stars):
    """Each module's names with its `import *` sources' names added (python/uckpt/_deepspeed_api.py does the
    same at run time)."""
    out = {m: dict(names) for m, names in modules.items()}
    changed = True
    while changed:
        changed = False
        for module, sources in stars.items():
            for src in sources:
                for name in list(out.get(src, {})):
                    if name not in out[module]:
                        sub = src + "." + name
                        out[module][name] = ("m", sub) if sub in modules else ("i", src, name)
                        changed = True
    return out


def encode(names, star_sources):
    """One module's record, grouped by kind (see the generated file's docstring)."""
    out = {}
    for kind in ("c", "f", "v"):
        listed = sorted(n for n, e in names.items() if e == kind)
        if listed:
            out[kind] = " ".join(listed)
    for kind in ("k", "e", "m"):
        table = {n: (e[1] if kind != "e" else e[1:]) for n, e in sorted(names.items())
                 if isinstance(e, tuple) and e[0] == kind}
        if table:
            out[kind] = table
    imports = {}
    for n, e in sorted(names.items()):
        if isinstance(e, tuple) and e[0] == "i":
            imports.setdefault(e[1], []).append(n if n == e[2] else f"{n}={e[2]}")
    if imports:
        out["i"] = {src: " ".join(v) for src, v in sorted(imports.items())}
    if star_sources:
        out["*"] = tuple(star_sources)
    return out


def class_members(files, module, cls, _seen=None):
    """The public names of a class: its methods, class attributes, and attributes its methods set on self, its
    DeepSpeed base classes' included (bases from other packages, such as torch's, are not DeepSpeed's names)."""
    seen = set() if _seen is None else _seen
    if (module, cls) in seen:
        return []
    seen.add((module, cls))
    rel = module.replace(".", "/")
    is_pkg = rel + "/__init__.py" in files
    source = files.get(rel + ".py") or files.get(rel + "/__init__.py")
    if source is None:
        return None
    tree = ast.parse(source)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    imported = {}
    for node in _top_statements(tree.body):
        if isinstance(node, ast.ImportFrom):
            src = _resolve(module, is_pkg, node.level, node.module)
            if src == "deepspeed" or src.startswith("deepspeed."):
                for a in node.names:
                    imported[a.asname or a.name] = (src, a.name)
    if cls not in classes:
        if cls in imported:  # a class this module re-exports
            return class_members(files, *imported[cls], seen)
        return None
    node = classes[cls]
    names = set()
    for base in node.bases:
        b = ast.unparse(base)
        if b in classes:
            names.update(class_members(files, module, b, seen) or ())
        elif b in imported:
            names.update(class_members(files, *imported[b], seen) or ())
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(stmt.name)
            for sub in ast.walk(stmt):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and \
                        isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    names.add(sub.attr)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]):
                names.update(_targets(t))
    return sorted(n for n in names if not n.startswith("_"))


# ---------------------------------------------------------------------------------------------------------------
# Sources: an installed package, or a release tag of the repository


def files_in_dir(root):
    """{relative path: source} of the `deepspeed` package under root."""
    out = {}
    base = os.path.join(root, "deepspeed")
    if not os.path.isfile(os.path.join(base, "__init__.py")):
        sys.exit(f"{root}: no deepspeed/__init__.py there")
    for folder, dirs, files in os.walk(base):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                with open(path, encoding="utf-8", errors="replace") as fh:
                    out[os.path.relpath(path, root).replace(os.sep, "/")] = fh.read()
    return out


def version_in_dir(root):
    for name in ("git_version_info_installed.py", "git_version_info.py"):
        path = os.path.join(root, "deepspeed", name)
        if os.path.isfile(path):
            m = re.search(r"^version\s*=\s*['\"]([^'\"]+)", open(path).read(), re.M)
            if m:
                return m.group(1)
    path = os.path.join(root, "version.txt")
    return open(path).read().strip() if os.path.isfile(path) else None


def files_at(git_dir, rev):
    """{relative path: source} of deepspeed/ (and op_builder/, installed as deepspeed/ops/op_builder) at rev."""
    listing = subprocess.run(["git", "--git-dir", git_dir, "ls-tree", "-r", rev, "--", "deepspeed", "op_builder"],
                             check=True, capture_output=True, text=True).stdout
    wanted = []
    for line in listing.splitlines():
        meta, path = line.split("\t", 1)
        mode, kind, sha = meta.split()
        if kind != "blob" or mode == "120000" or not path.endswith(".py"):
            continue
        rel = "deepspeed/ops/" + path if path.startswith("op_builder/") else path
        wanted.append((rel, sha))
    batch = subprocess.run(["git", "--git-dir", git_dir, "cat-file", "--batch"], check=True, capture_output=True,
                           input="".join(sha + "\n" for _, sha in wanted).encode()).stdout
    out, pos = {}, 0
    for rel, _ in wanted:
        header_end = batch.index(b"\n", pos)
        size = int(batch[pos:header_end].split()[2])
        out[rel] = batch[header_end + 1:header_end + 1 + size].decode("utf-8", errors="replace")
        pos = header_end + 1 + size + 1
    return out


def later_releases(git_dir):
    tags = subprocess.run(["git", "--git-dir", git_dir, "tag", "--list", "v*"], check=True, capture_output=True,
                          text=True).stdout.split()
    def key(t):
        return tuple(int(x) for x in re.findall(r"\d+", t)[:3])
    tags = [t for t in tags if re.fullmatch(r"v\d+\.\d+\.\d+", t) and key(t) > (0, 14, 5)]
    return sorted(tags, key=key) + ["HEAD"]


# ---------------------------------------------------------------------------------------------------------------
# Output


def generate(root, git_dir=None, previous_later=None):
    """The generated file's tables: {module: record}, packages, class members, and the later releases' part."""
    files = files_in_dir(root)
    modules, stars, packages = tree_of(files)
    records = {m: encode(modules[m], stars.get(m)) for m in modules}
    classes = {key: class_members(files, m, c) for key, (m, c) in CLASSES.items()}
    later_modules, later_names, later_members = {}, {}, {}
    if git_dir:
        ours = expanded(modules, stars)
        for rev in later_releases(git_dir):
            version = rev[1:] if rev != "HEAD" else "HEAD"
            print(f"reading {rev}", file=sys.stderr)
            at = files_at(git_dir, rev)
            theirs = expanded(*tree_of(at)[:2])
            for m, names in theirs.items():
                if m not in ours:
                    later_modules.setdefault(m, version)
                    continue
                for n in names:
                    if n not in ours[m]:
                        later_names.setdefault(m, {}).setdefault(n, version)
            for key, (m, c) in CLASSES.items():
                for n in class_members(at, m, c) or []:
                    if classes[key] is not None and n not in classes[key]:
                        later_members.setdefault(key, {}).setdefault(n, version)
    elif previous_later is not None:
        later_modules, later_names, later_members = previous_later
        later_names = {m: {n: v for v, names in by.items() for n in names.split()} for m, by in later_names.items()}
        later_members = {k: {n: v for v, names in by.items() for n in names.split()} for k, by in later_members.items()}
    # A module inside a new package is named by the package's release (importing it imports the package first).
    def new_ancestor(m):
        parts = m.split(".")
        return any(".".join(parts[:i]) in later_modules for i in range(1, len(parts)))
    later_modules = {m: v for m, v in later_modules.items() if not new_ancestor(m)}
    return records, packages, classes, later_modules, later_names, later_members


HEADER = '''"""DeepSpeed {version}'s module tree and its names, generated by scripts/deepspeed_api.py from DeepSpeed's
source: do not edit. tests/python/deepspeed_api_test.py regenerates the {version} part from the installed DeepSpeed
and fails when it differs. uckpt/_deepspeed_api.py makes every module and name here importable from uckpt: those
uckpt implements are its own, the others are refused by name when used.

MODULES: {{module: record}}; a record groups the module's public top-level names by kind:
  "c" classes, "f" functions, "v" other values (space-separated names); "k" {{name: literal constant}};
  "e" {{name: (mixin, ((member, value), ...))}} enums; "m" {{name: DeepSpeed module}};
  "i" {{DeepSpeed module: "name name alias=name"}} names imported from another DeepSpeed module;
  "*" (DeepSpeed modules imported with `import *`, whose names are the module's too).
PACKAGES: the modules that are packages.
CLASSES: the public methods and attributes of the DeepSpeed classes whose objects uckpt stands in for.
LATER_MODULES {{module: release}}, LATER_NAMES {{module of {version}: {{release: "names"}}}}, LATER_MEMBERS {{class key:
{{release: "names"}}}}: what first appears in a release after {version} ("HEAD": in none yet).
"""
# flake8: noqa
VERSION = {version!r}
'''


def _wrap(items, indent):
    lines, line = [], indent
    for item in items:
        if len(line) + len(item) + 1 > 118 and line.strip():
            lines.append(line.rstrip())
            line = indent
        line += item + " "
    if line.strip():
        lines.append(line.rstrip())
    return lines


def _grouped(table):
    """{key: {name: release}} -> {key: {release: "names"}}."""
    out = {}
    for key, names in table.items():
        by = {}
        for n, v in sorted(names.items()):
            by.setdefault(v, []).append(n)
        out[key] = {v: " ".join(ns) for v, ns in by.items()}
    return out


def render(records, packages, classes, later_modules, later_names, later_members):
    out = [HEADER.format(version=VERSION), "MODULES = {\n"]
    for m in sorted(records):
        out.append(f"    {m!r}: {{\n")
        for kind, value in records[m].items():
            if isinstance(value, str):
                words = value.split()
                lines = _wrap(words, "")
                if len(lines) == 1:
                    out.append(f"        {kind!r}: {lines[0]!r},\n")
                else:
                    out.append(f"        {kind!r}: (\n")
                    for i, ln in enumerate(lines):
                        out.append(f"            {ln + (' ' if i + 1 < len(lines) else '')!r}\n")
                    out.append("        ),\n")
            elif isinstance(value, dict):
                out.append(f"        {kind!r}: {{\n")
                for k, v in value.items():
                    out.append(f"            {k!r}: {v!r},\n")
                out.append("        },\n")
            else:
                out.append(f"        {kind!r}: {value!r},\n")
        out.append("    },\n")
    out.append("}\n\nPACKAGES = frozenset(\"\"\"\n")
    out.extend(ln + "\n" for ln in _wrap(sorted(packages), ""))
    out.append("\"\"\".split())\n\nCLASSES = {\n")
    for key in sorted(classes):
        out.append(f"    {key!r}: frozenset(\"\"\"\n")
        out.extend(ln + "\n" for ln in _wrap(classes[key] or [], ""))
        out.append("\"\"\".split()),\n")
    out.append("}\n\nLATER_MODULES = {\n")
    for k in sorted(later_modules):
        out.append(f"    {k!r}: {later_modules[k]!r},\n")
    out.append("}\n")
    for title, table in (("LATER_NAMES", _grouped(later_names)), ("LATER_MEMBERS", _grouped(later_members))):
        out.append(f"\n{title} = {{\n")
        for k in sorted(table):
            out.append(f"    {k!r}: {{\n")
            for v, names in table[k].items():
                out.append(f"        {v!r}: {names!r},\n")
            out.append("    },\n")
        out.append("}\n")
    return "".join(out)


def load_generated(path):
    namespace = {}
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), namespace)  # our own generated file: literals only
    return namespace


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("deepspeed_dir", help="the folder holding DeepSpeed 0.14.5's `deepspeed` package")
    ap.add_argument("--later", metavar="GIT_DIR", help="DeepSpeed's git repository, for the releases after 0.14.5")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--check", metavar="FILE", help="compare FILE's 0.14.5 part with the source; exit 1 if it differs")
    args = ap.parse_args()
    found = version_in_dir(args.deepspeed_dir)
    if found is not None and found.split("+")[0] != VERSION:
        sys.exit(f"{args.deepspeed_dir}: DeepSpeed {found}, not {VERSION}")
    if args.check:
        have = load_generated(args.check)
        records, packages, classes, *_ = generate(args.deepspeed_dir)
        diffs = []
        for m in sorted(set(records) | set(have["MODULES"])):
            a, b = records.get(m), have["MODULES"].get(m)
            if a is None or b is None:
                diffs.append(f"module {m}: {'not in ' + args.check if b is None else 'not in DeepSpeed ' + VERSION}")
            elif a != b:
                diffs.append(f"module {m}: DeepSpeed {a!r}\n  {os.path.basename(args.check)} {b!r}")
        if packages != set(have["PACKAGES"]):
            diffs.append(f"packages differ: {sorted(packages ^ set(have['PACKAGES']))}")
        for key in sorted(classes):
            theirs, ours = frozenset(classes[key] or ()), have["CLASSES"].get(key, frozenset())
            if theirs != ours:
                diffs.append(f"class {key}: differs in {sorted(theirs ^ ours)}")
        for d in diffs[:50]:
            print(d)
        if diffs:
            print(f"{len(diffs)} differences: regenerate with scripts/deepspeed_api.py {args.deepspeed_dir} "
                  "--later DEEPSPEED_GIT_DIR")
            sys.exit(1)
        print(f"{args.check}: the modules, names and class members of DeepSpeed {VERSION} ({len(records)} modules)")
        return
    previous = None
    if not args.later and os.path.isfile(args.out):  # keep the later releases' part already there
        have = load_generated(args.out)
        previous = (have["LATER_MODULES"], have["LATER_NAMES"], have["LATER_MEMBERS"])
    text = render(*generate(args.deepspeed_dir, args.later, previous))
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
