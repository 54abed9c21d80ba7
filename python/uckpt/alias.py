"""A `deepspeed` that is uckpt, for libraries that import `deepspeed` themselves (opt-in).

Hugging Face's Trainer, Accelerate, PEFT and TRL import `deepspeed` on their own and check that a
distribution named `deepspeed` is installed. Scripts of your own need none of this: they write
`import uckpt as deepspeed`. For the libraries, uckpt installs a small second distribution named
`deepspeed`, version ``0.14.5+uckpt.<uckpt's version>`` (it compares as DeepSpeed 0.14.5 in their
version checks, and says that it is uckpt), whose `import deepspeed` gives the module `uckpt`
itself, and `deepspeed.X.Y` the module `uckpt.X.Y` (the same objects):

    python -m uckpt.alias install    # refuses when a real DeepSpeed is installed, naming it
    python -m uckpt.alias status     # what `import deepspeed` gives in this Python
    python -m uckpt.alias remove     # removes the alias only, never a real DeepSpeed

Each acts on the Python that runs it (its environment, as `python -m pip` does). See docs/hf.md.
"""
import base64
import hashlib
import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

import uckpt

DEEPSPEED_VERSION = "0.14.5"  # the DeepSpeed whose API uckpt answers
DIST_NAME = "deepspeed"
LOCAL_PREFIX = "uckpt."  # the local version label: 0.14.5+uckpt.<uckpt's version>

# The alias distribution's only module, deepspeed/__init__.py (python/deepspeed_alias/deepspeed/__init__.py
# holds the same text; tests/python/alias_test.py checks that they agree).
ALIAS_INIT = '''\
"""deepspeed, as uckpt: `import deepspeed` gives the module uckpt and `deepspeed.X` the module uckpt.X.

Installed by `python -m uckpt.alias install` (uckpt's docs/hf.md); removed by `python -m uckpt.alias remove`
(or `pip uninstall deepspeed`). This is not Microsoft's DeepSpeed.
"""
try:
    from uckpt.alias import activate as _activate
except ImportError as _e:
    raise ImportError(
        "deepspeed: this 'deepspeed' (%s) is uckpt's alias, installed by `python -m uckpt.alias install`, "
        "and `import uckpt` failed: %s. Make uckpt importable in this Python, or remove the alias with "
        "`python -m pip uninstall deepspeed`." % (__file__, _e), name="deepspeed") from _e
_activate()
'''


def alias_version():
    """The alias distribution's version: DeepSpeed's 0.14.5 with uckpt's version as its local label."""
    return f"{DEEPSPEED_VERSION}+{LOCAL_PREFIX}{uckpt.__version__}"


# ---------------------------------------------------------------------------------------------------------------
# The import side: `deepspeed` is the module uckpt; `deepspeed.X` is uckpt.X.


