"""`splitmoe heatmap`'s picture: the heat of every (layer, expert) above where each is computed.

Top, tokens per second per expert (layers down, experts across). Below, the placement: each cell
coloured by the expert service computing it (black: the attention process), replicated experts
marked with their number of replicas. PNG or SVG, by the file's suffix.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

LOCAL = "local"


def draw_heatmap(rates: Sequence[Sequence[float]], placed_on: Mapping[tuple[int, int], Sequence[str]],
                 path: str | Path, title: str = "") -> Path:
    """rates[layer][expert]: tokens per second; placed_on[(layer, expert)]: service addresses, or
    ("local",). Layers without routed experts (no placement, no heat) are drawn empty."""
    import matplotlib

    matplotlib.use("Agg")  # a file, no display
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap

    heat = np.asarray(rates, dtype=float)
    num_layers, num_experts = heat.shape
    services = sorted({s for where in placed_on.values() for s in where if s != LOCAL})
    owner = np.full(heat.shape, np.nan)  # index into the colours: 0 local, 1.. services
    for (layer, expert), where in placed_on.items():
        owner[layer, expert] = 0 if LOCAL in where else 1 + services.index(where[0])
    palette = ["black", *plt.get_cmap("tab10").colors[:max(len(services), 1)]]
    panel_height = 1.2 + min(num_layers * 0.2, 9)
    fig, (left, right) = plt.subplots(2, 1, figsize=(min(5 + num_experts * 0.1, 20), 2 * panel_height + 0.8), dpi=110)
    image = left.imshow(heat, aspect="auto", cmap="inferno", interpolation="nearest")
    fig.colorbar(image, ax=left, label="tokens per second (decayed)")
    left.set_title("heat")
    right.imshow(owner, aspect="auto", cmap=ListedColormap(palette), vmin=-0.5, vmax=len(palette) - 0.5,
                 interpolation="nearest")
    right.set_title("placement (colour: service; number: replicas)")
    if num_experts * num_layers <= 64 * 64:
        for (layer, expert), where in placed_on.items():
            if len(where) > 1:
                right.text(expert, layer, str(len(where)), ha="center", va="center", fontsize=6, color="white")
    handles = [plt.Rectangle((0, 0), 1, 1, color=palette[0], label="attention process")]
    handles += [plt.Rectangle((0, 0), 1, 1, color=palette[1 + i], label=s) for i, s in enumerate(services)]
    right.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7)
    for ax in (left, right):
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
