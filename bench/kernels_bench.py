"""Native quantized-matmul kernels against the pure-torch path (dequantize, then matmul).

    python -m splitmoe.bench.kernels_bench                    # the default table, well under 30 s
    python -m splitmoe.bench.kernels_bench --threads 1 --m 1 8 --formats Q4_K Q6_K

GB/s counts the quantized weight bytes read per second: the number that matters for decode,
where each token must stream every active weight once. Each timing cycles through enough
distinct matrices (--mb, default 64 MB, above the L3 of common servers) that the weights come
from memory, not cache, as they would in a real model. The torch column is kernels.quants'
dequantize plus a float32 matmul on the same matrices (gguf-py's numpy dequantize for the types
kernels.quants lacks); the dq+mm column is the native dequantize plus one GEMM of the m rows in the
GEMM dtype (kernels.cpu_features), the prefill route (kernels.linear, kernels.expert_kernels): where
it beats the int8 kernel, prefill should take over. MoE rows time one whole layer
(MoELayer.forward) of Qwen3-30B-A3B's shape: D=2048, ffn=768, top-8, Q4_K gate/up and Q6_K down,
against kernels.moe.moe_forward.
"""
from __future__ import annotations

import argparse
import time

import splitmoe  # noqa: F401 - first: the runtimes' defaults, before torch loads (splitmoe/__init__.py)

# isort: split
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from splitmoe.kernels import native
from splitmoe.kernels.cpu_features import gemm_dtype
from splitmoe.kernels.moe import ExpertFFN, moe_forward
from splitmoe.kernels.quants import QuantTensor, dequantize, supported_types

FP16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
               T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.MXFP4: (), T.IQ4_NL: (0,), T.IQ4_XS: (0,),
               T.IQ3_S: (0,), T.IQ3_XXS: (0,), T.IQ2_S: (0,), T.IQ2_XS: (0,), T.IQ2_XXS: (0,), T.IQ1_S: (0,), T.IQ1_M: ()}


def torch_dequantize(w: QuantTensor) -> torch.Tensor:
    """kernels.quants' dequantize, or gguf-py's for the types it lacks."""
    if int(w.ggml_type) in supported_types():
        return dequantize(w)
    return torch.from_numpy(gq.dequantize(w.data, T(w.ggml_type)).reshape(w.shape))


