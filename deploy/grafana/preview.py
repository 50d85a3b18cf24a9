"""Draw the Grafana dashboard's panels from a Prometheus, without Grafana.

    python deploy/grafana/preview.py --prometheus http://127.0.0.1:9090 --minutes 10 --out preview.png

Reads deploy/grafana/dashboards/splitmoe.json, runs every panel's queries over the last MINUTES
through Prometheus' HTTP API (query_range), and draws each panel where its gridPos puts it: time
series as lines, stats as their last values, the heat map as one row per series over time. It is
no Grafana: it exists because the monitoring docs' picture (docs/operate.md) was taken where Grafana could not be installed
(not in Debian's archive, no registry package), and it shows the dashboard's own queries on real
data. With Docker, `docker compose up` serves the real dashboard on :3000.
"""
from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen
import numpy as np  # noqa: E402

DASHBOARD = Path(__file__).resolve().parent / "dashboards" / "splitmoe.json"
BACKGROUND, PANEL, TEXT, GRID = "#111217", "#181b1f", "#ccccdc", "#2c3235"
COLORS = ["#73bf69", "#f2cc0c", "#5794f2", "#ff9830", "#f2495c", "#b877d9", "#8ab8ff", "#ffb357"]
ROW_INCHES = 0.42  # one gridPos unit of height (Grafana: 30 px per unit; 24 columns across)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prometheus", required=True, help="Prometheus base URL")
    p.add_argument("--minutes", type=float, default=15.0, help="time range, ending now")
    p.add_argument("--rate-interval", default="1m", help="what $__rate_interval stands for")
    p.add_argument("--dashboard", type=Path, default=DASHBOARD)
    p.add_argument("--out", type=Path, required=True, help="PNG to write")
    args = p.parse_args(argv)
    dashboard = json.loads(args.dashboard.read_text())
    end_s = time.time()
    window = (end_s - args.minutes * 60, end_s)
    with httpx.Client(base_url=args.prometheus, timeout=30) as client:
        data = {panel["id"]: [(t, query_range(client, t["expr"].replace("$__rate_interval", args.rate_interval),
                                              window)) for t in panel["targets"]]
                for panel in dashboard["panels"]}
    draw(dashboard, data, window, args.out)


def query_range(client: httpx.Client, expr: str, window: tuple[float, float]) -> list[dict]:
    start_s, end_s = window
    step_s = max((end_s - start_s) / 240, 1.0)
    answer = client.get("/api/v1/query_range", params={"query": expr, "start": start_s, "end": end_s,
                                                       "step": step_s}).json()
    if answer["status"] != "success":
        raise RuntimeError(f"{expr}: {answer.get('error')}")
    return answer["data"]["result"]


def legend(fmt: str, labels: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or str(labels)


def draw(dashboard: dict, data: dict, window: tuple[float, float], out: Path) -> None:
    panels = dashboard["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    height_in = rows * ROW_INCHES + 0.9
    fig = plt.figure(figsize=(16, height_in), facecolor=BACKGROUND)
    grid = fig.add_gridspec(rows, 24, left=0.04, right=0.99, top=1 - 0.75 / height_in, bottom=0.3 / height_in,
                            hspace=4.0, wspace=1.6)
    fig.suptitle(f"{dashboard['title']}: the dashboard's queries on Prometheus, last "
                 f"{(window[1] - window[0]) / 60:.0f} min", color=TEXT, fontsize=12, x=0.01, ha="left")
    for panel in panels:
        g = panel["gridPos"]
        ax = fig.add_subplot(grid[g["y"]:g["y"] + g["h"], g["x"]:g["x"] + g["w"]])
        style(ax, panel["title"])
        kind = {"timeseries": draw_series, "stat": draw_stat, "heatmap": draw_heatmap}[panel["type"]]
        kind(ax, panel, data[panel["id"]], window)
    fig.savefig(out, dpi=80, facecolor=BACKGROUND)
    plt.close(fig)


def style(ax, title: str) -> None:
    ax.set_facecolor(PANEL)
    ax.set_title(title, color=TEXT, fontsize=10, loc="left")
    ax.tick_params(colors=TEXT, labelsize=7)
    for spine in ax.spines.values():
        spine.set_color(GRID)


def draw_series(ax, panel: dict, targets: list, window: tuple[float, float]) -> None:
    unit = panel["fieldConfig"]["defaults"].get("unit", "short")
    n = 0
    for target, result in targets:
        for series in result:
            t, v = np.array(series["values"], dtype=float).T
            ax.plot((t - window[1]) / 60, v, color=COLORS[n % len(COLORS)], lw=1.5,
                    label=legend(target.get("legendFormat", ""), series["metric"]))
            n += 1
    ax.set_xlim((window[0] - window[1]) / 60, 0)
    minutes_axis(ax)
    ax.grid(color=GRID, lw=0.5)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: fmt(y, unit)))
    if n:
        ax.legend(fontsize=7, facecolor=PANEL, edgecolor=GRID, labelcolor=TEXT, loc="upper left")


