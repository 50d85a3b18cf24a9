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

from setuptools import Extension, find_packages, setup

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
    "kernels/csrc/moe.cpp",
    "kernels/csrc/dequant.cpp",
    "kernels/csrc/attention.cpp",
    "kernels/csrc/attention_avx2.cpp",
    "kernels/csrc/attention_avx512.cpp",
    "kernels/csrc/decode_layer.cpp",
    "kernels/csrc/hop_server.cpp",
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
            depends=["kernels/csrc/smk.h", "kernels/csrc/iq_grids.h", "kernels/csrc/dot_avx512.inc", "kernels/csrc/attention.inc",
                     "kernels/csrc/attention_tiled.inc"],
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

# The gateway's chat page (HTML, JS, CSS) travels with its package: it is served from there. So does
# the trained demo model (splitmoe/demo/), what `splitmoe up` serves when given no model.
setup(ext_modules=ext_modules, package_dir=package_dir, packages=packages,
      package_data={"splitmoe.gateway": ["static/*"], "splitmoe.demo": ["*.gguf"]})
