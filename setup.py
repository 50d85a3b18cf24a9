"""Builds the optional native kernel library kernels/_native*.so (see kernels/native.py).

Everything else about the package is in pyproject.toml. The extension is `optional`: without a
C++ compiler `pip install` still succeeds and the kernels fall back to pure torch. It is a plain
C++17 shared library with a C API loaded through ctypes (no Python or torch headers), built for
the baseline x86-64 ISA; the AVX2 / AVX-512 / AVX-512 VNNI kernels are compiled per function
with target attributes and chosen at run time from the CPU's features (never -march=native: the
same wheel or image must run on any x86-64 machine).
"""
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

# One namespace in site-packages: the design card's top-level folders become splitmoe.<folder>
# (splitmoe/__init__.py does the same for a source checkout).
PRODUCT = ("kernels", "proto", "modelfile", "attention_service", "expert_service", "gateway", "bench")
package_dir = {"splitmoe": "splitmoe", **{f"splitmoe.{p}": p for p in PRODUCT}}
packages = ["splitmoe", *find_packages(include=["splitmoe.*"]),
            *(f"splitmoe.{p}{'.' + sub if sub else ''}" for p in PRODUCT for sub in ["", *find_packages(where=p)])]

SOURCES = [
    "kernels/csrc/runtime.cpp",
    "kernels/csrc/dot_scalar.cpp",
    "kernels/csrc/dot_avx2.cpp",
    "kernels/csrc/dot_avx512.cpp",
    "kernels/csrc/dot_avx512vnni.cpp",
    "kernels/csrc/dot_avx512vbmi.cpp",
    "kernels/csrc/moe.cpp",
    "kernels/csrc/dequant.cpp",
    "kernels/csrc/attention.cpp",
    "kernels/csrc/attention_avx2.cpp",
    "kernels/csrc/attention_avx512.cpp",
    "kernels/csrc/decode_layer.cpp",
    "kernels/csrc/norm.cpp",
    "kernels/csrc/rope.cpp",
    "kernels/csrc/route.cpp",
    "kernels/csrc/decode_moe_layer.cpp",
    "attention_service/expert_backends/csrc/direct_hop.cpp",  # the doorbell client of a fused decode layer
    "expert_service/csrc/hop_server.cpp",  # the doorbell's C++ loop, beside expert_service/doorbell.py
    "kernels/csrc/repack.cpp",
]

ext_modules = []
# SPLITMOE_BUILD_NATIVE=0 leaves the library out (the package then runs on the torch fallback): for
# builds that check the package's layout, not its speed.
if (sys.platform.startswith("linux") or sys.platform == "darwin") and os.environ.get("SPLITMOE_BUILD_NATIVE") != "0":
    ext_modules.append(
        Extension(
            "splitmoe.kernels._native",
            sources=SOURCES,
            include_dirs=["kernels/csrc"],  # smk.h, for the sources outside kernels/ too
            depends=["kernels/csrc/smk.h", "kernels/csrc/iq_grids.h", "kernels/csrc/dot_avx512.inc", "kernels/csrc/attention.inc",
                     "kernels/csrc/attention_tiled.inc", "kernels/csrc/kv_quant.h",
                     "kernels/csrc/doorbell.h", "kernels/csrc/target_pop.h"],
            language="c++",
            extra_compile_args=[
                "-std=c++17", "-O3", "-g0", "-fvisibility=hidden",
                # no fused multiply-adds unless written: dequantize must round like kernels.quants
                "-ffp-contract=off",
                "-fno-math-errno", "-pthread",
            ],
            extra_link_args=["-pthread"],
            optional=True,
        )
    )


class ParallelBuildExt(build_ext):
    """Compiles an extension's sources side by side, one compiler process per CPU (or per -j N).
    setuptools compiles them one after another, and its own --parallel only runs whole extensions
    side by side, of which there is one: its 13 sources take 15-24 s one by one on 2 cores, 12 s
    two at a time, and the longest (dot_avx512.cpp) 8 s alone, what 13 cores or more take."""

    def build_extension(self, ext):
        compile_one = self.compiler.compile
        jobs = _usable_cpus() if self.parallel in (None, True) else max(1, int(self.parallel))  # -j 1: serial

        def compile_all(sources, *args, **kwargs):
            with ThreadPoolExecutor(max(1, min(jobs, len(sources)))) as pool:
                return [obj for objs in pool.map(lambda src: compile_one([src], *args, **kwargs), sources)
                        for obj in objs]

        self.compiler.compile = compile_all
        try:
            super().build_extension(ext)
        finally:
            self.compiler.compile = compile_one


def _usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# The gateway's chat page (HTML, JS, CSS) travels with its package: it is served from there. So does
# the trained demo model (splitmoe/demo/), what `splitmoe up` serves when given no model.
setup(ext_modules=ext_modules, cmdclass={"build_ext": ParallelBuildExt}, package_dir=package_dir, packages=packages,
      package_data={"splitmoe.gateway": ["static/*"], "splitmoe.demo": ["*.gguf"]})
