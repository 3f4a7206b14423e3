"""Tables (Markdown) and plots (PNG) from results files written by `python -m bench.scale`.

.venv/bin/python -m bench.scale.report bench/scale/results/<UTC time>/results.json --plots docs

Every run is a row of the figures table. Ratios (ours / KubeRay) are taken per repetition, between the two
runs of the same size and repetition (run next to each other), and given as the median with the lowest and
highest in brackets; the plot shows medians with the same spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

MiB = 2**20
NAMES = {
    "colocate": "ColocateJob (ours)",
    "colocate-managed": "ColocateJob (ours), Managed meta-store",
    "kuberay": "KubeRay",
}


def _f(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _peak_mib(r: dict[str, Any]) -> float:
    rss = r["operator_rss_bytes"]
    return max(rss["peak_vmhwm"], rss["peak_sampled"]) / MiB


def _peak_before_steps_mib(r: dict[str, Any]) -> float | None:
    """Peak sampled until the step window (older results lack it)."""
    value = r["operator_rss_bytes"].get("peak_sampled_before_steps")
    return value / MiB if value else None


def _status_writes(r: dict[str, Any]) -> float:
    """Per job, from creation until the end of the settle window."""
    req = r["requests"]
    return req["status_writes_startup_per_job"] + req["status_writes_settle_per_job"]


def _lat(r: dict[str, Any], kind: str) -> str:
    lat = r["latency"][kind]
    return f"{_f(lat['p50'])} / {_f(lat['p99'])}"


def _errors(r: dict[str, Any]) -> str:
    codes = {**r["requests"]["startup"]["errors"]}
    for code, n in [*r["requests"]["settle"]["errors"].items(), *r["requests"]["steady"]["errors"].items()]:
        codes[code] = codes.get(code, 0) + n
    parts = [f"{n}x{code}" for code, n in sorted(codes.items())]
    if r["operator_log"]["error_lines"]:
        parts.append(f"{r['operator_log']['error_lines']} log errors")
    if r["final_state"]["jobs_with_stale_status"]:
        parts.append(f"{r['final_state']['jobs_with_stale_status']} stale status")
    if not r["complete"]:
        parts.append("INCOMPLETE")
    return ", ".join(parts) or "none"


def _repeat(r: dict[str, Any]) -> int:
    return int(r.get("repeat", 0))


def figures_table(results: list[dict[str, Any]]) -> str:
    head = (
        "| jobs | operator | run | all pods Running (s) | all jobs up (s) | pods created p50 / p99 (s) "
        "| pods Running p50 / p99 (s) | API requests / job until up | requests / job in the settle window "
        "| status writes / job | idle requests / job / min | idle status writes / job / min "
        "| operator CPU until up (s) | idle operator CPU (s / min) | RSS with all jobs up (MiB) "
        "| peak RSS (MiB) | machine busy | errors |\n|" + "---|" * 18 + "\n"
    )
    rows = []
    for r in sorted(results, key=lambda r: (r["jobs"], _repeat(r), r["operator"])):
        req = r["requests"]
        idle_minutes = r["spec"]["steady_seconds"] / 60
        rows.append(
            f"| {r['jobs']} | {NAMES[r['operator']]} | {_repeat(r) + 1} "
            f"| {_f(r['all_pods_running_seconds'])} "
            f"| {_f(r['all_jobs_ready_seconds'])} | {_lat(r, 'pods_created')} | {_lat(r, 'pods_running')} "
            f"| {_f(req['startup_per_job'])} | {_f(req['settle']['total'] / r['jobs'])} "
            f"| {_f(_status_writes(r))} "
            f"| {_f(req['steady_per_job_per_minute'])} "
            f"| {_f(req['status_writes_steady_per_job_per_minute'], 2)} "
            f"| {_f(r['operator_cpu_seconds']['startup'])} "
            f"| {_f(r['operator_cpu_seconds']['steady'] / idle_minutes, 2)} "
            f"| {r['operator_rss_bytes']['end'] / MiB:.0f} | {_peak_mib(r):.0f} "
            f"| {r['machine']['busy_fraction_startup']:.0%} | {_errors(r)} |"
        )
    return head + "\n".join(rows) + "\n"


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def spread(values: list[float]) -> str:
    """Median, and the lowest and highest in brackets when there are several."""
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def _pick(*path: str) -> Callable[[dict[str, Any]], float | None]:
    def pick(r: dict[str, Any]) -> float | None:
        value: Any = r
        for key in path:
            value = value[key]
        return value

    return pick


RATIOS: list[tuple[str, Callable[[dict[str, Any]], float | None]]] = [
    ("all pods Running", _pick("all_pods_running_seconds")),
    ("pods Running p50", _pick("latency", "pods_running", "p50")),
    ("pods Running p99", _pick("latency", "pods_running", "p99")),
    ("API requests / job", _pick("requests", "startup_per_job")),
    ("status writes / job", _status_writes),
    ("operator CPU", _pick("operator_cpu_seconds", "startup")),
    ("peak RSS", _peak_mib),
    ("peak RSS before steps", _peak_before_steps_mib),
]


def pairs(results: list[dict[str, Any]], size: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(ours, KubeRay) of each repetition at `size` that has both."""
    by = {(r["operator"], _repeat(r)): r for r in results if r["jobs"] == size}
    repeats = sorted({repeat for _, repeat in by})
    return [
        (by[("colocate", n)], by[("kuberay", n)])
        for n in repeats
        if ("colocate", n) in by and ("kuberay", n) in by
    ]


