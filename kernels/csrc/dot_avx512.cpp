// AVX-512BW kernels (Skylake-SP and later), picked at run time by runtime.cpp.
#if defined(__x86_64__) || defined(__i386__)  // other CPUs get the scalar kernels only
#include <immintrin.h>

#include <cstring>

#include "iq_grids.h"
#include "smk.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")
#endif

namespace smk {
namespace avx512 {
#define SMK_VNNI 0
#define SMK_INIT init_impl
#define SMK_NAME "avx512bw"
#include "dot_avx512.inc"
}  // namespace avx512
}  // namespace smk

#include "target_pop.h"

void smk::init_avx512(Kernels& k) { avx512::init_impl(k); }

#endif  // x86
