// AVX-512 VNNI kernels (Cascade Lake, Ice Lake, Zen 4 and later), picked at run time by runtime.cpp.
#if defined(__x86_64__) || defined(__i386__)  // other CPUs get the scalar kernels only
#include <immintrin.h>

#include <cstring>

#include "iq_grids.h"
#include "smk.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi2")
#endif

namespace smk {
namespace avx512vnni {
#define SMK_VNNI 1
#define SMK_INIT init_impl
#define SMK_NAME "avx512vnni"
#include "dot_avx512.inc"
}  // namespace avx512vnni
}  // namespace smk

#include "target_pop.h"

void smk::init_avx512vnni(Kernels& k) { avx512vnni::init_impl(k); }

#endif  // x86