def ratios(results: list[dict[str, Any]], size: int) -> dict[str, list[float]]:
    """Each ratio (ours / KubeRay) once per repetition of `size`; a pair lacking a figure adds nothing."""
    out: dict[str, list[float]] = {name: [] for name, _ in RATIOS}
    for ours, ray in pairs(results, size):
        for name, value in RATIOS:
            ratio = _ratio(value(ours), value(ray))
            if ratio is not None:
                out[name].append(ratio)
    return out


def ratio_table(results: list[dict[str, Any]]) -> str:
    sizes = sorted({r["jobs"] for r in results})
    head = "| jobs | pairs | " + " | ".join(name for name, _ in RATIOS) + " |\n|" + "---|" * (2 + len(RATIOS))
    rows = []
    for n in sizes:
        found = ratios(results, n)
        if not pairs(results, n):
            continue
        cells = [str(n), str(len(pairs(results, n)))] + [spread(found[name]) for name, _ in RATIOS]
        rows.append("| " + " | ".join(cells) + " |")
    return head + "\n" + "\n".join(rows) + "\n"


FIGURES: list[tuple[str, Callable[[dict[str, Any]], float | None]]] = [
    ("all pods Running (s)", _pick("all_pods_running_seconds")),
    ("API requests / job until up", _pick("requests", "startup_per_job")),
    ("operator CPU until up (s)", _pick("operator_cpu_seconds", "startup")),
    ("peak RSS (MiB)", _peak_mib),
    ("peak RSS before the step window (MiB)", _peak_before_steps_mib),
]


def median_table(results: list[dict[str, Any]]) -> str:
    head = (
        "| jobs | operator | runs | "
        + " | ".join(n for n, _ in FIGURES)
        + " |\n|"
        + "---|" * (3 + len(FIGURES))
    )
    rows = []
    for size in sorted({r["jobs"] for r in results}):
        for operator in sorted({r["operator"] for r in results if r["jobs"] == size}):
            mine = [r for r in results if r["jobs"] == size and r["operator"] == operator]
            cells = [str(size), NAMES[operator], f"{sum(r['complete'] for r in mine)}/{len(mine)} complete"]
            for _, value in FIGURES:
                values = [v for r in mine if (v := value(r)) is not None]
                cells.append(_spread1(values))
            rows.append("| " + " | ".join(cells) + " |")
    return head + "\n" + "\n".join(rows) + "\n"


def _spread1(values: list[float]) -> str:
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def _medians(results: list[dict[str, Any]], value: Callable[[dict[str, Any]], float | None]) -> dict:
    """operator -> (sizes, medians, lows, highs) over the repetitions of each size."""
    out: dict[str, tuple[list[int], list[float], list[float], list[float]]] = {}
    for operator in sorted({r["operator"] for r in results}):
        xs, mids, lows, highs = [], [], [], []
        for size in sorted({r["jobs"] for r in results if r["operator"] == operator}):
            values = [
                v
                for r in results
                if r["operator"] == operator and r["jobs"] == size and (v := value(r)) is not None
            ]
            if values:
                xs.append(size)
                mids.append(statistics.median(values))
                lows.append(min(values))
                highs.append(max(values))
        out[operator] = (xs, mids, lows, highs)
    return out


