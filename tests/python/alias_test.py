"""The `deepspeed` alias of uckpt (`python -m uckpt.alias install | remove | status`), in throwaway venvs.

    alias_test.py CASE PYPATH WORK_DIR

files    python/deepspeed_alias (the repository's distribution) agrees with uckpt/alias.py: the same
         deepspeed/__init__.py and version; the wheel the command builds has a RECORD that verifies.
install  a venv over the tests' packages without DeepSpeed: before, `import deepspeed` fails and
         `import uckpt as deepspeed` works; install; `import deepspeed` is uckpt and every `deepspeed.X`
         the module uckpt.X (the same objects, whichever name is imported first, uckpt's modules keeping
         their own __spec__), a name uckpt lacks not found (find_spec None, ModuleNotFoundError naming it);
         transformers', Accelerate's and TRL's availability checks accept it, their version checks compare
         it as 0.14.5; install again is a no-op; remove takes exactly the alias's files, and again is a no-op.
refuse   a venv where real DeepSpeed is installed: install refuses naming it, its path and how to proceed,
         changing nothing; remove leaves DeepSpeed in place; a `deepspeed` folder on PYTHONPATH (no
         distribution) is refused too, naming its path.
"""
import hashlib
import base64
import os
import re
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from hf_env import make_venv, run  # noqa: E402
from testkit import fail  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))

# Run inside the venv after install: what the libraries and scripts do with `deepspeed`.
CHECK_ALIAS = r'''
import importlib, importlib.metadata, importlib.util, sys
import uckpt.runtime.lr_schedules            # imported under uckpt's name first: deepspeed.X is the same object
import deepspeed
assert deepspeed is uckpt, deepspeed
assert importlib.util.find_spec("deepspeed") is not None
import deepspeed.runtime.zero.partition_parameters as pp
import uckpt.runtime.zero.partition_parameters as upp
assert pp is upp, (pp, upp)
assert sys.modules["deepspeed.runtime.zero.partition_parameters"] is upp
assert upp.__spec__.name == "uckpt.runtime.zero.partition_parameters", upp.__spec__
assert uckpt.runtime.__spec__.name == "uckpt.runtime", uckpt.runtime.__spec__
from deepspeed.ops.adam import FusedAdam, DeepSpeedCPUAdam
import uckpt.ops.adam
assert FusedAdam is uckpt.ops.adam.FusedAdam and DeepSpeedCPUAdam is uckpt.ops.adam.DeepSpeedCPUAdam
assert deepspeed.runtime.lr_schedules is sys.modules["uckpt.runtime.lr_schedules"]
from deepspeed.runtime.engine import DeepSpeedEngine
assert DeepSpeedEngine is uckpt.runtime.engine.DeepSpeedEngine
assert deepspeed.zero.GatheredParameters is uckpt.zero.GatheredParameters
assert importlib.util.find_spec("deepspeed.no_such_module") is None
try:
    import deepspeed.no_such_module
    raise AssertionError("deepspeed.no_such_module imported")
except ModuleNotFoundError as e:
    assert e.name == "deepspeed.no_such_module" and "deepspeed.no_such_module" in str(e), e
assert importlib.metadata.version("deepspeed") == "0.14.5+uckpt." + uckpt.__version__

# The libraries' own checks (transformers 5.x, Accelerate 1.x, TRL), as they call them.
from transformers.integrations.deepspeed import is_deepspeed_available as tf_available
from transformers.dependency_versions_check import dep_version_check
assert tf_available() is True
dep_version_check("deepspeed")                       # transformers' deepspeed>=0.9.3
from accelerate.utils import is_deepspeed_available as acc_available, compare_versions
assert acc_available() is True
assert compare_versions("deepspeed", ">=", "0.14.4")     # Accelerate calls engine.compile from here on
assert compare_versions("deepspeed", "<", "0.14.5") is False
assert compare_versions("deepspeed", "<", "0.15.2") and compare_versions("deepspeed", "<", "0.16.4")
assert compare_versions("deepspeed", ">=", "0.14.5")
from trl.import_utils import is_deepspeed_available as trl_available
assert trl_available() is True
from packaging.specifiers import SpecifierSet
assert importlib.metadata.version("deepspeed") in SpecifierSet("==0.14.5")
print("ALIAS OK")
'''


