// Closes the target region an ISA file opened (`#pragma GCC push_options` + `target`, or clang's
// `attribute push`) around its kernels. No include guard: each ISA file includes it once, at its end.
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
