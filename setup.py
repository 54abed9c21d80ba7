"""`pip install .`: builds the Python package with CMake (`make python`) and
installs build/python/uckpt. Uses the setuptools and pip Debian ships; in a
virtual environment with --system-site-packages (for Debian's torch), or with
--break-system-packages for the system Python."""
import os
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = os.environ.get("UCKPT_BUILD_DIR", os.path.join(HERE, "build"))


class BuildWithCMake(build_py):

    def run(self):
        subprocess.check_call(["cmake", "-S", HERE, "-B", BUILD, "-DCMAKE_BUILD_TYPE=RelWithDebInfo"])
        subprocess.check_call(["cmake", "--build", BUILD, "--target", "python", "-j", str(os.cpu_count() or 1)])
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
    packages=["uckpt", "uckpt.accelerator", "uckpt.checkpoint", "uckpt.comm", "uckpt.moe", "uckpt.ops",
              "uckpt.ops.adam", "uckpt.pipe", "uckpt.utils", "uckpt.zero"],
    package_data={"uckpt": ["_uckpt*.so"]},
    cmdclass={"build_py": BuildWithCMake},
    distclass=BinaryDistribution,
    options={"build": {"build_base": os.path.join(BUILD, "setuptools")}},
    zip_safe=False,
)