def check_files(pypath, work):
    sys.path.insert(0, pypath)
    import uckpt.alias as alias
    with open(os.path.join(REPO, "python", "deepspeed_alias", "deepspeed", "__init__.py")) as f:
        if f.read() != alias.ALIAS_INIT:
            fail("python/deepspeed_alias/deepspeed/__init__.py differs from uckpt/alias.py's ALIAS_INIT")
    with open(os.path.join(REPO, "python", "deepspeed_alias", "pyproject.toml")) as f:
        versions = re.findall(r'^version = "([^"]+)"', f.read(), re.M)
    if versions != [alias.alias_version()]:
        fail(f"python/deepspeed_alias/pyproject.toml's version {versions} is not {alias.alias_version()}")
    if not re.fullmatch(r"0\.14\.5\+uckpt\.[0-9a-z.]+", alias.alias_version()):
        fail(f"alias version {alias.alias_version()!r} is not 0.14.5+uckpt.<version>")
    os.makedirs(work, exist_ok=True)
    wheel = alias.build_wheel(work)
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        info = f"deepspeed-{alias.alias_version()}.dist-info"
        want = {"deepspeed/__init__.py", f"{info}/METADATA", f"{info}/WHEEL", f"{info}/RECORD", f"{info}/top_level.txt"}
        if names != want:
            fail(f"wheel holds {sorted(names)}, not {sorted(want)}")
        rows = [line.split(",") for line in whl.read(f"{info}/RECORD").decode().splitlines()]
        for name, digest, size in rows:
            if name == f"{info}/RECORD":
                continue
            data = whl.read(name)
            good = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            if digest != good or int(size) != len(data):
                fail(f"RECORD's row for {name} does not match its bytes")
        meta = whl.read(f"{info}/METADATA").decode()
        if "Name: deepspeed\n" not in meta or f"Version: {alias.alias_version()}\n" not in meta:
            fail("METADATA lacks the name or the version:\n" + meta)
    print("files: OK")


def expect(done, rc, *texts, what):
    out = done.stdout + done.stderr
    if done.returncode != rc:
        fail(f"{what}: exit {done.returncode}, expected {rc}:\n{out}")
    for t in texts:
        if t not in out:
            fail(f"{what}: the output does not say {t!r}:\n{out}")
    print(f"{what}: exit {rc} as expected: {out.strip().splitlines()[-1] if out.strip() else ''}")
    return out


