"""Builds the Cython extensions in cython_ext/ (everything else is declared in pyproject.toml).

Compiler directives live here, in one place. PLANSERVE_CYTHON_DEBUG=1 builds with bounds and
initialisation checks on, for chasing a memory bug in a test run.

The paged attention kernel (cython_ext/paged_attention.pyx) and the layer operations
(cython_ext/layer_ops.pyx), both over cython_ext/csrc/, are C++ with OpenMP. Their portable paths
and dispatchers are built with no ISA flags; each vector path is its own translation unit built
with its own flags (below) and chosen at run time by CPU features, so one wheel runs on any x86-64
CPU (and the portable paths alone on other architectures). OpenMP links
libgomp.so.1, the soname torch's wheel ships too: one OpenMP runtime in the model service.
"""
import glob
import os
import platform

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

DEBUG = os.environ.get("PLANSERVE_CYTHON_DEBUG") == "1"

DIRECTIVES = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": False,
    "initializedcheck": DEBUG,
    "cdivision": True,
    "embedsignature": True,
}
OPT = ["-O3"] if not DEBUG else ["-O0", "-g"]
CSRC = "cython_ext/csrc"
X86_64 = platform.machine().lower() in ("x86_64", "amd64")
# Vector paths of the paged attention kernel: source -> its own ISA flags (x86-64 only).
ATTENTION_ISA_SOURCES = {
    f"{CSRC}/paged_attention_avx2.cpp": ["-mavx2", "-mfma"],
    f"{CSRC}/paged_attention_avx512.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    f"{CSRC}/paged_attention_avx512_bf16.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
                                                "-mavx512bf16"],
} if X86_64 else {}
AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]
# Vector paths of the layer operations. -ffp-contract=off on all of them (CXX_FLAGS_LAYER_OPS):
# RoPE rounds each product before the sum, as torch's eager ops do, so no path fuses them.
LAYER_OPS_ISA_SOURCES = {
    f"{CSRC}/layer_ops_avx2.cpp": ["-mavx2", "-mfma"],
    f"{CSRC}/layer_ops_avx512.cpp": AVX512_FLAGS,
} if X86_64 else {}
# Vector paths of the small-batch GEMMs. The FMA paths (csrc/gemm_vec_impl.h) fuse only where
# their source says fmadd: -ffp-contract=off keeps the compiler from fusing anything else.
GEMM_ISA_SOURCES = {
    f"{CSRC}/gemm_avx512_bf16.cpp": AVX512_FLAGS + ["-mavx512bf16", "-mavx512vnni"],
    f"{CSRC}/gemm_avx512.cpp": AVX512_FLAGS + ["-ffp-contract=off"],
    f"{CSRC}/gemm_avx2.cpp": ["-mavx2", "-mfma", "-ffp-contract=off"],
} if X86_64 else {}
# Vector paths of the decoder loop's per-row LoRA products (csrc/lora_rows.h): the GEMM paths' ISA
# flags; -ffp-contract=off on all, as the scaled add rounds its product before the sum.
LORA_ISA_SOURCES = {
    f"{CSRC}/lora_rows_avx512_bf16.cpp": AVX512_FLAGS + ["-mavx512bf16", "-ffp-contract=off"],
    f"{CSRC}/lora_rows_avx512.cpp": AVX512_FLAGS + ["-ffp-contract=off"],
    f"{CSRC}/lora_rows_avx2.cpp": ["-mavx2", "-mfma", "-ffp-contract=off"],
} if X86_64 else {}
# SHA-NI path of the prefix cache's block hash (block_pool.pyx, csrc/sha256.h picks it by CPUID).
BLOCK_POOL_ISA_SOURCES = {f"{CSRC}/sha256_shani.c": ["-msha", "-msse4.1"]} if X86_64 else {}
# -fno-trapping-math lets the compiler vectorize the selects of the portable exp (no result
# changes: nothing reads FP exception flags). -Wno-maybe-uninitialized: GCC 12's own AVX-512
# intrinsic headers trip it (masked loads).
CXX_FLAGS = OPT + ["-std=c++17", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-Wno-maybe-uninitialized"]
CXX_FLAGS_LAYER_OPS = CXX_FLAGS + ["-ffp-contract=off"]


class BuildExt(build_ext):
    """Compiles each ISA source of an extension with its own flags, then links it in."""

    def build_extension(self, ext):
        isa_sources = ISA_SOURCES_OF.get(ext.name, {})
        if isa_sources:
            objects = []
            for source, flags in isa_sources.items():
                objects += self.compiler.compile(
                    [source], output_dir=self.build_temp, include_dirs=ext.include_dirs,
                    macros=ext.define_macros, extra_postargs=ext.extra_compile_args + flags, depends=ext.depends)
            ext.extra_objects = list(ext.extra_objects or []) + objects
        super().build_extension(ext)


extensions = [
    Extension(
        "cython_ext." + os.path.splitext(os.path.basename(path))[0],
        [path],
        extra_compile_args=OPT,
    )
    for path in sorted(glob.glob("cython_ext/*.pyx"))
    if not path.endswith(("paged_attention.pyx", "layer_ops.pyx", "gemm.pyx", "decoder.pyx"))
]
def native_kernel(name: str, compile_args: list[str]) -> Extension:
    """cython_ext/NAME.pyx over csrc/NAME_dispatch.cpp and csrc/NAME_portable.cpp (C++, OpenMP);
    its vector paths come in through ISA_SOURCES_OF."""
    return Extension(
        f"cython_ext.{name}",
        [f"cython_ext/{name}.pyx", f"{CSRC}/{name}_dispatch.cpp", f"{CSRC}/{name}_portable.cpp"],
        language="c++",
        include_dirs=["cython_ext"],
        define_macros=[("PLANSERVE_PA_X86", "1")] if X86_64 else [],
        extra_compile_args=compile_args,
        extra_link_args=["-fopenmp"],
        depends=sorted(glob.glob(f"{CSRC}/*")),
    )


attention = native_kernel("paged_attention", CXX_FLAGS)
layer_ops = native_kernel("layer_ops", CXX_FLAGS_LAYER_OPS)
gemm = native_kernel("gemm", CXX_FLAGS)
# The decoder loop calls the three kernels above through the addresses their modules hand out: it
# compiles none of them again (csrc/decoder.h). Its own kernel is the per-row LoRA products
# (csrc/lora_rows.h), with vector paths of its own (LORA_ISA_SOURCES).
decoder = Extension(
    "cython_ext.decoder",
    ["cython_ext/decoder.pyx", f"{CSRC}/decoder.cpp", f"{CSRC}/lora_rows_dispatch.cpp",
     f"{CSRC}/lora_rows_portable.cpp"],
    language="c++",
    include_dirs=["cython_ext"],
    define_macros=[("PLANSERVE_PA_X86", "1")] if X86_64 else [],
    # -ffp-contract=off: the LoRA add rounds its product before the sum (csrc/lora_rows.h).
    extra_compile_args=CXX_FLAGS + ["-ffp-contract=off"],
    extra_link_args=["-fopenmp"],
    depends=sorted(glob.glob(f"{CSRC}/*")),
)
extensions += [attention, layer_ops, gemm, decoder]
# cythonize() copies Extensions: found by name
ISA_SOURCES_OF = {attention.name: ATTENTION_ISA_SOURCES, layer_ops.name: LAYER_OPS_ISA_SOURCES,
                  gemm.name: GEMM_ISA_SOURCES, decoder.name: LORA_ISA_SOURCES,
                  "cython_ext.block_pool": BLOCK_POOL_ISA_SOURCES}

setup(ext_modules=cythonize(extensions, compiler_directives=DIRECTIVES), cmdclass={"build_ext": BuildExt})