def random_matrix(qtype: T, n: int, k: int, rng: np.random.Generator, name: str = "w") -> QuantTensor:
    """Random valid blocks: random quants, small positive fp16 scales (values never inf/nan)."""
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    nb = n * k // elems
    blocks = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        blocks[:, off:off + 2] = rng.uniform(1e-3, 2e-3, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)
    if qtype == T.MXFP4:
        blocks[:, 0] = 118
    if qtype == T.IQ1_M:  # its fp16 d lies in the top nibbles of the scale words at bytes 48-55
        d = rng.uniform(1e-3, 2e-3, nb).astype(np.float16).view(np.uint16)
        for i in range(4):
            blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & 0x0F) | (((d >> (4 * i)) & 0xF) << 4).astype(np.uint8)
    data = blocks.reshape(n, k // elems * nbytes)
    data.flags.writeable = False
    return QuantTensor(name, int(qtype), (n, k), data)


def timed(fn, min_time: float, min_calls: int = 2) -> float:
    """Seconds per call: the best of a few passes, each at least min_time / 3 long."""
    fn()  # warm up
    best = float("inf")
    for _ in range(3):
        calls, t0 = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            dt = time.perf_counter() - t0
            if dt >= min_time / 3 and calls >= min_calls:
                break
        best = min(best, dt / calls)
    return best


def bench_matmul(qtype: T, ms: list[int], n: int, k: int, mb: float, torch_baseline: bool, rows: list,
                 pack: bool = False) -> None:
    rng = np.random.default_rng(int(qtype))
    one = random_matrix(qtype, n, k, rng)
    count = max(2, int(mb * 2**20 // one.num_bytes))
    mats = [one] + [random_matrix(qtype, n, k, rng) for _ in range(count - 1)]
    nbytes = one.num_bytes
    torch_s = None
    x1 = torch.randn(1, k)
    if torch_baseline:  # dequantize dominates; m barely matters, so time it once (m=1)
        it = iter(range(10**9))
        torch_s = timed(lambda: x1 @ torch_dequantize(mats[next(it) % count]).T, 0.3, 2)
    gemm = gemm_dtype()  # the prefill route's: dequantize to it, then one GEMM
    buf = torch.empty(n, k, dtype=gemm)
    it2 = iter(range(10**9))
    kernels = [native.WeightMatmul(w, pack=pack) for w in mats]  # packed by 16 rows where the ISA has that
    for m in ms:
        x = torch.randn(m, k)
        out = torch.empty(m, n)

        def run():
            for mm in kernels:
                mm(x, out)

        s = timed(run, 0.5) / count
        xg = x.to(gemm)
        dq_s = timed(lambda: xg @ native.dequantize(mats[next(it2) % count], gemm, out=buf).T, 0.2, 2)
        rows.append((qtype.name, f"{n}x{k}", m, s * 1e6, nbytes / s / 1e9, dq_s * 1e6,
                     None if torch_s is None else torch_s * 1e6, None if torch_s is None else nbytes / torch_s / 1e9))


def bench_moe(tokens: list[int], hosted: int, torch_baseline: bool, rows: list) -> None:
    D, F, K = 2048, 768, 8
    rng = np.random.default_rng(0)
    experts = {e: ExpertFFN(random_matrix(T.Q4_K, F, D, rng, f"gate{e}"), random_matrix(T.Q4_K, F, D, rng, f"up{e}"),
                            random_matrix(T.Q6_K, D, F, rng, f"down{e}")) for e in range(hosted)}
    layer = native.MoELayer(experts, hosted)
    gen = torch.Generator().manual_seed(0)
    for t in tokens:
        x = torch.randn(t, D, generator=gen)
        ids = torch.stack([torch.randperm(hosted, generator=gen)[:K] for _ in range(t)])
        w = torch.softmax(torch.randn(t, K, generator=gen), -1)
        active = set(ids.flatten().tolist())
        nbytes = sum(experts[e].num_bytes for e in active)
        s = timed(lambda: layer.forward(x, ids, w), 0.5)
        ts = None
        if torch_baseline and t == 1:  # seconds per call: time one
            t0 = time.perf_counter()
            moe_forward(x, ids, w, experts)
            ts = time.perf_counter() - t0
        rows.append((f"MoE layer ({len(active)} experts)", f"D{D} ffn{F}", t, s * 1e6, nbytes / s / 1e9, None,
                     None if ts is None else ts * 1e6, None if ts is None else nbytes / ts / 1e9))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m splitmoe.bench.kernels_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", nargs="+", default=["Q4_K", "Q6_K", "Q8_0", "Q4_0", "MXFP4", "IQ4_NL", "IQ4_XS", "IQ3_S",
                                                  "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS"])
    p.add_argument("--m", nargs="+", type=int, default=[1, 4, 16, 64], help="activation rows (tokens)")
    p.add_argument("--n", type=int, default=768, help="weight rows per matrix")
    p.add_argument("--k", type=int, default=2048, help="weight columns")
    p.add_argument("--mb", type=float, default=64, help="MB of distinct weights cycled through per timing")
    p.add_argument("--threads", type=int, default=None, help="native threads (default: torch's)")
    p.add_argument("--moe-tokens", nargs="*", type=int, default=[1, 16], help="MoE layer rows; none to skip")
    p.add_argument("--moe-experts", type=int, default=32, help="experts hosted in the MoE layer")
    p.add_argument("--no-torch", action="store_true", help="skip the pure-torch baseline")
    p.add_argument("--pack", action="store_true", help="weights packed by 16 rows where this ISA has that layout "
                   "(as the attention side's linears and the experts are loaded)")
    p.add_argument("--no-vbmi", action="store_true", help="IQ3_XXS's grid by per-row lookups, not the VBMI "
                   "byte permutations (to compare; no effect where the CPU has no VBMI)")
    a = p.parse_args(argv)
    if not native.AVAILABLE:
        raise SystemExit(f"native kernels unavailable: {native.UNAVAILABLE_REASON}")
    if a.threads:
        native.set_num_threads(a.threads)
        torch.set_num_threads(a.threads)
    vbmi = native._set_vbmi(not a.no_vbmi) and not a.no_vbmi  # False where the CPU has no VBMI kernel
    print(f"native ISA {native.isa()}{' (VBMI grid decoder)' if vbmi else ''}, {native.get_num_threads()} native "
          f"threads, torch {torch.get_num_threads()} "
          f"threads; weights cycled: {a.mb:g} MB per timing; dq+mm GEMMs in {str(gemm_dtype()).removeprefix('torch.')}")
    rows: list = []
    for f in a.formats:
        bench_matmul(T[f], a.m, a.n, a.k, a.mb, not a.no_torch, rows, a.pack)
    if a.moe_tokens:
        bench_moe(a.moe_tokens, a.moe_experts, not a.no_torch, rows)
    head = ("format", "shape", "m", "native us", "native GB/s", "dq+mm us", "torch us", "torch GB/s", "speedup")
    print(f"{head[0]:<24}{head[1]:>12}{head[2]:>5}{head[3]:>12}{head[4]:>13}{head[5]:>10}{head[6]:>12}{head[7]:>12}"
          f"{head[8]:>9}")
    for name, shape, m, us, gbs, dus, tus, tgbs in rows:
        dcol = f"{dus:>10.0f}" if dus else f"{'-':>10}"
        tcols = f"{tus:>12.0f}{tgbs:>12.2f}{tus / us:>8.1f}x" if tus else f"{'-':>12}{'-':>12}{'-':>9}"
        print(f"{name:<24}{shape:>12}{m:>5}{us:>12.1f}{gbs:>13.2f}{dcol}{tcols}")


if __name__ == "__main__":
    main()
