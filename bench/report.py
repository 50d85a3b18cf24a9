"""`splitmoe bench run`'s outputs: the JSON figures and the table printed at the end."""
from __future__ import annotations

import math

# (label, services key, in-process key, llama.cpp key, ceiling key, higher is better)
ROWS = (
    ("prefill tok/s ({prompt}-token prompt)", "prefill_tok_s", "inprocess_prefill_tok_s", "llamacpp_prefill_tok_s",
     None, True),
    ("time to first token, s", "ttft_s", "inprocess_ttft_s", "llamacpp_ttft_s", None, False),
    ("decode tok/s (1 stream)", "decode_tok_s", "inprocess_decode_tok_s", "llamacpp_decode_tok_s",
     "ceiling_decode_tok_s", True),
    ("decode tok/s ({streams} streams, total)", "decode16_tok_s", "inprocess_decode16_tok_s",
     "llamacpp_decode16_tok_s", "ceiling_decode16_tok_s", True),
    ("per-hop overhead, µs", "hop_us", None, None, None, False),
    # bench.services.step_share: 1 - the busiest expert service's compute / the phase's wall time
    ("{streams}-stream step outside the expert services, %", "outside_experts_pct", None, None, None, False),
)
HEADER = ("metric", "splitmoe services", "in-process", "llama.cpp", "vs llama.cpp", "ceiling", "% of ceiling")


def ratio(ours: float | None, theirs: float | None, higher_is_better: bool) -> float | None:
    """How many times better ours is: ours/theirs for rates, theirs/ours for times."""
    if not _positive(ours) or not _positive(theirs):
        return None
    return ours / theirs if higher_is_better else theirs / ours


def add_ratios(figures: dict) -> None:
    """`vs_llamacpp` and `pct_of_ceiling` maps, keyed by the services' figure."""
    vs, pct = {}, {}
    for _, key, _, llama_key, ceiling_key, higher in ROWS:
        if llama_key and (r := ratio(figures.get(key), figures.get(llama_key), higher)) is not None:
            vs[key] = round(r, 3)
        if ceiling_key and _positive(figures.get(key)) and _positive(figures.get(ceiling_key)):
            pct[key] = round(100.0 * figures[key] / figures[ceiling_key], 1)
    figures["vs_llamacpp"], figures["pct_of_ceiling"] = vs, pct


def table(figures: dict) -> str:
    workload = figures.get("workload", {})
    rows = [HEADER]
    for label, key, inproc_key, llama_key, ceiling_key, higher in ROWS:
        ours = figures.get(key)
        r = ratio(ours, figures.get(llama_key), higher) if llama_key else None
        ceiling = figures.get(ceiling_key) if ceiling_key else None
        pct = 100.0 * ours / ceiling if _positive(ours) and _positive(ceiling) else None
        rows.append((label.format(prompt=workload.get("prompt_tokens", "?"), streams=workload.get("streams", "?")),
                     number(ours), number(figures.get(inproc_key)) if inproc_key else "",
                     number(figures.get(llama_key)) if llama_key else "",
                     f"{r:.2f}×" if r is not None else ("-" if llama_key else ""),
                     number(ceiling) if ceiling_key else "", f"{pct:.0f}%" if pct is not None else ""))
    return markdown_table(rows)


def markdown_table(rows: list[tuple[str, ...]]) -> str:
    """rows[0] is the header; the first column is left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths))) + " |" for row in rows]
    lines.insert(1, "|" + "|".join(("-" * (w + 1) + ":") if i else ("-" * (w + 2)) for i, w in enumerate(widths)) + "|")
    return "\n".join(lines)


def context_lines(figures: dict) -> list[str]:
    f = figures
    touched = f.get("touched_expert_bytes_per_step16")
    lines = [
        f"model {f['model']}; {f['threads']} threads (attention {f['attention_threads']}, expert services "
        f"{'+'.join(map(str, f['expert_threads'])) or 'none'}); attention {attention_device(f)}, dtype {f['dtype']}; "
        f"transport {f['transport']}; native kernels {f.get('native_isa') or 'none'}",
        f"memory read bandwidth {f['bandwidth_gb_s']:.1f} GB/s; routed experts {_mb(f['expert_bytes_per_token'])} MB "
        f"per token, {_mb(touched)} MB per {f['workload']['streams']}-stream step "
        f"({f['touched_expert_bytes_source']}); "
        f"other weights {_mb(f['dense_bytes_per_token'])} MB per step (not in the ceilings)",
    ]
    if f.get("llamacpp_version"):
        lines.append(f"llama.cpp: llama-cpp-python {f['llamacpp_version']}, same file and thread count")
    lines.append("vs llama.cpp: times better (rates: ours / llama.cpp; time to first token: llama.cpp / ours)")
    return lines


def attention_device(figures: dict) -> str:
    """Where the attention service ran: "cpu", or "cuda (NVIDIA H100 80GB HBM3)"."""
    device = figures.get("attention_device", "cpu")
    return f"{device} ({figures['gpu']})" if figures.get("gpu") else device


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def number(x) -> str:
    if not _positive(x):
        return "-"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 1:
        return f"{x:.1f}"
    return f"{x:.3f}"


def _mb(x) -> str:
    return f"{x / 1e6:.1f}" if _positive(x) else "-"
