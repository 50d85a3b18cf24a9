"""CPU kernels: GGUF quant formats, the native int8 library, the experts' and linears' routes.

The runtime defaults these kernels are measured with (MKL's reproducible mode, sleeping OpenMP
workers) are set by the `splitmoe` package, which every entry point imports before torch.
"""