class _DeepSpeedAsUckpt(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `deepspeed.X.Y` as the module `uckpt.X.Y` (imported under its own name, the same object in
    sys.modules under both names). A name uckpt has no module for is not found, as Python reports it
    (`No module named 'deepspeed.X'`), so availability checks through importlib.util.find_spec get None."""

    def __init__(self):
        self._specs = {}  # deepspeed.X -> uckpt.X's own spec, put back after the import system sets ours

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(DIST_NAME + ".") or sys.modules.get(DIST_NAME) is not uckpt:
            return None
        name = "uckpt" + fullname[len(DIST_NAME):]
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module("uckpt" + spec.name[len(DIST_NAME):])
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        # The import system set module.__spec__ to the alias's spec; uckpt's module keeps its own.
        spec = self._specs.pop(module.__name__.replace("uckpt", DIST_NAME, 1), None)
        if spec is not None:
            module.__spec__ = spec


def activate():
    """Makes `deepspeed` the module uckpt in this interpreter (what the alias's deepspeed/__init__.py calls)."""
    sys.modules[DIST_NAME] = uckpt
    if not any(isinstance(f, _DeepSpeedAsUckpt) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeepSpeedAsUckpt())


# ---------------------------------------------------------------------------------------------------------------
# The command: install, remove, status.


class Refused(Exception):
    """A command that refused to act; its message says why and what to do."""


def _is_alias(dist):
    version = dist.version or ""
    return "+" in version and version.split("+", 1)[1].startswith(LOCAL_PREFIX)


def _deepspeed_dists():
    """Every distribution named deepspeed that this Python sees, in sys.path order (the first one wins)."""
    seen, found = set(), []
    for dist in importlib.metadata.distributions(name=DIST_NAME):
        where = str(dist.locate_file(""))
        key = (os.path.realpath(where), dist.version)
        if key not in seen:
            seen.add(key)
            found.append(dist)
    return found


def _where(dist):
    return os.path.realpath(str(dist.locate_file("")))


def _module_origin():
    """Where `import deepspeed` would load from in a fresh interpreter, without importing it."""
    spec = importlib.util.find_spec(DIST_NAME) if DIST_NAME not in sys.modules else None
    if spec is None and DIST_NAME in sys.modules:
        return getattr(sys.modules[DIST_NAME], "__file__", None)
    return spec.origin if spec is not None else None


def _alias_dir(dist):
    return os.path.join(_where(dist), DIST_NAME)


def _how_to_proceed(python):
    return ("To use uckpt where libraries import deepspeed themselves, make a virtual environment without "
            f"DeepSpeed for it (`{python} -m venv ENV`, install uckpt and its requirements there, then "
            "`ENV/bin/python -m uckpt.alias install`), or remove DeepSpeed from this one first "
            f"(`{python} -m pip uninstall deepspeed`). Your own scripts need no alias: "
            "`import uckpt as deepspeed`.")


def _refuse_real_deepspeed(dists, python):
    real = [d for d in dists if not _is_alias(d)]
    if real:
        d = real[0]
        raise Refused(f"a real DeepSpeed is installed for {python}: deepspeed {d.version} in {_where(d)}. "
                      "Installing uckpt's alias would replace it (pip would do so without a word), so "
                      f"nothing was changed. {_how_to_proceed(python)}")
    origin = _module_origin()
    mine = [os.path.realpath(_alias_dir(d)) for d in dists]
    if origin is not None and not any(os.path.realpath(origin).startswith(m + os.sep) for m in mine):
        raise Refused(f"`import deepspeed` in {python} loads {origin}, which no installed distribution named "
                      "deepspeed holds (a DeepSpeed source on PYTHONPATH or sys.path?). An alias would be "
                      f"hidden by it or hide it, so nothing was changed. Take it off the path first, then run "
                      "this command again; your own scripts need no alias: `import uckpt as deepspeed`.")


def _record_hash(data):
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def build_wheel(out_dir):
    """Writes the alias distribution as a wheel into out_dir; returns its path."""
    version = alias_version()
    info = f"{DIST_NAME}-{version}.dist-info"
    files = {
        f"{DIST_NAME}/__init__.py": ALIAS_INIT.encode(),
        f"{info}/METADATA": (
            "Metadata-Version: 2.1\n"
            f"Name: {DIST_NAME}\n"
            f"Version: {version}\n"
            "Summary: uckpt's alias: `import deepspeed` is uckpt, which answers DeepSpeed "
            f"{DEEPSPEED_VERSION}'s API (not Microsoft's DeepSpeed)\n"
            "Author: uckpt\n"
            "License: Apache-2.0\n"
            "Requires-Python: >=3.8\n"
            "\n"
            "Installed by `python -m uckpt.alias install`, removed by `python -m uckpt.alias remove`.\n").encode(),
        f"{info}/WHEEL": ("Wheel-Version: 1.0\nGenerator: uckpt.alias\nRoot-Is-Purelib: true\n"
                          "Tag: py3-none-any\n").encode(),
        f"{info}/top_level.txt": f"{DIST_NAME}\n".encode(),
    }
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in files.items())
    record += f"{info}/RECORD,,\n"
    files[f"{info}/RECORD"] = record.encode()
    path = os.path.join(out_dir, f"{DIST_NAME}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as whl:
        for name, data in files.items():
            whl.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data)
    return path


def _check_in_fresh_interpreter(python):
    """`import deepspeed` in a new interpreter of this Python: (ok, what it said)."""
    code = ("import importlib.metadata, deepspeed, uckpt, deepspeed.runtime.engine as e;"
            "assert deepspeed is uckpt and e is uckpt.runtime.engine, 'deepspeed is not uckpt';"
            "print(importlib.metadata.version('deepspeed'), uckpt.__file__)")
    run = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return run.returncode == 0, (run.stdout + run.stderr).strip()


def _uckpt_note(site):
    here = os.path.dirname(os.path.dirname(os.path.realpath(uckpt.__file__)))
    if os.path.realpath(site) != here:
        return (f"note: uckpt itself is imported from {here}, not from {site}: `import deepspeed` works where "
                "`import uckpt` does (keep it on PYTHONPATH, or install uckpt into this environment).")
    return None


def install(python=sys.executable):
    dists = _deepspeed_dists()
    _refuse_real_deepspeed(dists, python)
    version = alias_version()
    for d in dists:
        if d.version == version:
            ok, said = _check_in_fresh_interpreter(python)
            if ok:
                print(f"uckpt.alias: deepspeed {version} (uckpt's alias) is already installed in {_where(d)}")
                return 0
    if importlib.util.find_spec("pip") is None:
        raise Refused(f"pip is not available to {python}, which installs the alias "
                      f"(`{python} -m ensurepip` provides it); nothing was changed")
    for d in dists:  # an alias of another uckpt version: replaced
        _remove_alias(d)
    with tempfile.TemporaryDirectory(prefix="uckpt-alias-") as tmp:
        wheel = build_wheel(tmp)
        run = subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--no-cache-dir",
                              "--disable-pip-version-check", "--quiet", wheel])
    if run.returncode != 0:
        raise Refused(f"pip failed to install the alias's wheel (exit {run.returncode}, its output above)")
    importlib.invalidate_caches()
    ok, said = _check_in_fresh_interpreter(python)
    if not ok:
        raise Refused(f"the alias was installed but `import deepspeed` fails in a new interpreter:\n{said}\n"
                      f"Remove it with `{python} -m uckpt.alias remove`.")
    site = next((_where(d) for d in _deepspeed_dists() if _is_alias(d)), "?")
    print(f"uckpt.alias: installed deepspeed {version} (uckpt's alias) into {site}; `import deepspeed` is uckpt. "
          f"Remove it with `{python} -m uckpt.alias remove`.")
    note = _uckpt_note(site)
    if note:
        print("uckpt.alias: " + note)
    return 0


