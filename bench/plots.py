"""PNG pictures of benchmark results (matplotlib, Agg backend: no display needed).

- `plot_cdfs`: latency CDFs (TTFT, ITL, E2EL) of one or more runs, one line each.
- `plot_sweep`: throughput and latency (median, p99) against the request rate.
- `plot_compare`: deployments side by side (p99 ITL, TTFT, goodput) plus ITL CDFs.
- `plot_timeline`: one run's engine steps, one row per rank, bars coloured by kind,
  KV hand-offs marked (in the manner of the chapter's Figure 5.1).
- `plot_pool_timeline`: ranks per pool, load and SLO attainment against time, the
  planner's decisions marked (a `pool_timeline` of load_timeline.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def _plt():
    # lazy: matplotlib is heavy; only drawing needs it
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib is heavy; only drawing needs it (after use("Agg"))
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values_ms, label: str) -> None:
    v = np.sort(np.asarray([x for x in values_ms if x is not None], dtype=float))
    if v.size == 0:
        return
    ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=f"{label} (n={v.size})")


def _ok(result: dict, key: str) -> list[float]:
    """Per-request values (ms) of successful requests; itls flattened."""
    ok = [not e for e in result["errors"]]
    vals = result[key]
    if key == "itls":
        return [g * 1000 for good, gaps in zip(ok, vals, strict=False) if good for g in gaps]
    return [v * 1000 for good, v in zip(ok, vals, strict=False) if good and v is not None]


def plot_cdfs(results: dict[str, dict], path: str | Path, title: str = "") -> Path:
    """One panel per metric (TTFT, ITL, E2EL), one CDF line per result."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, name) in zip(axes, (("ttfts", "TTFT"), ("itls", "ITL (per chunk)"),
                                      ("e2els", "E2EL")), strict=False):
        for label, r in results.items():
            _cdf(ax, _ok(r, key), label)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if key != "itls" else "fraction of gaps")
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3)
        ax.set_ylim(0, 1.02)
        if ax.has_data():
            ax.legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def _rate_x(runs: list[dict]) -> tuple[list[float], list[str]]:
    finite = [float(r["request_rate"]) for r in runs if r["request_rate"] != "inf"]
    inf_x = (max(finite) * 2 if finite else 1.0)
    xs = [inf_x if r["request_rate"] == "inf" else float(r["request_rate"]) for r in runs]
    labels = ["inf" if r["request_rate"] == "inf" else f"{float(r['request_rate']):g}" for r in runs]
    return xs, labels


