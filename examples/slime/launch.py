"""The trainer container's command of a slime ColocateJob (README.md beside this file): Ray across the job's
pods, slime on pod 0 with each pod's SGLang as an external engine.

    python examples/slime/launch.py [--dry-run] -- python /opt/slime/train.py SLIME_ARGS...

Every pod runs it. Pod 0 (`COLOCATE_REPLICA_INDEX=0`) starts the Ray head on its rendezvous port (the host
and port of `COLOCATE_RENDEZVOUS_ADDR`, which the operator points at pod 0 through the job's headless
Service), waits until every pod's Ray node joined, and runs the given slime command with
`--rollout-external-engine-addrs` added: each pod's SGLang at `POD_IP:COLOCATE_ROLLOUT_PORT`, in slime's
order of trainer ranks (its placement group sorts GPUs by node IP, then GPU id), so engine i is the one on
the GPUs of trainer ranks [i * gpusPerNode, (i + 1) * gpusPerNode). The other pods join the head and wait;
each leaves when the head is gone (training over) with slime's exit status, which pod 0 records in Ray's
key-value store (`colocate/slime-exit`; a head gone without one: exit 1).

`--dry-run` prints the commands instead of running them (tests/slime_real/test_manifest.py).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

EXIT_KEY = "colocate/slime-exit"


def head_address(environ: Mapping[str, str]) -> tuple[str, int]:
    host, _, port = environ["COLOCATE_RENDEZVOUS_ADDR"].rpartition(":")
    return host, int(port)


def pod_ip() -> str:
    return os.environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())


def engine_addrs(node_ips: Sequence[str], port: int) -> list[str]:
    """Each pod's SGLang, ordered as slime orders trainer ranks (node IP as numbers)."""

    def key(ip: str) -> tuple:
        try:
            return (0, int(ipaddress.ip_address(ip)))
        except ValueError:
            return (1, ip)

    return [f"{ip}:{port}" for ip in sorted(node_ips, key=key)]


def slime_command(given: Sequence[str], addrs: Sequence[str]) -> list[str]:
    if "--rollout-external-engine-addrs" in given:
        raise SystemExit("launch.py: --rollout-external-engine-addrs is set from the job's pods; drop it")
    return [*given, "--rollout-external-engine-addrs", *addrs]


def ray_start(environ: Mapping[str, str], head: bool) -> list[str]:
    host, port = head_address(environ)
    gpus = environ.get("COLOCATE_GPUS_PER_NODE", "0")
    common = [f"--num-gpus={gpus}", f"--node-ip-address={pod_ip()}", "--disable-usage-stats"]
    if head:
        return ["ray", "start", "--head", f"--port={port}", "--include-dashboard=false", *common]
    return ["ray", "start", f"--address={socket.gethostbyname(host)}:{port}", *common]


def wait_for_nodes(count: int, timeout_s: float = 900.0) -> list[str]:
    import ray

    ray.init(address="auto")
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")]
        if len(alive) >= count:
            ray.shutdown()
            return alive
        if time.monotonic() > deadline:
            raise SystemExit(f"launch.py: {len(alive)} of {count} Ray nodes joined in {timeout_s:.0f} s")
        time.sleep(2)


def wait_for_head_exit() -> int:
    """On pods > 0: block until the head is gone; slime's exit status as pod 0 recorded it."""
    import ray
    from ray.experimental.internal_kv import _internal_kv_get

    ray.init(address="auto")
    status: bytes | None = None
    while True:
        try:
            status = _internal_kv_get(EXIT_KEY) or status
            time.sleep(5)
        except Exception:
            break
    return int(status) if status is not None else 1


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    environ = os.environ
    first = int(environ.get("COLOCATE_REPLICA_INDEX", "0")) == 0
    nodes = int(environ.get("COLOCATE_NUM_NODES", "1"))
    port = int(environ.get("COLOCATE_ROLLOUT_PORT", "30000"))
    start = ray_start(environ, head=first)
    if args.dry_run:
        print(shlex.join(start))
        if first:
            example = [f"10.0.0.{i + 1}" for i in range(nodes)]
            print(shlex.join(slime_command(command, engine_addrs(example, port))))
        return 0
    subprocess.run(start, check=True)
    if not first:
        return wait_for_head_exit()
    slime = slime_command(command, engine_addrs(wait_for_nodes(nodes), port))
    print("launch.py:", shlex.join(slime), flush=True)
    code = subprocess.run(slime).returncode
    import ray
    from ray.experimental.internal_kv import _internal_kv_put

    ray.init(address="auto")
    _internal_kv_put(EXIT_KEY, str(code).encode(), overwrite=True)
    time.sleep(10)  # the other pods read it before the head goes
    ray.shutdown()
    subprocess.run(["ray", "stop"], check=False)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
