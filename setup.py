"""Build of the one Cython extension, ktcy._native.

Base flags stay portable (no -march=native): every ISA-specific function carries its own
__attribute__((target(...))), so one binary imports on any x86-64 CPU.  The three
CPUINFER_ENABLE_* switches (ON by default) leave whole kernel families out of the binary.
"""
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

SWITCHES = ("CPUINFER_ENABLE_AMX", "CPUINFER_ENABLE_AVX512_VBMI", "CPUINFER_ENABLE_AVX512_BF16")


def switch_on(name):
    value = os.environ.get(name, "ON").strip().upper()
    if value not in ("ON", "OFF", "1", "0", "TRUE", "FALSE", "YES", "NO"):
        raise SystemExit(f"{name}={value!r}: expected ON or OFF")
    return value in ("ON", "1", "TRUE", "YES")


macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
macros += [("KTCY_" + name[len("CPUINFER_"):], "1" if switch_on(name) else "0") for name in SWITCHES]

native = Extension(
    "ktcy._native",
    sources=["ktcy/_native.pyx"],
    include_dirs=["include", numpy.get_include()],
    define_macros=macros,
    # fp-contract=off: no silent FMA contraction, so the same C expression rounds the same
    # way in every ISA variant (the INT8 kernels promise bit-identical outputs).
    extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-std=gnu11",
                        "-Wno-unused-function"],
    extra_link_args=["-fopenmp"],
    depends=[os.path.join("include", "ktcy", f) for f in os.listdir(os.path.join("include", "ktcy"))],
)

setup(
    ext_modules=cythonize([native], language_level=3,
                          compiler_directives={"boundscheck": False, "wraparound": False,
                                               "cdivision": True, "initializedcheck": False}),
)
