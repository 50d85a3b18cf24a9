"""CPU kernels: GGUF quant formats, the native int8 library, the experts' and linears' routes."""
import os

# MKL's float32 GEMM picks its kernel by thread count on some CPUs (seen on AMD Zen 5: a 9x64
# by 64x32 product differs in the last bit between 1 and 2 threads), so the exact float32 path
# would give other bits in a 1-thread expert service than in-process. Strict conditional
# numerical reproducibility makes the result independent of the thread count (up to the cores;
# oversubscribed counts still differ), at no measured cost. MKL reads this at its first BLAS
# call, which no module of ours makes before this import.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
