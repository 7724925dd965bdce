"""Plot step time against model size from ``step_time.py --out`` JSON lines.

    python benchmarks/plot.py results.jsonl step_time.png

Left: median step time per implementation against parameter count (log-log), one line
per (implementation, world size). Right: each implementation's step time divided by
``nocomm``'s from the same launch (the cost of communication and sharding). Lines with
the same model and world size (repeated launches) are combined by their median; lines of
the variants (``--wrap titan``, ``--foreach``, ``--malloc keep``) are left out.
Needs matplotlib (``pip install matplotlib``), which the package itself does not.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics

COLORS = {"fsdp2": "tab:blue", "torch_fsdp2": "tab:orange", "ddp": "tab:green", "nocomm": "tab:gray"}
STYLES = ["-", "--", ":", "-."]  # one per world size


def load(path: str) -> dict[tuple[str, int], dict[int, dict[str, list[float]]]]:
    """{(impl, world): {params: {"time": [...], "vs_nocomm": [...]}}} over every line of ``path``."""
    series: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: collections.defaultdict(list)))
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                params, world, median = rec["config"]["params"], rec["config"]["world"], rec["median_s"]
            except (json.JSONDecodeError, KeyError) as e:
                raise SystemExit(f"{path}:{n}: not a step_time.py result line ({e})") from None
            cfg = rec["config"]
            if cfg.get("wrap", "blocks") != "blocks" or cfg.get("foreach") or cfg.get("malloc", "default") != "default":
                continue  # variants (--wrap titan, --foreach, --malloc keep) are not mixed into the default's lines
            for impl, t in median.items():
                point = series[impl, world][params]
                point["time"].append(t)
                if "nocomm" in median:
                    point["vs_nocomm"].append(t / median["nocomm"])
    return series


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", help="JSON lines written by step_time.py --out")
    p.add_argument("output", help="image file to write (.png, .svg, .pdf)")
    return p


def main() -> None:
    args = build_parser().parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plot.py needs matplotlib: pip install matplotlib") from None

    series = load(args.results)
    if not series:
        raise SystemExit(f"{args.results}: no results")
    worlds = sorted({world for _impl, world in series})
    fig, (ax_time, ax_ratio) = plt.subplots(1, 2, figsize=(12, 4.5))
    order = {impl: i for i, impl in enumerate(COLORS)}
    for (impl, world), points in sorted(series.items(), key=lambda kv: (order.get(kv[0][0], len(order)), kv[0][1])):
        sizes = sorted(points)
        x = [s / 1e6 for s in sizes]
        style = dict(color=COLORS.get(impl), linestyle=STYLES[worlds.index(world) % len(STYLES)], marker="o",
                     label=f"{impl} ({world} ranks)")
        ax_time.plot(x, [statistics.median(points[s]["time"]) for s in sizes], **style)
        if impl != "nocomm" and all(points[s]["vs_nocomm"] for s in sizes):
            ax_ratio.plot(x, [statistics.median(points[s]["vs_nocomm"]) for s in sizes], **style)
    ax_time.set(xscale="log", yscale="log", xlabel="parameters (millions)", ylabel="median step time (s)",
                title="step time (forward + backward + AdamW)")
    ax_ratio.axhline(1.0, color="tab:gray", linewidth=0.8)
    ax_ratio.set(xscale="log", xlabel="parameters (millions)", ylabel="step time / nocomm step time",
                 title="overhead over no communication (same launch)")
    for ax in (ax_time, ax_ratio):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
