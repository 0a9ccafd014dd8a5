"""Builds the Cython extensions in cython_ext/ (everything else is declared in pyproject.toml).

Compiler directives live here, in one place. PLANSERVE_CYTHON_DEBUG=1 builds with bounds and
initialisation checks on, for chasing a memory bug in a test run.
"""
import glob
import os

from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("PLANSERVE_CYTHON_DEBUG") == "1"

DIRECTIVES = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": False,
    "initializedcheck": DEBUG,
    "cdivision": True,
    "embedsignature": True,
}

extensions = [
    Extension(
        "cython_ext." + os.path.splitext(os.path.basename(path))[0],
        [path],
        extra_compile_args=["-O3"] if not DEBUG else ["-O0", "-g"],
    )
    for path in sorted(glob.glob("cython_ext/*.pyx"))
]

setup(ext_modules=cythonize(extensions, compiler_directives=DIRECTIVES))
