"""`python -m bench.scale.projection RESULTS.json ...`: our operator's cost at sizes this machine cannot run,
projected from the measured runs (issue 35 item 3). See docs/benchmarks.md ("Projection past this machine").

Each figure is fitted as `fixed + per_job x jobs` (least squares over our runs of every size given; one size
alone: through the origin), then evaluated at --jobs. What is projected, per replica:
- bring-up: operator CPU until every job is up (all created at once), API requests;
- memory: resident set with every job up, and its peak while every job reports steps;
- steps: CPU per job-step (one step = 32 GPUs' records) at the size that saturated the operator, and what a
  step every --step-period seconds costs at --jobs (the event loop is one thread: one core at most);
- idle: the periodic resync, the one idle cost that grows with the jobs since issue 35 (the step followers
  and readers cost one blocking XREAD per meta-store endpoint every 30 s). Its cost per job and interval is
  measured apart (--resync-ms-per-job: the resync thread's CPU plus the passes it queues, from a
  `--profile-idle` run's <run>-idle-threads.txt): a short steady window may not hold a resync.
The limits: the chart's memory limit, one core, and the share of a core the resync may take.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIB = 2**20
POD_LIST_BYTES_PER_POD = 15_000  # a worker pod's JSON in a LIST (kwok pods, managedFields included)
PODS_PER_JOB = 4


@dataclass(frozen=True)
class Fit:
    fixed: float
    per_job: float

    def at(self, jobs: float) -> float:
        return self.fixed + self.per_job * jobs


def fit(points: list[tuple[float, float]]) -> Fit:
    """Least squares `y = fixed + per_job x jobs`; through the origin when every point has one size."""
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        return Fit(0.0, sum(y for _, y in points) / max(1.0, sum(xs)))
    mx, my = sum(xs) / len(points), sum(y for _, y in points) / len(points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    return Fit(my - slope * mx, slope)


def ours(paths: list[Path]) -> list[dict[str, Any]]:
    runs = [r for p in paths for r in json.loads(p.read_text())["runs"]]
    return [r for r in runs if r.get("operator") == "colocate" and r.get("complete")]


def step_cost(runs: list[dict[str, Any]]) -> float:
    """CPU seconds per job-step at the largest size measured (where the operator was busiest)."""
    stepped = [r for r in runs if isinstance(r.get("step_events"), dict) and r["step_events"].get("steps")]
    if not stepped:
        return 0.0
    top = max(r["jobs"] for r in stepped)
    costs = [
        r["step_events"]["operator_cpu_seconds"] / (r["step_events"]["steps"] * r["jobs"])
        for r in stepped
        if r["jobs"] == top
    ]
    return sum(costs) / len(costs)


def models(runs: list[dict[str, Any]]) -> dict[str, Fit]:
    def points(value: Any) -> list[tuple[float, float]]:
        return [(float(r["jobs"]), float(value(r))) for r in runs]

    return {
        "cpu_up_s": fit(points(lambda r: r["operator_cpu_seconds"]["startup"])),
        "requests": fit(points(lambda r: r["requests"]["startup_per_job"] * r["jobs"])),
        "rss_up_mib": fit(points(lambda r: r["operator_rss_bytes"]["peak_sampled_before_steps"] / MIB)),
        "rss_peak_mib": fit(
            points(
                lambda r: (
                    max(r["operator_rss_bytes"]["peak_vmhwm"], r["operator_rss_bytes"]["peak_sampled"]) / MIB
                )
            )
        ),
    }


def render(args: argparse.Namespace, runs: list[dict[str, Any]]) -> str:
    m, per_step = models(runs), step_cost(runs)
    resync = args.resync_ms_per_job / 1000
    sizes = sorted({r["jobs"] for r in runs})
    lines = [
        f"Fitted on {len(runs)} runs of our operator ({', '.join(map(str, sizes))} jobs); per job: "
        f"{m['cpu_up_s'].per_job * 1000:.0f} ms CPU until up, {m['requests'].per_job:.1f} requests, "
        f"{m['rss_up_mib'].per_job * 1024:.0f} KiB resident ({m['rss_peak_mib'].per_job * 1024:.0f} KiB at "
        f"the step peak), {per_step * 1000:.2f} ms CPU per job-step, resync {args.resync_ms_per_job:.1f} ms "
        f"per job every {args.resync_interval:.0f} s.",
        "",
        "| jobs | CPU until up (s of one core) | requests until up | RSS up / step peak (MiB) "
        f"| steps, one per job every {args.step_period:.0f} s (cores) "
        "| resync (share of a core) | pod LIST per resync (MB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for jobs in args.jobs:
        steps_core = jobs / args.step_period * per_step
        lines.append(
            f"| {jobs} | {m['cpu_up_s'].at(jobs):.0f} | {m['requests'].at(jobs):.0f} "
            f"| {m['rss_up_mib'].at(jobs):.0f} / {m['rss_peak_mib'].at(jobs):.0f} | {steps_core:.2f} "
            f"| {jobs * resync / args.resync_interval:.2f} "
            f"| {jobs * PODS_PER_JOB * POD_LIST_BYTES_PER_POD / 1e6:.0f} |"
        )
    peak = m["rss_peak_mib"]
    lines += [
        "",
        "Jobs one replica holds before a limit: "
        f"memory limit {args.memory_limit_mib} MiB at the step peak: "
        f"{(args.memory_limit_mib - peak.fixed) / peak.per_job:.0f}; "
        f"one core of steps, one per job every {args.step_period:.0f} s: {args.step_period / per_step:.0f}; "
        f"the resync at {args.resync_share:.0%} of a core: "
        f"{args.resync_share * args.resync_interval / resync:.0f}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale.projection", description=__doc__)
    parser.add_argument("results", nargs="+", type=Path, help="results.json of bench.scale runs")
    parser.add_argument("--jobs", type=int, nargs="+", default=[5000, 10000])
    parser.add_argument("--step-period", type=float, default=60.0, help="seconds between a job's steps")
    parser.add_argument(
        "--resync-ms-per-job", type=float, default=3.1, help="measured: 1.16 s / 250 jobs, 3.1 s / 1000"
    )
    parser.add_argument("--resync-interval", type=float, default=120.0, help="the operator's default")
    parser.add_argument("--resync-share", type=float, default=0.1, help="of a core the resync may take")
    parser.add_argument("--memory-limit-mib", type=int, default=512, help="the chart's default limit")
    args = parser.parse_args(argv)
    runs = ours(args.results)
    if not runs:
        raise SystemExit("no complete run of our operator in the results given")
    print(render(args, runs), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
