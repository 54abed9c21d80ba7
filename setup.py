"""`pip install --no-build-isolation .`: builds the Python package with CMake against the
installing Python's own PyTorch (2.7 or newer; `make python` does the same into build/) and
installs build/python/uckpt with every sub-package. Without --no-build-isolation pip would
build against a PyTorch of its own choosing in a throw-away environment."""
import os
import subprocess
import sys
import sysconfig

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = os.environ.get("UCKPT_BUILD_DIR", os.path.join(HERE, "build"))


class BuildWithCMake(build_py):

    def run(self):
        # A build folder configured already (UCKPT_BUILD_DIR, `make python`) is built as it is.
        if not os.path.exists(os.path.join(BUILD, "CMakeCache.txt")):
            subprocess.check_call(["cmake", "-S", HERE, "-B", BUILD, "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
                                   "-DPython3_EXECUTABLE=" + sys.executable])
        subprocess.check_call(["cmake", "--build", BUILD, "--target", "python", "-j", str(os.cpu_count() or 1)])
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        if not os.path.exists(os.path.join(BUILD, "python", "uckpt", "_uckpt" + suffix)):
            sys.exit(f"uckpt: {BUILD} holds no _uckpt{suffix}: it was configured for another Python; "
                     f"set UCKPT_BUILD_DIR to a new folder, or remove {BUILD}")
        super().run()


class BinaryDistribution(Distribution):
    """The package holds a compiled extension: a wheel for this platform and Python."""

    def has_ext_modules(self):
        return True


setup(
    name="uckpt",
    version="0.4.0",
    description="uckpt's training engine with DeepSpeed's Python API (import uckpt as deepspeed)",
    package_dir={"": os.path.relpath(os.path.join(BUILD, "python"), HERE)},
    # Every folder of python/uckpt (the build copies them beside the extension).
    packages=find_packages(os.path.join(HERE, "python"), include=["uckpt", "uckpt.*"]),
    package_data={"uckpt": ["_uckpt*.so"]},
    python_requires=">=3.9",
    install_requires=["torch>=2.7", "numpy"],
    cmdclass={"build_py": BuildWithCMake},
    distclass=BinaryDistribution,
    options={"build": {"build_base": os.path.join(BUILD, "setuptools")}},
    zip_safe=False,
)