def plot_sweep(runs: list[dict], path: str | Path, title: str = "") -> Path:
    """Throughput, TTFT and ITL (median and p99) against the offered request rate."""
    plt = _plt()
    xs, labels = _rate_x(runs)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    ax.plot(xs, [r["request_throughput"] for r in runs], "o-", label="requests/s")
    if any(r.get("request_goodput") is not None for r in runs):
        ax.plot(xs, [r.get("request_goodput") or 0 for r in runs], "s--", label="goodput req/s")
    ax.set_ylabel("requests/s")
    ax2 = ax.twinx()
    ax2.plot(xs, [r["output_throughput"] for r in runs], "^:", color="C2", label="output tok/s")
    ax2.set_ylabel("output tokens/s")
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="lower right", fontsize=8)
    ax.set_title("throughput")
    for ax, key, name in ((axes[1], "ttft", "TTFT"), (axes[2], "itl", "ITL")):
        ax.plot(xs, [r[f"median_{key}_ms"] for r in runs], "o-", label="median")
        ax.plot(xs, [r[f"p99_{key}_ms"] for r in runs], "s--", label="p99")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} vs request rate")
        ax.legend(fontsize=8)
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.set_xticks(xs)
        ax.set_xticklabels(labels)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_compare(results: dict[str, dict], path: str | Path, title: str = "",
                 kind: str | None = None, interference: dict | None = None) -> Path:
    """Bars of p99 ITL, p99 TTFT and goodput per deployment, and their ITL CDFs.
    `kind` (e.g. "short") takes the latency bars from that dataset class's metrics;
    `interference` (compare_modes.interference) adds the chats' p99 ITL with long
    prompts among them against alone."""
    plt = _plt()
    names = list(results)
    panels = 5 if interference else 4
    fig, axes = plt.subplots(1, panels, figsize=(4.5 * panels, 4.2))

    def metric(r, key):
        by_kind = kind and key != "request_goodput"  # goodput: the whole workload
        src = r.get("by_kind", {}).get(kind, r) if by_kind else r
        v = src.get(key)
        return 0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else v

    for ax, key, label in ((axes[0], "p99_itl_ms", "p99 ITL (ms)"),
                           (axes[1], "p99_ttft_ms", "p99 TTFT (ms)"),
                           (axes[2], "request_goodput", "goodput (req/s)")):
        vals = [metric(results[n], key) for n in names]
        bars = ax.bar(names, vals, color=[f"C{i}" for i in range(len(names))])
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_title(label + (f" [{kind}]" if kind and key != "request_goodput" else ""))
        ax.grid(alpha=0.3, axis="y")
    for n in names:
        _cdf(axes[3], _ok(results[n], "itls"), n)
    axes[3].set_xlabel("ITL (ms)")
    axes[3].set_title("ITL CDF (all requests)")
    axes[3].grid(alpha=0.3)
    if axes[3].has_data():
        axes[3].legend(fontsize=8, loc="lower right")
    if interference:
        ax = axes[4]
        x = np.arange(len(names))
        row = [interference.get(n, {}).get("p99_itl_ms", {}) for n in names]
        for off, key, label in ((-0.2, "short_only", "short chats alone"),
                                (0.2, "with_long", "with long prompts")):
            bars = ax.bar(x + off, [v.get(key) or 0.0 for v in row], 0.4, label=label)
            ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_xticks(x)
        ax.set_xticklabels(names)
        ax.set_title("short chats' p99 ITL (ms): interference")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_kv_transfer(result: dict, path: str | Path) -> Path:
    """Bandwidth (MiB/s) per payload size: each transport beside memcpy."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    sizes = result["sizes_mib"]
    for name, rows in result["bandwidth_mib_s"].items():
        ax.plot(sizes, rows, "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("payload (MiB)")
    ax.set_ylabel("bandwidth (MiB/s, median)")
    ax.set_title("KV hand-off bandwidth vs in-memory copy")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


TIMELINE_COLORS = {"prompt": "tab:blue", "decode": "tab:green", "empty_prompt": "#f5b971",
                   "empty": "#c8c8c8"}
_POOL_ORDER = {"prefill": 0, "normal": 1, "decode": 2}


def timeline_window(records: list[dict], width_s: float | None = None) -> tuple[float, float]:
    """A window worth zooming into: around the median KV hand-off (else the middle)."""
    t0 = min(r["start"] for r in records)
    t1 = max(r["end"] for r in records)
    width = width_s or max(0.5, min(3.0, (t1 - t0) / 8))
    marks = sorted(r["handoff_end"] for r in records if r.get("num_handoffs"))
    centre = marks[len(marks) // 2] if marks else (t0 + t1) / 2
    lo = max(t0, centre - width / 3)
    return lo, min(t1, lo + width)


def plot_timeline(records: list[dict], path: str | Path, title: str = "",
                  zoom_s: float | None = None) -> Path:
    """Engine steps per rank (rows) against time: prompt (prefill chunks), decode,
    empty_prompt and empty steps as bars; KV exports (prefill, v) and imports (decode,
    ^) as red marks. Top: the whole run; bottom: a window of `zoom_s` seconds."""
    plt = _plt()
    if not records:
        raise ValueError("no step records to draw")
    rows = sorted({(r["pool"], r["rank"]) for r in records},
                  key=lambda k: (_POOL_ORDER.get(k[0], 9), k[0], k[1]))
    index = {k: i for i, k in enumerate(rows)}
    t0 = min(r["start"] for r in records)
    window = timeline_window(records, zoom_s)
    fig, axes = plt.subplots(2, 1, figsize=(14, 2.2 + 1.3 * len(rows)))
    for ax, (lo, hi) in zip(axes, ((None, None), window), strict=True):
        for kind, color in TIMELINE_COLORS.items():
            for k, i in index.items():
                spans = [(r["start"] - t0, max(r["end"] - r["start"], 1e-4)) for r in records
                         if r["kind"] == kind and (r["pool"], r["rank"]) == k]
                if spans:
                    ax.broken_barh(spans, (i - 0.35, 0.7), facecolors=color, edgecolors="none",
                                   label=kind)
        # Empty steps last well under a millisecond (the rank then waits at the next
        # vote): a tick marks each, or they would not show at the scale of a run.
        ticks = [(r["start"] - t0, index[(r["pool"], r["rank"])]) for r in records
                 if r["kind"] in ("empty", "empty_prompt")]
        if ticks:
            xs, ys = zip(*ticks, strict=True)
            ax.scatter(xs, ys, marker="|", s=120, color="#9a9a9a", linewidths=0.8, zorder=2)
        for marker, sel in (("v", lambda r: r["kind"] != "import" and r.get("num_handoffs")),
                            ("^", lambda r: r["kind"] == "import")):
            pts = [(r["handoff_end"] - t0, index[(r["pool"], r["rank"])] + 0.42)
                   for r in records if sel(r)]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.scatter(xs, ys, marker=marker, s=18, color="tab:red", zorder=3,
                           label="KV export" if marker == "v" else "KV import")
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"{p} {r}" for p, r in rows])
        ax.set_ylim(len(rows) - 0.4, -0.6)
        ax.grid(alpha=0.3, axis="x")
        if lo is not None:
            ax.set_xlim(lo - t0, hi - t0)
            ax.set_title(f"zoom: {hi - lo:.2f} s", fontsize=9)
        ax.set_xlabel("seconds since the first step")
    handles, labels = axes[0].get_legend_handles_labels()
    uniq = dict(zip(labels, handles, strict=True))
    axes[0].legend(uniq.values(), uniq.keys(), fontsize=8, loc="upper right", ncol=6)
    counts = {k: sum(1 for r in records if r["kind"] == k) for k in (*TIMELINE_COLORS, "import")}
    axes[0].set_title(title or "engine steps per rank: " + ", ".join(
        f"{n} {k}" for k, n in counts.items() if n))
    fig.tight_layout()
    return _save(fig, path)


POOL_COLORS = {"prefill": "tab:blue", "decode": "tab:green", "normal": "tab:purple"}


def plot_pool_timeline(timeline: dict, path: str | Path, title: str = "") -> Path:
    """Three rows against seconds since the run's start: ready ranks per pool (solid)
    and their target (dashed), the planner's decisions as arrows labelled with their
    outcome; the load (requests sent per second per bin, the schedule's rate, requests
    in flight); and the share of requests sent in each bin that met the objectives."""
    plt = _plt()
    samples = timeline["samples"]
    if not samples:
        raise ValueError("no pool samples to draw")
    fig, (ranks, load, slo) = plt.subplots(3, 1, figsize=(12, 9), sharex=True)
    _draw_pool_ranks(ranks, timeline)
    _draw_pool_load(load, timeline)
    _draw_slo_attainment(slo, timeline)
    ranks.set_title(title or "ranks per pool, load and SLO attainment")
    fig.tight_layout()
    return _save(fig, path)


def _draw_pool_ranks(ranks, timeline: dict) -> None:
    """Ready and target ranks per pool, and the planner's decisions as arrows."""
    samples = timeline["samples"]
    ts = [s["t"] for s in samples]
    pools = sorted({p for s in samples for p in s["target"]}, key=lambda p: _POOL_ORDER.get(p, 9))
    for i, pool in enumerate(pools):
        color = POOL_COLORS.get(pool, "tab:gray")
        lift = 0.04 * (i - (len(pools) - 1) / 2)  # pools of one size stay apart
        ranks.step(ts, [s["ready"].get(pool, 0) + lift for s in samples], where="post",
                   color=color, label=f"{pool} ready")
        ranks.step(ts, [s["target"].get(pool, 0) + lift for s in samples], where="post",
                   color=color, linestyle="--", alpha=0.6, label=f"{pool} target")
    planner = timeline.get("planner") or {}
    start = timeline.get("start_unix_s") or 0.0
    for d in planner.get("decisions", []):
        x = d["at"] - start
        if x < 0:
            continue
        ranks.annotate(f"{d['pool']} {d['from']}->{d['to']} {d['outcome']}",
                       (x, d["to"]), xytext=(x, d["from"]), fontsize=7,
                       color=POOL_COLORS.get(d["pool"], "k"),
                       arrowprops={"arrowstyle": "->", "color": POOL_COLORS.get(d["pool"], "k")})
    ranks.set_ylabel("ranks")
    ranks.set_ylim(0, max(max(s["target"].values() or [1]) for s in samples) + 1.5)
    ranks.legend(fontsize=8, loc="upper right", ncol=2)
    ranks.grid(alpha=0.3)


