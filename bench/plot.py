"""`splitmoe bench run --plot FILE.png`: decode tok/s against concurrent streams, one line per
engine (the services, in-process, and each peer that ran: llama.cpp, ik_llama.cpp), from one run's
figures."""
from __future__ import annotations

from pathlib import Path

ENGINES = (("services", "SplitMoE services", "tab:blue", "o"), ("inprocess", "SplitMoE in-process", "tab:green", "s"),
           ("llamacpp", "llama.cpp", "tab:red", "^"),
           ("ik_llamacpp", "ik_llama.cpp (its streams decode one token: they route alike)", "tab:purple", "v"))
# Our streams of one prompt (Prompts.alike): one hollow point each, beside the peer's streams that route alike.
ALIKE_POINTS = (("decode16_alike_tok_s", "SplitMoE services, streams of one prompt", "tab:blue", "o"),
                ("inprocess_decode16_alike_tok_s", "SplitMoE in-process, streams of one prompt", "tab:green", "s"))


def plot_decode_curve(figures: dict, path: str | Path) -> Path:
    """Draw figures["decode_curve_tok_s"] ({engine: {streams: tok/s}}) to a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")  # a file, no display
    import matplotlib.pyplot as plt

    curves = figures["decode_curve_tok_s"]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for key, label, color, marker in engines_drawn(figures):
        curve = curves[key]
        streams = sorted(curve)
        ax.plot(streams, [curve[n] for n in streams], label=label, color=color, marker=marker, linewidth=2)
        for n in streams:
            ax.annotate(f"{curve[n]:.0f}", (n, curve[n]), textcoords="offset points", xytext=(0, 6),
                        ha="center", fontsize=7, color=color)
    streams_n = figures.get("workload", {}).get("streams")
    for key, label, color, marker in ALIKE_POINTS:
        if streams_n and figures.get(key):
            ax.plot([streams_n], [figures[key]], label=label, color=color, marker=marker, markerfacecolor="none",
                    linestyle="none", markersize=9)
    all_streams = sorted({n for c in curves.values() for n in c})
    ax.set_xscale("log", base=2)
    ax.set_xticks(all_streams, [str(n) for n in all_streams])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("decode tok/s (all streams together)")
    model = Path(figures.get("model", "?")).name
    ax.set_title(f"{model}, {figures.get('threads', '?')} threads, {figures.get('cpu', '')}".rstrip(", "), fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def engines_drawn(figures: dict) -> list[tuple[str, str, str, str]]:
    """The engines with a curve in these figures, in the legend's order."""
    curves = figures["decode_curve_tok_s"]
    return [engine for engine in ENGINES if curves.get(engine[0])]
