"""A run's result as PNG plots: tokens/s and speed-up per column, and acceptance by draft position."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dynamo_spec.bench.speedups import BASELINE, CONFIGURED, REPEAT, SCHEDULE, SPEC_K0

FILES = ("throughput.png", "acceptance_by_position.png")


def plots(result: Mapping[str, Any], out_dir: Any) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns, cs = result["columns"], result["settings"]["concurrency"]
    written = []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, column in columns.items():
        cells = column["cells"].get("judge", {})
        xs = [c for c in cs if str(c) in cells]
        style = ({"linewidth": 3, "color": "black"} if name == SCHEDULE else {"linewidth": 2, "color": "grey"}
                 if name == CONFIGURED else {"linestyle": "--"} if name == REPEAT else {})
        ax1.plot(xs, [cells[str(c)]["output_tokens_per_s"] for c in xs], marker="o", label=name, **style)
        ax2.plot(xs, [cells[str(c)].get("speedup") or 0 for c in xs], marker="o", label=name, **style)
    for ax, title in ((ax1, "output tokens/s"), (ax2, "speed-up vs k=0")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax2.axhline(1.0, color="grey", linewidth=1)
    ax1.legend(fontsize=8)
    fig.suptitle(f"{result['settings']['model']} on {result['host']['cpu_model']} (judge prompts)")
    fig.tight_layout()
    path = f"{out_dir}/{FILES[0]}"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, column in columns.items():
        if not name.startswith("k=") or name in (BASELINE, REPEAT, SPEC_K0):
            continue
        cells = [cell for cell in column["cells"].get("judge", {}).values() if cell["drafts"]]
        if not cells:
            continue
        drafts = sum(cell["drafts"] for cell in cells)
        k = len(cells[0]["per_position_acceptance"])
        per_pos = [sum(cell["per_position_acceptance"][p] * cell["drafts"] for cell in cells) / drafts
                   for p in range(k)]
        ax.plot(range(1, k + 1), per_pos, marker="o", label=name)
    ax.set_xlabel("draft position")
    ax.set_ylabel("share of drafts accepted at this position")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("acceptance by position (judge prompts, all concurrencies)")
    fig.tight_layout()
    path = f"{out_dir}/{FILES[1]}"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written