def draw_stat(ax, panel: dict, targets: list, window: tuple[float, float]) -> None:
    mappings = panel["fieldConfig"]["defaults"].get("mappings", [{}])[0].get("options", {})
    cells = [(legend(t.get("legendFormat", ""), s["metric"]), s["values"][-1][1]) for t, r in targets for s in r]
    ax.set_xticks([])
    ax.set_yticks([])
    for i, (name, value) in enumerate(cells):
        mapped = mappings.get(str(int(float(value))), {"text": value, "color": "blue"})
        y = 1 - (i + 0.5) / max(len(cells), 1)
        ax.text(0.03, y, name, color=TEXT, fontsize=9, va="center", transform=ax.transAxes)
        ax.text(0.97, y, mapped["text"], color="white", fontsize=10, va="center", ha="right", transform=ax.transAxes,
                bbox={"facecolor": {"green": "#37872d", "red": "#c4162a"}.get(mapped["color"], "#1f60c4"),
                      "edgecolor": "none", "boxstyle": "round,pad=0.3"})


def draw_heatmap(ax, panel: dict, targets: list, window: tuple[float, float]) -> None:
    (target, result), = targets
    result = sorted(result, key=lambda s: tuple(int(s["metric"].get(k, 0)) for k in ("layer", "expert")))
    if not result:
        return
    times = sorted({float(t) for s in result for t, _ in s["values"]})
    index = {t: i for i, t in enumerate(times)}
    grid = np.full((len(result), len(times)), np.nan)
    for row, series in enumerate(result):
        for t, v in series["values"]:
            grid[row, index[float(t)]] = float(v)
    extent = ((times[0] - window[1]) / 60, (times[-1] - window[1]) / 60, len(result) - 0.5, -0.5)
    colors = matplotlib.colors.LinearSegmentedColormap.from_list("heat", [PANEL, "#8f3b0b", "#ff9830", "#fff2cc"])
    image = ax.imshow(grid, aspect="auto", cmap=colors, interpolation="nearest", extent=extent,
                      norm=matplotlib.colors.PowerNorm(0.5))
    ax.set_xlim((window[0] - window[1]) / 60, 0)
    minutes_axis(ax)
    ax.set_yticks(range(len(result)), [legend(target["legendFormat"], s["metric"]) for s in result], fontsize=6)
    bar = plt.colorbar(image, ax=ax, pad=0.01, fraction=0.03)
    bar.ax.tick_params(colors=TEXT, labelsize=7)
    bar.set_label("tokens/s", color=TEXT, fontsize=7)


def minutes_axis(ax) -> None:
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(5))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g} min"))


def fmt(value: float, unit: str) -> str:
    if unit == "percentunit":
        return f"{value * 100:.3g}%"
    if unit == "s":
        return f"{value * 1000:.3g} ms" if abs(value) < 1 else f"{value:.3g} s"
    return f"{value:g}"


if __name__ == "__main__":
    main()
