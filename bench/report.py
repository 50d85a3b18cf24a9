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
    # streams of one prompt route alike: the row of a peer whose batched streams do (Fork.streams_alike)
    ("decode tok/s ({streams} streams of one prompt, total)", "decode16_alike_tok_s", "inprocess_decode16_alike_tok_s",
     "llamacpp_decode16_alike_tok_s", None, True),
    ("per-hop overhead, µs", "hop_us", None, None, None, False),
    # bench.services.step_share: 1 - the busiest expert service's compute / the phase's wall time
    ("{streams}-stream step outside the expert services, %", "outside_experts_pct", None, None, None, False),
)
HEADER = ("metric", "splitmoe services", "in-process", "llama.cpp", "vs llama.cpp", "ceiling", "% of ceiling")
# The peers, by the prefix of their figures (ROWS names llama.cpp's; the others' swap the prefix),
# with their columns. llama.cpp's are always shown; ik_llama.cpp's when it ran.
PEERS = (("llamacpp", "llama.cpp", "vs llama.cpp"), ("ik_llamacpp", "ik_llama.cpp", "vs ik"))


def peer_key(llama_key: str | None, peer: str) -> str | None:
    """The peer's figure for the row whose llama.cpp figure is `llama_key`."""
    return None if llama_key is None else peer + llama_key.removeprefix("llamacpp")


def peers_shown(figures: dict) -> list[tuple[str, str, str]]:
    return [p for p in PEERS if p[0] == "llamacpp" or figures.get(f"{p[0]}_version") is not None]


def ratio(ours: float | None, theirs: float | None, higher_is_better: bool) -> float | None:
    """How many times better ours is: ours/theirs for rates, theirs/ours for times."""
    if not _positive(ours) or not _positive(theirs):
        return None
    return ours / theirs if higher_is_better else theirs / ours


def add_ratios(figures: dict) -> None:
    """`vs_llamacpp` (and `vs_ik_llamacpp` when ik_llama.cpp ran): how many times better, keyed by
    the services' figure and, where it ran, the in-process one's; `pct_of_ceiling`, by the services'."""
    pct = {}
    for _, key, _, _, ceiling_key, _ in ROWS:
        if ceiling_key and _positive(figures.get(key)) and _positive(figures.get(ceiling_key)):
            pct[key] = round(100.0 * figures[key] / figures[ceiling_key], 1)
    for peer, _, _ in peers_shown(figures):
        vs = {}
        for _, key, inproc_key, llama_key, _, higher in ROWS:
            theirs = figures.get(peer_key(llama_key, peer)) if llama_key else None
            for ours in (key, inproc_key):
                if ours and (r := ratio(figures.get(ours), theirs, higher)) is not None:
                    vs[ours] = round(r, 3)
        figures[f"vs_{peer}"] = vs
    figures["pct_of_ceiling"] = pct


def table(figures: dict) -> str:
    workload = figures.get("workload", {})
    peers = peers_shown(figures)
    rows = [HEADER[:3] + tuple(c for _, name, vs in peers for c in (name, vs)) + HEADER[-2:]]
    for label, key, inproc_key, llama_key, ceiling_key, higher in ROWS:
        if key not in figures and inproc_key not in figures:
            continue  # a row this run did not measure (the figures of a run before it existed)
        ours = figures.get(key)
        ceiling = figures.get(ceiling_key) if ceiling_key else None
        pct = 100.0 * ours / ceiling if _positive(ours) and _positive(ceiling) else None
        rows.append((label.format(prompt=workload.get("prompt_tokens", "?"), streams=workload.get("streams", "?")),
                     number(ours), number(figures.get(inproc_key)) if inproc_key else "",
                     *(cell for peer, _, _ in peers for cell in _peer_cells(figures, ours, peer_key(llama_key, peer),
                                                                              higher)),
                     number(ceiling) if ceiling_key else "", f"{pct:.0f}%" if pct is not None else ""))
    return markdown_table(rows)


