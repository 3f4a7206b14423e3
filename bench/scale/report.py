"""Tables (Markdown) and plots (PNG) from a results file written by `python -m bench.scale`.

.venv/bin/python -m bench.scale.report bench/scale/results/results.json --plots docs
"""

from __future__ import annotations

import argparse
import json
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


def figures_table(results: list[dict[str, Any]]) -> str:
    head = (
        "| jobs | operator | all pods Running (s) | all jobs up (s) | pods created p50 / p99 (s) "
        "| pods Running p50 / p99 (s) | API requests / job until up | requests / job in the settle window "
        "| status writes / job | idle requests / job / min | idle status writes / job / min "
        "| operator CPU until up (s) | idle operator CPU (s / min) | RSS with all jobs up (MiB) "
        "| peak RSS (MiB) | machine busy | errors |\n|" + "---|" * 17 + "\n"
    )
    rows = []
    for r in sorted(results, key=lambda r: (r["jobs"], r["operator"])):
        req = r["requests"]
        idle_minutes = r["spec"]["steady_seconds"] / 60
        rows.append(
            f"| {r['jobs']} | {NAMES[r['operator']]} | {_f(r['all_pods_running_seconds'])} "
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


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "n/a"
    return f"{a / b:.2f}"


def ratio_table(results: list[dict[str, Any]]) -> str:
    by = {(r["jobs"], r["operator"]): r for r in results}
    sizes = sorted({r["jobs"] for r in results})
    head = (
        "| jobs | all pods Running | pods Running p50 | pods Running p99 | API requests / job "
        "| status writes / job | operator CPU | peak RSS |\n|" + "---|" * 8 + "\n"
    )
    rows = []
    for n in sizes:
        ours, ray = by.get((n, "colocate")), by.get((n, "kuberay"))
        if not ours or not ray:
            continue

        def pick(r: dict[str, Any], *path: str) -> float | None:
            value: Any = r
            for key in path:
                value = value[key]
            return value

        rows.append(
            "| "
            + " | ".join(
                [
                    str(n),
                    _ratio(ours["all_pods_running_seconds"], ray["all_pods_running_seconds"]),
                    _ratio(
                        pick(ours, "latency", "pods_running", "p50"),
                        pick(ray, "latency", "pods_running", "p50"),
                    ),
                    _ratio(
                        pick(ours, "latency", "pods_running", "p99"),
                        pick(ray, "latency", "pods_running", "p99"),
                    ),
                    _ratio(ours["requests"]["startup_per_job"], ray["requests"]["startup_per_job"]),
                    _ratio(_status_writes(ours), _status_writes(ray)),
                    _ratio(ours["operator_cpu_seconds"]["startup"], ray["operator_cpu_seconds"]["startup"]),
                    _ratio(_peak_mib(ours), _peak_mib(ray)),
                ]
            )
            + " |"
        )
    return head + "\n".join(rows) + "\n"


def plot(results: list[dict[str, Any]], directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    series: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(results, key=lambda r: r["jobs"]):
        series.setdefault(r["operator"], []).append(r)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [
        (axes[0][0], "time until all pods Running (s)", lambda r: r["all_pods_running_seconds"]),
        (
            axes[0][1],
            "per-job creation -> 4 pods Running, p99 (s)",
            lambda r: r["latency"]["pods_running"]["p99"],
        ),
        (
            axes[1][0],
            "API requests per job (creation until all jobs up)",
            lambda r: r["requests"]["startup_per_job"],
        ),
        (axes[1][1], "operator resident memory (MiB): peak, and with all jobs up (dotted)", _peak_mib),
    ]
    for ax, title, value in panels:
        for operator, rows in series.items():
            xs = [r["jobs"] for r in rows]
            ys = [value(r) for r in rows]
            ax.plot(xs, [y if y is not None else float("nan") for y in ys], marker="o", label=NAMES[operator])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("jobs (4 pods x 8 GPUs each)")
        ax.grid(alpha=0.3)
    if "kuberay" in series:
        rows = series["kuberay"]
        axes[0][0].plot(
            [r["jobs"] for r in rows],
            [1.5 * (r["all_pods_running_seconds"] or float("nan")) for r in rows],
            linestyle="--",
            color="gray",
            label="goal: 1.5 x KubeRay",
        )
    for index, (operator, rows) in enumerate(series.items()):
        axes[1][1].plot(
            [r["jobs"] for r in rows],
            [r["operator_rss_bytes"]["end"] / MiB for r in rows],
            linestyle=":",
            marker=".",
            color=f"C{index}",
            label=f"{NAMES[operator]}, all jobs up (no step events yet)",
        )
    axes[1][1].axhline(300 * 1e6 / MiB, linestyle="--", color="gray", label="goal: 300 MB")
    for ax in (axes[0][0], axes[1][1], axes[0][1], axes[1][0]):
        ax.legend(fontsize=8)
    fig.suptitle("Operator at scale: 1000 simulated 8-GPU nodes (kwok), each operator alone", fontsize=11)
    fig.tight_layout()
    path = directory / "benchmarks-operator-scale.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def steps_table(results: list[dict[str, Any]]) -> str:
    head = (
        "| jobs | steps per job | status writes / job / step | API requests / job / step "
        "| status caught up after (s) | jobs behind | operator CPU during steps (s / s) |\n|"
        + "---|" * 7
        + "\n"
    )
    rows = []
    for r in sorted(results, key=lambda r: r["jobs"]):
        s = r.get("step_events")
        if not isinstance(s, dict) or "status_writes_per_job_per_step" not in s:
            continue
        seconds = s["window"][1] - s["window"][0]
        rows.append(
            f"| {r['jobs']} | {s['steps']} | {s['status_writes_per_job_per_step']:.2f} "
            f"| {s['requests_per_job_per_step']:.2f} | {s['catch_up_seconds']:.1f} "
            f"| {s['jobs_behind_after_catch_up']} | {s['operator_cpu_seconds'] / seconds:.2f} |"
        )
    return head + "\n".join(rows) + "\n" if rows else ""


def render(results: list[dict[str, Any]]) -> str:
    text = "### Figures\n\n" + figures_table(results) + "\n### Ours / KubeRay\n\n" + ratio_table(results)
    steps = steps_table(results)
    if steps:
        text += "\n### Status writes while every job reports one step per second\n\n" + steps
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", type=Path)
    parser.add_argument("--plots", type=Path, default=None, help="write the PNG into this directory")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text())["runs"]
    print(render(results))
    if args.plots:
        for path in plot(results, args.plots):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