def site_of(python, pypath):
    return run(python, ["-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], pypath,
               check=True).stdout.strip()


def check_install(pypath, work):
    python = make_venv(os.path.join(work, "venv"))
    site = site_of(python, pypath)
    done = run(python, ["-c", "import deepspeed"], pypath)
    expect(done, 1, "No module named 'deepspeed'", what="import deepspeed before install")
    run(python, ["-c", "import uckpt as deepspeed; deepspeed.initialize"], pypath, check=True)
    expect(run(python, ["-m", "uckpt.alias", "status"], pypath), 1, "no alias is installed", what="status before")
    expect(run(python, ["-m", "uckpt.alias", "instal"], pypath), 2, "usage: python -m uckpt.alias install | remove | status",
           what="an unknown command")
    before = set(os.listdir(site))
    out = expect(run(python, ["-m", "uckpt.alias", "install"], pypath), 0, "installed deepspeed 0.14.5+uckpt.",
                 what="install")
    added = set(os.listdir(site)) - before
    if {a for a in added if not a.startswith("deepspeed")} or len(added) != 2:
        fail(f"install added {sorted(added)} to {site}, not deepspeed/ and its dist-info")
    if site not in out:
        fail(f"install does not name the folder it installed into ({site}):\n{out}")
    expect(run(python, ["-m", "uckpt.alias", "status"], pypath), 0, "(uckpt's alias) is installed",
           "`import deepspeed` in a new interpreter: uckpt", what="status after")
    expect(run(python, ["-c", CHECK_ALIAS], pypath), 0, "ALIAS OK", what="deepspeed is uckpt")
    # Without uckpt importable, `import deepspeed` says what it is and how to remove it.
    done = run(python, ["-c", "import deepspeed"], "", env={"PYTHONNOUSERSITE": "1"})
    expect(done, 1, "uckpt's alias", "pip uninstall deepspeed", what="import deepspeed without uckpt")
    expect(run(python, ["-m", "uckpt.alias", "install"], pypath), 0, "already installed", what="install again")
    expect(run(python, ["-m", "uckpt.alias", "remove"], pypath), 0, "removed deepspeed 0.14.5+uckpt.",
           what="remove")
    if set(os.listdir(site)) != before:
        fail(f"remove left {sorted(set(os.listdir(site)) ^ before)} in {site}")
    expect(run(python, ["-c", "import deepspeed"], pypath), 1, "No module named 'deepspeed'",
           what="import deepspeed after remove")
    expect(run(python, ["-m", "uckpt.alias", "remove"], pypath), 0, "no alias is installed", what="remove again")
    print("install: OK")


def tree(folder):
    return sorted((os.path.relpath(os.path.join(d, f), folder), os.path.getmtime(os.path.join(d, f)))
                  for d, _, files in os.walk(folder) for f in files if "__pycache__" not in d)


def check_refuse(pypath, work):
    python = make_venv(os.path.join(work, "venv-ds"), with_deepspeed=True)
    site = site_of(python, pypath)
    found = run(python, ["-c", "import importlib.metadata as m; d = m.distribution('deepspeed');"
                         "print(d.version); print(d.locate_file(''))"], pypath)
    if found.returncode != 0:
        print("refuse: real DeepSpeed is not installed in the tests' Python; skipped")
        sys.exit(77)
    version, ds_site = found.stdout.split()
    real_before = tree(os.path.join(ds_site, "deepspeed"))
    before = set(os.listdir(site))
    out = expect(run(python, ["-m", "uckpt.alias", "install"], pypath), 1, "refused", "a real DeepSpeed is installed",
                 f"deepspeed {version} in {os.path.realpath(ds_site)}", "pip uninstall deepspeed",
                 "import uckpt as deepspeed", "nothing was changed", what="install over DeepSpeed")
    if set(os.listdir(site)) != before:
        fail(f"the refused install changed {site}: {sorted(set(os.listdir(site)) ^ before)}")
    expect(run(python, ["-m", "uckpt.alias", "remove"], pypath), 0, "is DeepSpeed's and stays",
           what="remove over DeepSpeed")
    expect(run(python, ["-m", "uckpt.alias", "status"], pypath), 1, f"DeepSpeed {version} is installed",
           what="status over DeepSpeed")
    if tree(os.path.join(ds_site, "deepspeed")) != real_before:
        fail("DeepSpeed's files changed")
    del out
    # A `deepspeed` package on PYTHONPATH that no distribution holds (a source checkout): refused, naming it.
    python = make_venv(os.path.join(work, "venv-src"))
    src = os.path.join(work, "src")
    os.makedirs(os.path.join(src, "deepspeed"), exist_ok=True)
    open(os.path.join(src, "deepspeed", "__init__.py"), "w").close()
    site = site_of(python, pypath)
    before = set(os.listdir(site))
    expect(run(python, ["-m", "uckpt.alias", "install"], f"{pypath}{os.pathsep}{src}"), 1, "refused",
           os.path.join(src, "deepspeed", "__init__.py"), what="install over a deepspeed on PYTHONPATH")
    if set(os.listdir(site)) != before:
        fail("the refused install changed the venv")
    print("refuse: OK")


def main():
    case, pypath, work = sys.argv[1:4]
    os.makedirs(work, exist_ok=True)
    {"files": check_files, "install": check_install, "refuse": check_refuse}[case](pypath, os.path.join(work, case))


if __name__ == "__main__":
    main()