def _peer_cells(figures: dict, ours, their_key: str | None, higher: bool) -> tuple[str, str]:
    """The peer's figure and how many times better ours is; blank where the row has no peer figure."""
    if their_key is None:
        return "", ""
    r = ratio(ours, figures.get(their_key), higher)
    return number(figures.get(their_key)), f"{r:.2f}×" if r is not None else "-"


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
    if line := bandwidth_line(f):
        lines.append(line)
    if _positive(f.get("ceiling_all_weights_decode_tok_s")):
        lines.append(all_weights_line(f))
    if f.get("llamacpp_bin_dir"):
        lines.append(peer_line(f, "llamacpp", "llama.cpp"))
    elif f.get("llamacpp_version"):
        lines.append(f"llama.cpp: llama-cpp-python {f['llamacpp_version']}, same file and thread count")
    if f.get("ik_llamacpp_version"):
        lines.append(peer_line(f, "ik_llamacpp", "ik_llama.cpp"))
        lines.append("vs llama.cpp, vs ik: times better (rates: ours / the peer's; time to first token: the peer's "
                     "/ ours)")
    else:
        lines.append("vs llama.cpp: times better (rates: ours / llama.cpp; time to first token: llama.cpp / ours)")
    return lines


# Bandwidth measured before the engines more than this far apart: the run's ratios mix machine states.
BANDWIDTH_SPREAD = 0.10
_ENGINE_NAMES = {"services": "services", "inprocess": "in-process", "llamacpp": "llama.cpp", "ik_llamacpp": "ik_llama.cpp"}


def bandwidth_line(f: dict) -> str:
    """The read bandwidth measured before each engine ran, and a warning where it moved."""
    before = {k: v for k, v in (f.get("bandwidth_before_gb_s") or {}).items() if _positive(v)}
    if len(before) < 2:
        return ""
    each = ", ".join(f"{_ENGINE_NAMES.get(k, k)} {v:.1f}" for k, v in before.items())
    line = f"read bandwidth before each engine, GB/s: {each}"
    low, high = min(before.values()), max(before.values())
    if high > (1 + BANDWIDTH_SPREAD) * low:
        line += (f" (it moved {100 * (high / low - 1):.0f}% during the run: the ratios mix the machine's states; "
                 "compare within a state)")
    return line


def all_weights_line(f: dict) -> str:
    """Single-stream decode of every engine against the ceiling of reading every weight (experts and
    the rest, as stored) once per token at the measured bandwidth: the 85% target's measure."""
    ceiling = f["ceiling_all_weights_decode_tok_s"]
    engines = (("services", "decode_tok_s"), ("in-process", "inprocess_decode_tok_s"),
               ("llama.cpp", "llamacpp_decode_tok_s"), ("ik_llama.cpp", "ik_llamacpp_decode_tok_s"))
    shares = [f"{name} {100.0 * f[key] / ceiling:.0f}%" for name, key in engines if _positive(f.get(key))]
    return (f"all weights read once per token at that bandwidth: single-stream decode ceiling {number(ceiling)} "
            f"tok/s; reached: {', '.join(shares)}")


def peer_line(f: dict, peer: str, name: str) -> str:
    """A peer run through its build's tools: where, which build, which flags gave each figure."""
    flags = f.get(f"{peer}_flags") or {}
    won = ", ".join(f"{what} {flags[k]}" for k, what in (("prefill_tok_s", "prefill"), ("decode_tok_s", "decode"),
                                                          ("decode16_tok_s", "streams"))
                    if flags.get(k, "defaults") != "defaults")
    chosen = f"; per figure the better flags: {won}" if won else ""
    note = f"; {f[peer + '_note']}" if f.get(f"{peer}_note") else ""
    prompt = (f.get("workload") or {}).get("prompt_tokens")
    after = f"; decode after a {prompt}-token prompt, as ours" if prompt else ""
    return (f"{name}: llama-bench and llama-batched-bench in {f[peer + '_bin_dir']}, build {f[peer + '_version']}, "
            f"same file and thread count; first token = prompt / prefill rate{after}{chosen}{note}")


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