def _remove_alias(dist):
    """Deletes the files the alias's RECORD lists (and their byte-code), then its emptied folders."""
    where = _where(dist)
    files = [str(f) for f in (dist.files or [])]
    allowed = (f"{DIST_NAME}/", f"{DIST_NAME}-")
    odd = [f for f in files if not f.startswith(allowed) or ".." in f.split("/")]
    if not files or odd:
        raise Refused(f"the deepspeed {dist.version} in {where} lists files outside an alias's "
                      f"({', '.join(odd[:3]) or 'none at all'}); it was not removed")
    infos = {f.split("/", 1)[0] for f in files if f.startswith(f"{DIST_NAME}-")}
    for f in files:
        path = os.path.join(where, f)
        if os.path.isfile(path) or os.path.islink(path):
            os.remove(path)
    for folder in (os.path.join(where, DIST_NAME, "__pycache__"), os.path.join(where, DIST_NAME)):
        if os.path.isdir(folder):
            if folder.endswith("__pycache__"):
                shutil.rmtree(folder)
            elif not os.listdir(folder):
                os.rmdir(folder)
            else:
                raise Refused(f"{folder} holds files the alias did not install ({', '.join(os.listdir(folder))}); "
                              "they were left in place")
    for info in infos:  # what RECORD does not list (pip's INSTALLER, REQUESTED, direct_url.json)
        if os.path.isdir(os.path.join(where, info)) and info.endswith(".dist-info"):
            shutil.rmtree(os.path.join(where, info))
    importlib.invalidate_caches()


def remove(python=sys.executable):
    dists = _deepspeed_dists()
    mine = [d for d in dists if _is_alias(d)]
    real = [d for d in dists if not _is_alias(d)]
    if not mine:
        extra = f"; the deepspeed {real[0].version} in {_where(real[0])} is DeepSpeed's and stays" if real else ""
        print(f"uckpt.alias: no alias is installed for {python}{extra}")
        return 0
    for d in mine:
        version, where = d.version, _where(d)
        _remove_alias(d)
        print(f"uckpt.alias: removed deepspeed {version} (uckpt's alias) from {where}")
    if real:
        print(f"uckpt.alias: the deepspeed {real[0].version} in {_where(real[0])} is DeepSpeed's and stays")
    return 0


def status(python=sys.executable):
    dists = _deepspeed_dists()
    mine = [d for d in dists if _is_alias(d)]
    real = [d for d in dists if not _is_alias(d)]
    for d in real:
        print(f"uckpt.alias: DeepSpeed {d.version} is installed in {_where(d)}")
    if not mine:
        print(f"uckpt.alias: no alias is installed for {python} (`{python} -m uckpt.alias install` installs it)")
        return 1
    d = mine[0]
    print(f"uckpt.alias: deepspeed {d.version} (uckpt's alias) is installed in {_where(d)}")
    if dists[0] is not d:
        print(f"uckpt.alias: but `import deepspeed` finds DeepSpeed's first ({_where(dists[0])})")
        return 1
    if d.version != alias_version():
        print(f"uckpt.alias: it is for another uckpt ({d.version}; this one's is {alias_version()}): "
              f"run `{python} -m uckpt.alias install` again")
        return 1
    ok, said = _check_in_fresh_interpreter(python)
    print(f"uckpt.alias: `import deepspeed` in a new interpreter: {'uckpt, ' if ok else 'FAILS: '}{said}")
    note = _uckpt_note(_where(d))
    if note:
        print("uckpt.alias: " + note)
    return 0 if ok else 1


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    commands = {"install": install, "remove": remove, "status": status}
    if len(argv) != 1 or argv[0] not in commands:
        print("usage: python -m uckpt.alias install | remove | status\n\n" + "\n\n".join(__doc__.split("\n\n")[1:4]),
              file=sys.stderr)
        return 2
    try:
        return commands[argv[0]]()
    except Refused as e:
        print(f"uckpt.alias {argv[0]}: refused: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