def _draw_pool_load(load, timeline: dict) -> None:
    """Requests sent per second per bin, the schedule's rate, and requests in flight."""
    samples = timeline["samples"]
    bins = timeline.get("bins") or []
    bin_s = timeline.get("bin_s") or 1.0
    if bins:
        load.bar([b["t"] for b in bins], [b["rate"] for b in bins], width=bin_s, align="edge",
                 color="#b0c4de", label=f"sent (req/s, {bin_s:g} s bins)")
    if timeline.get("schedule"):
        xs, ys, t = [], [], 0.0
        for step in timeline["schedule"]:
            xs += [t, t + step["duration_s"]]
            ys += [step["rate"], step["rate"]]
            t += step["duration_s"]
        load.plot(xs, ys, color="k", linewidth=1, label="scheduled rate")
    load.set_ylabel("requests / s")
    inflight = load.twinx()
    inflight.plot([s["t"] for s in samples], [s["num_inflight"] for s in samples],
                  color="tab:orange", linewidth=1)
    inflight.set_ylabel("in flight", color="tab:orange")
    load.legend(fontsize=8, loc="upper left")
    load.grid(alpha=0.3)


def _draw_slo_attainment(slo, timeline: dict) -> None:
    """The share of each bin's requests that met the objectives (when there are any)."""
    bins = timeline.get("bins") or []
    bin_s = timeline.get("bin_s") or 1.0
    judged = timeline.get("objectives_ms") or {}
    if judged and bins:
        xs = [b["t"] + bin_s / 2 for b in bins if b["attainment"] is not None]
        ys = [100 * b["attainment"] for b in bins if b["attainment"] is not None]
        slo.plot(xs, ys, marker="o", markersize=3, color="tab:red")
        slo.set_ylim(-5, 105)
        slo.set_title("requests meeting " + ", ".join(f"{k} <= {v:g} ms" for k, v in judged.items()),
                      fontsize=9)
    else:
        slo.set_title("no objectives (--goodput, or the planner's) to judge against", fontsize=9)
    slo.set_ylabel("SLO attainment (%)")
    slo.set_xlabel("seconds since the run's start")
    slo.grid(alpha=0.3)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return path
