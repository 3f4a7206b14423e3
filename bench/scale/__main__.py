"""`python -m bench.scale`: our operator and KubeRay's, each alone, on one local control plane with many
fake 8-GPU nodes (kwok), at several numbers of jobs. See docs/benchmarks-history.md ("Operator at scale").

    .venv/bin/python -m bench.scale --sizes 250,500 --nodes 2000 --repeats 3

Per size the operators run interleaved, `--repeats` times (ours, KubeRay, ours, KubeRay, ...), so a change in
the machine's load falls on both; the tables give each ratio's median and spread over the repetitions.
Writes <out>/<UTC time>/results.json (every figure of every run, written after each run), tables.md and the
plot; the control plane's logs, the operators' logs and the audit log stay in --workdir.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.scale import report
from bench.scale.run import RunSpec, run
from bench.scale.source import snapshot
from bench.scale.steps import RECORDS
from bench.scale.testbed import ROOT, Testbed, cpu_nodes_for, say
from bench.scale.workloads import PODS_PER_JOB


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sizes", default="10,50,100,250", help="numbers of jobs, comma-separated")
    parser.add_argument("--nodes", type=int, default=1000, help="fake GPU nodes of 8 GPUs (default 1000)")
    parser.add_argument(
        "--operators",
        default="colocate,kuberay",
        help="comma-separated: colocate (ours: External meta-store, step-event daemon, step window), "
        "kuberay, colocate-managed (ours with the default Managed meta-store, no step window)",
    )
    parser.add_argument("--settle", type=float, default=30.0, help="seconds after all jobs are up")
    parser.add_argument("--steady", type=float, default=60.0, help="idle window measured afterwards (s)")
    parser.add_argument("--steps", type=float, default=60.0, help="step-event window of colocate (s)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="interleaved runs of each operator per size (default 3)"
    )
    parser.add_argument(
        "--up-timeout",
        type=float,
        default=None,
        help="seconds a run may wait for every pod Running before it stops as incomplete "
        "(default 180 + 2 per job)",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="create the jobs at this many a second, evenly spaced (default: all at once); the times "
        "until Running per job then matter more than the time until all pods are Running",
    )
    parser.add_argument(
        "--node-lease-seconds",
        type=int,
        default=40,
        help="kwok renews each fake node's Lease every quarter of this (default 40 s, a kubelet's): 4000 "
        "nodes renew 400 a second, about a core of kube-apiserver's on this 2-core machine; a control plane "
        "for 4000 real nodes has cores of its own for it (docs/benchmarks.md). At most 300 (the testbed's "
        "node monitor allows 10 minutes)",
    )
    parser.add_argument(
        "--step-records",
        choices=RECORDS,
        default="job",
        help="what the step window's emitter writes a job and step (bench/scale/steps.py): job (default): "
        "the one `completed` record the operator reads in summary mode; gpu: each of the 32 GPUs runs the "
        "runtime's summary script in the shared Redis, as the pods do in their own (about a core at 1000 "
        "jobs on this machine); detailed: 32 `finished` records",
    )
    parser.add_argument(
        "--profile-idle",
        action="store_true",
        help="sample our operator with py-spy through the steady window (dev tool; it costs the "
        "operator nothing measurable but the machine some CPU): <workdir>/operator-logs/<run>-idle.txt",
    )
    parser.add_argument(
        "--fresh-bed",
        action="store_true",
        help="a new control plane for every run (default: a new one only when a run's teardown left pods)",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="control plane state and logs")
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "bench" / "scale" / "results",
        help="a new directory per invocation is made in here",
    )
    parser.add_argument("--plots", type=Path, default=None, help="write the PNG here (e.g. docs)")
    parser.add_argument(
        "--operator-ref",
        default="HEAD",
        help="git revision of our operator to measure (default HEAD; 'worktree': the work tree as it is)",
    )
    return parser.parse_args(argv)


def build_kuberay() -> tuple[Path, Path]:
    """The ray-operator binary and KubeRay's module directory (its CRDs), via scripts/build-kuberay.sh."""
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "build-kuberay.sh")], capture_output=True, text=True, timeout=1800
    )
    sys.stderr.write(out.stderr)
    if out.returncode != 0:
        raise SystemExit(f"scripts/build-kuberay.sh failed ({out.returncode})")
    bin_dir, module_dir = out.stdout.strip().splitlines()[-2:]
    return Path(bin_dir) / "ray-operator", Path(module_dir) / "config" / "crd" / "bases"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    operators = [o.strip() for o in args.operators.split(",") if o.strip()]
    if unknown := set(operators) - {"colocate", "kuberay", "colocate-managed"}:
        raise SystemExit(f"unknown operators: {', '.join(sorted(unknown))}")
    if max(sizes) * PODS_PER_JOB > args.nodes:
        raise SystemExit(
            f"{max(sizes)} jobs need {max(sizes) * PODS_PER_JOB} GPU nodes; --nodes is {args.nodes}"
        )
    kuberay_bin, kuberay_crds = build_kuberay() if "kuberay" in operators else (None, None)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="colocate-scale-"))
    out = args.out / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out.mkdir(parents=True, exist_ok=True)
    say(f"work directory (logs, audit log): {workdir}")
    source = snapshot(args.operator_ref, workdir / "operator-source")
    say(f"our operator: {source.commit or 'work tree'}")
    beds = itertools.count()

    def new_bed() -> Testbed:
        n = next(beds)  # each bed its own directory: a control plane keeps its etcd data in it
        return Testbed(
            workdir / f"bed-{n}" if n else workdir,
            args.nodes,
            cpu_nodes_for(max(sizes)),
            kuberay_crd_dir=kuberay_crds,
            with_redis="colocate" in operators,
            source=source,
            node_lease_seconds=args.node_lease_seconds,
        ).start()

    started = time.monotonic()
    bed = new_bed()
    runs: list[dict] = []
    failed: list[dict] = []
    try:
        for i, (size, repeat, operator) in enumerate(schedule(sizes, operators, args.repeats)):
            if i and (args.fresh_bed or not bed.drained()):
                say("a fresh control plane for the next run" + ("" if args.fresh_bed else ": pods were left"))
                bed.stop()
                bed = new_bed()
            spec = RunSpec(
                operator,
                size,
                settle_seconds=args.settle,
                steady_seconds=args.steady,
                step_seconds=args.steps,
                repeat=repeat,
                up_timeout=args.up_timeout,
                profile_idle=args.profile_idle and operator != "kuberay",
                rate=args.rate,
                step_records=args.step_records,
            )
            try:
                runs.append(run(bed, spec, workdir / "operator-logs", kuberay_bin))
            except Exception as e:  # one failed run is recorded; the next one still runs
                say(f"run {spec.label} failed: {type(e).__name__}: {str(e)[:300]}")
                failed.append({"run": spec.label, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            _write(out, args, runs, time.monotonic() - started, source.commit, failed)
    finally:
        bed.stop()
    tables = report.render(runs)
    (out / "tables.md").write_text(tables)
    print(tables)
    if args.plots:
        for path in report.plot(runs, args.plots):
            say(f"wrote {path}")
    say(f"done in {(time.monotonic() - started) / 60:.1f} min; results in {out / 'results.json'}")
    return 0


def schedule(sizes: list[int], operators: list[str], repeats: int) -> list[tuple[int, int, str]]:
    """(size, repeat, operator) in the order they run: per size, the operators in turn, `repeats` times."""
    return [(size, r, op) for size in sizes for r in range(repeats) for op in operators]


def _write(
    out: Path, args: argparse.Namespace, runs: list[dict], elapsed: float, commit: str, failed: list[dict]
) -> None:
    meta = {
        "failed_runs": failed,
        "command": "python -m bench.scale " + " ".join(sys.argv[1:]),
        "nodes": args.nodes,
        "node_lease_seconds": args.node_lease_seconds,
        "repeats": args.repeats,
        "order": "per size: the operators in turn, repeated (interleaved)",
        "loadavg_at_start": LOAD_AT_START,
        "machine": {"cpus": _cpus(), "python": platform.python_version()},
        "elapsed_seconds": elapsed,
        "git": _git_head(),
        "operator_commit": commit or "work tree",
        "operator_tree_clean": _clean(ROOT / "operator"),  # matters only when the work tree is measured
        "operator_source_sha256": _source_digest(ROOT / "operator"),
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))


def _loadavg() -> list[float]:
    import os

    return [round(x, 2) for x in os.getloadavg()]


LOAD_AT_START = _loadavg()  # 1, 5 and 15 min, when the invocation started


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


def _source_digest(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.suffix in (".py", ".yaml"):
            digest.update(path.relative_to(directory).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _clean(directory: Path) -> bool:
    out = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--", str(directory)],
        capture_output=True,
        text=True,
        timeout=10,
    )
    return out.returncode == 0 and not out.stdout.strip()


def _git_head() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


if __name__ == "__main__":
    raise SystemExit(main())
