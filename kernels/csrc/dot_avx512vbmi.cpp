// AVX-512 VNNI kernels again, with VBMI (Ice Lake, Zen 4 and later): the IQ3_XXS grid read
// by byte permutations (dot_avx512.inc, SMK_VBMI). runtime.cpp puts that format's kernel into the
// VNNI table where the CPU has VBMI; everything else there stays dot_avx512vnni.cpp's.
#if defined(__x86_64__) || defined(__i386__)  // other CPUs get the scalar kernels only
#include <immintrin.h>

#include <cstring>

#include "iq_grids.h"
#include "smk.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma,f16c,bmi2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma,f16c,bmi2")
#endif

namespace smk {
namespace avx512vbmi {
#define SMK_VNNI 1
#define SMK_VBMI 1
#define SMK_INIT init_impl
#define SMK_NAME "avx512vnni"
#include "dot_avx512.inc"
}  // namespace avx512vbmi
}  // namespace smk

#include "target_pop.h"

void smk::init_avx512vbmi(Kernels& k) {
    Kernels all = k;
    avx512vbmi::init_impl(all);
    k.dot[T_IQ3_XXS] = all.dot[T_IQ3_XXS];
}

#endif  // x86