def plot(results: list[dict[str, Any]], directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [
        (axes[0][0], "time until all pods Running (s)", _pick("all_pods_running_seconds")),
        (
            axes[0][1],
            "operator CPU from the first job until all are up (s)",
            _pick("operator_cpu_seconds", "startup"),
        ),
        (
            axes[1][0],
            "API requests per job (creation until all jobs up)",
            _pick("requests", "startup_per_job"),
        ),
        (axes[1][1], "operator peak resident memory (MiB)", _peak_mib),
    ]
    for ax, title, value in panels:
        for index, (operator, (xs, mids, lows, highs)) in enumerate(_medians(results, value).items()):
            ax.errorbar(
                xs,
                mids,
                yerr=[
                    [m - lo for m, lo in zip(mids, lows, strict=True)],
                    [h - m for m, h in zip(mids, highs, strict=True)],
                ],
                marker="o",
                capsize=4,
                color=f"C{index}",
                label=f"{NAMES[operator]} (median, lowest-highest)",
            )
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("jobs (4 pods x 8 GPUs each)")
        ax.grid(alpha=0.3)
    ray = _medians([r for r in results if r["operator"] == "kuberay"], _peak_mib).get("kuberay")
    if ray and ray[0]:
        axes[1][1].plot(
            ray[0],
            [1.2 * m for m in ray[1]],
            linestyle="--",
            marker="_",
            markersize=24,
            color="gray",
            label="goal: 1.2 x KubeRay",
        )
    ray_requests = _medians(
        [r for r in results if r["operator"] == "kuberay"], _pick("requests", "startup_per_job")
    )
    if ray_requests.get("kuberay") and ray_requests["kuberay"][0]:
        axes[1][0].axhline(12, linestyle="--", color="gray", label="goal: 12")
    for ax in (axes[0][0], axes[0][1], axes[1][0], axes[1][1]):
        ax.legend(fontsize=8)
    repeats = max((_repeat(r) + 1 for r in results), default=1)
    fig.suptitle(
        "Operator at scale: simulated 8-GPU nodes (kwok), each operator alone, "
        f"{repeats} interleaved run{'s' if repeats != 1 else ''} per size",
        fontsize=11,
    )
    fig.tight_layout()
    path = directory / "benchmarks-operator-scale.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def steps_table(results: list[dict[str, Any]]) -> str:
    head = (
        "| jobs | run | steps per job | status writes / job / step | API requests / job / step "
        "| status caught up after (s) | jobs behind | operator CPU during steps (s / s) |\n|"
        + "---|" * 8
        + "\n"
    )
    rows = []
    for r in sorted(results, key=lambda r: (r["jobs"], _repeat(r))):
        s = r.get("step_events")
        if not isinstance(s, dict) or "status_writes_per_job_per_step" not in s:
            continue
        seconds = s["window"][1] - s["window"][0]
        rows.append(
            f"| {r['jobs']} | {_repeat(r) + 1} | {s['steps']} | {s['status_writes_per_job_per_step']:.2f} "
            f"| {s['requests_per_job_per_step']:.2f} | {s['catch_up_seconds']:.1f} "
            f"| {s['jobs_behind_after_catch_up']} | {s['operator_cpu_seconds'] / seconds:.2f} |"
        )
    return head + "\n".join(rows) + "\n" if rows else ""


def render(results: list[dict[str, Any]]) -> str:
    text = (
        "### Ours / KubeRay, per repetition: median (lowest-highest)\n\n"
        + ratio_table(results)
        + "\n### Medians of the runs (lowest-highest)\n\n"
        + median_table(results)
        + "\n### Figures of every run\n\n"
        + figures_table(results)
    )
    steps = steps_table(results)
    if steps:
        text += "\n### Status writes while every job reports one step per second\n\n" + steps
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", type=Path, nargs="+", help="results.json files; their runs are pooled")
    parser.add_argument("--plots", type=Path, default=None, help="write the PNG into this directory")
    args = parser.parse_args(argv)
    results = [run for path in args.results for run in json.loads(path.read_text())["runs"]]
    print(render(results))
    if args.plots:
        for path in plot(results, args.plots):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
