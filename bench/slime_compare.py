"""slime's own colocated weight update against ours, on one GPU with real SGLang, same preset, bitwise.

One SGLang server (TP 1, the `bench/sglang_gpu.py` launch: SGLang 0.5.17 on the H200, our loader flags, decode
CUDA graphs, `--load-format dummy`) and this process as the trainer, holding the preset's weights in one
contiguous bf16 buffer (Megatron-core DDP's `param_data`), in SGLang's parameter layout. Per sync, both
paths pay the same engine calls slime's `UpdateWeightFromTensor.update_weights` makes around the weights
(624b824: pause generation, flush the cache, ..., continue generation); SGLang's weights stay resident
(slime's rollout manager onloads them before `update_weights`) and nothing is released. The middle:

  slime   slime's own code (third_party/slime at 624b824, imported): parameters grouped into buckets of
          `--update-weight-buffer-size` bytes (slime's `pack_param_info_buckets`, default 512 MiB); per
          bucket the Hugging Face tensors are made (`to_checkpoint`: qkv and gate/up split, experts
          unstacked, copies, standing in for slime's TP gather + `convert_to_hf`, which at TP 1 is that same
          split), then slime's `_send_to_colocated_engine` (SGLang's `FlattenedTensorBucket`,
          `MultiprocessingSerializer` over CUDA IPC, the gather to the engine's rank,
          `update_weights_from_tensor(load_format="flattened_bucket", weight_version=...)`), `ray.get`, then
          slime's `ipc_collect` + `empty_cache`; SGLang rebuilds the tensors and runs the model's own
          `load_weights`.
  ours    `publish_in_place` of the buffer (keep_mapped), `update_weights_from_tensor` with our loader (it
          gathers straight into SGLang's fused parameters), the writer's confirmation, and the version call
          (what `colocate_runtime.integrations.slime` does on the engine's first rank).

After each path's last sync, SGLang's parameters are digested inside its scheduler (tests/sglang_gpu/probe.py)
and compared with the trainer's buffer: bitwise or the line says which differ. Medians of the timed syncs
(after warm-up); one JSON line per preset and path to bench/results/slime_compare.jsonl.

On the H200 (no network; see the report of issue 33 for the exact device command):
    bash scripts/sglang-gpu-carry.sh; python bench/slime_compare.py prepare      # here, once
    device: carry [".device/sglang-gpu", ".device/slime"], command: DEVICE_COMMAND below, per preset

Here, a smoke run of the plumbing (our path bitwise and versioned; slime's path fails by design on CPU:
SGLang's patched tensor reductions, which slime's serialization uses, assume CUDA tensors):
    M=$(bash scripts/megatron-env.sh 0.16.1); G=$(bash scripts/sglang-env.sh 0.5.10)
    PYTHONPATH=$M:$G CUDA_VISIBLE_DEVICES= python bench/slime_compare.py bench --device cpu \
        --preset tiny-qwen3 --steps 2 --no-record

Ray cannot be carried (80 MB wheel): bench/slime_stubs/ray stands in for the names slime's module imports
(`ray.get` of the bench's finished results). megatron-core (slime's module imports `megatron.core.mpu`) is
carried as its wheel. Everything else slime's function runs is slime's and SGLang's own.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CARRY = REPO / ".device" / "slime"
SLIME = REPO / "third_party" / "slime"
STUBS = REPO / "bench" / "slime_stubs"
RESULTS = REPO / "bench" / "results" / "slime_compare.jsonl"
MEGATRON = "0.16.1"
DEVICE_COMMAND = (
    'bash -c \'set -e; eval "$(sed -n "/^setup_device()/,/^}/p;/^setup_sglang_gpu()/,/^}/p" '
    'bench/colocated_device.sh)"; REPO=$PWD; CARRY=$REPO/.device/colocated; setup_sglang_gpu; '
    "python3 bench/slime_compare.py bench --preset @PRESET@ --steps @STEPS@ --keep-dir $OUT'"
)  # one preset per device command (10 min each): qwen3-8b with --steps 3, qwen3-30b-a3b with --steps 2


def prepare() -> int:
    """Here: the megatron-core wheel for the device's CPython 3.12 into .device/slime (carried)."""
    CARRY.mkdir(parents=True, exist_ok=True)
    exclude = REPO / ".git" / "info" / "exclude"
    if "/.device/" not in exclude.read_text().splitlines():
        with open(exclude, "a") as f:
            f.write("/.device/\n")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", "3.12", "-d", str(CARRY), f"megatron-core=={MEGATRON}"]
    subprocess.run(cmd, check=True)
    print(f"{CARRY}: {sorted(p.name for p in CARRY.iterdir())}")
    return 0


def slime_path() -> None:
    """slime's source, the ray stand-in and megatron-core (installed from the carried wheel) importable."""
    import importlib.util

    site = Path(tempfile.gettempdir()) / "slime-site"
    have = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core")
    if not have and not (site / "megatron" / "core").is_dir():
        wheels = sorted(CARRY.glob("megatron_core-*.whl"))
        if not wheels:
            raise SystemExit(f"no megatron-core wheel in {CARRY}: run `bench/slime_compare.py prepare`")
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site)]
        subprocess.run([*pip, str(wheels[-1])], check=True)
    for p in (str(SLIME), str(STUBS), str(site)):
        if p not in sys.path:
            sys.path.append(p)


# --- the run ---------------------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[slime-compare {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class EngineHandle:
    """A stand-in for slime's Ray handle of `SGLangEngine`: `.update_weights_from_tensor.remote(**kw)` posts
    what `SGLangEngine.update_weights_from_tensor` posts (624b824, sglang_engine.py) and returns the answer,
    finished, for `ray.get`."""

    def __init__(self, client: Any) -> None:
        self.client = client

    @property
    def update_weights_from_tensor(self) -> Any:
        def remote(serialized_named_tensors, load_format=None, flush_cache=False, weight_version=None):
            payload = {
                "serialized_named_tensors": serialized_named_tensors,
                "load_format": load_format,
                "flush_cache": flush_cache,
            }
            if weight_version is not None:
                payload["weight_version"] = weight_version
            r = self.client.session.post(
                f"{self.client.base_url}/update_weights_from_tensor", json=payload, timeout=600
            )
            r.raise_for_status()
            return r.json()

        return type("Remote", (), {"remote": staticmethod(remote)})


def buckets(names: list[str], views: dict, limit: int) -> list[list[str]]:
    """slime's `pack_param_info_buckets`: in order, a new bucket when the next tensor would pass the limit."""
    out: list[list[str]] = [[]]
    size = 0
    for n in names:
        nbytes = views[n].numel() * views[n].element_size()
        if size + nbytes > limit and out[-1]:
            out.append([])
            size = 0
        out[-1].append(n)
        size += nbytes
    return out


def bench_preset(args: argparse.Namespace, preset: str, redis: Any, root: Path) -> list[dict]:
    import torch
    import torch.distributed as dist
    from sglang_gpu import (
        PRESETS,
        TINY,
        Engine,
        Piece,
        commit,
        copy_floor_ms,
        device_name,
        sync,
        to_checkpoint,
        trainer_buffer,
    )

    from colocate_runtime.colocated.wiring import new_writer
    from colocate_runtime.sglang.loader import INIT_LOADER_PATH, LOADER_PATH
    from colocate_runtime.sglang.rollout import EMPTY_PAYLOAD, ColocatedRollout
    from tests.sglang_gpu.probe import digest

    slime_path()
    import ray  # the stand-in (bench/slime_stubs) on the device; slime-env's real Ray here
    from slime.backends.megatron_utils.sglang import monkey_patch_torch_reductions
    from slime.backends.megatron_utils.update_weight.update_weight_from_tensor import (
        _send_to_colocated_engine,
    )

    if not dist.is_initialized():  # slime gathers each engine's payloads over a gloo group: here one rank
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(minutes=10))
    group = dist.new_group([0], backend="gloo")
    monkey_patch_torch_reductions()  # what slime's HF weight iterator does before sending

    presets = {**PRESETS, **{f"tiny-{arch}": (cfg, 0.05) for arch, cfg in TINY.items()}}
    config, mem = presets[preset]
    t0 = time.perf_counter()
    engine = Engine(args, root / f"slime-{preset}", redis, config, mem=mem, verify="None")
    client = engine.client
    log(f"{preset}: SGLang {client.engine.version} up in {time.perf_counter() - t0:.1f} s")
    lines: list[dict] = []
    try:
        ColocatedRollout(client).start()  # each worker answers the writer's IPC preflight
        params = engine.probe("meta")["params"]
        names = sorted(params)
        dev = "cuda" if args.device == "cuda" else "cpu"
        buf, views = trainer_buffer(params, dev)
        nbytes = buf.numel() * buf.element_size()
        floor = copy_floor_ms(buf)
        writer = new_writer(engine.cfg(), device=0 if dev == "cuda" else None)
        layout = writer.in_place_layout([Piece(n, t) for n, t in views.items()])
        handle = EngineHandle(client)
        limit = args.bucket_mb * 1024**2
        groups = buckets(names, views, limit)
        log(f"{preset}: {len(params)} parameters, {nbytes / 1e9:.2f} GB, {len(groups)} slime buckets")
        version = 0
        try:
            for path in args.paths:
                try:
                    rows = []
                    for _ in range(args.warmup + args.steps):
                        version += 1
                        views[names[0]].add_(1)  # "training": each sync's weights differ from the last
                        sync()
                        phases: dict[str, float] = {}
                        mark = time.perf_counter()

                        def lap(name: str, phases=phases) -> None:
                            nonlocal mark
                            now = time.perf_counter()
                            phases[name] = phases.get(name, 0.0) + (now - mark) * 1e3
                            mark = now

                        client.pause_generation()
                        client.flush_cache()
                        lap("pause_flush")
                        if path == "ours":
                            pending = writer.publish_in_place(
                                version, layout, weight_version=str(version), keep_mapped=True
                            )
                            lap("publish")
                            client.update_weights_from_tensor(
                                [EMPTY_PAYLOAD],
                                load_format=LOADER_PATH,
                                weight_version=None,
                                flush_cache=False,
                            )
                            lap("update_call")
                            writer.wait_and_free(pending)
                            lap("confirm")
                            client.update_weights_from_tensor(
                                [EMPTY_PAYLOAD],
                                load_format=INIT_LOADER_PATH,
                                weight_version=str(version),
                                flush_cache=False,
                            )
                            lap("version")
                        else:
                            for bucket in groups:
                                hf = list(to_checkpoint({n: views[n] for n in bucket}, config).items())
                                sync()
                                lap("convert")
                                refs, long_lived = _send_to_colocated_engine(
                                    hf,
                                    ipc_engine=handle,
                                    ipc_gather_src=0,
                                    ipc_gather_group=group,
                                    weight_version=version,
                                )
                                ray.get(refs)
                                del refs, long_lived, hf
                                if dev == "cuda":
                                    torch.cuda.ipc_collect()
                                    torch.cuda.empty_cache()
                                lap("send_and_load")
                        client.continue_generation()
                        lap("continue")
                        rows.append(phases)
                        log(f"{preset} {path} sync {version}: {sum(phases.values()):.1f} ms {_round(phases)}")
                    ours = {n: digest(t) for n, t in views.items()}
                    if dev == "cuda":
                        torch.cuda.empty_cache()
                    theirs = engine.probe("digests")
                    wrong = [n for n in ours if theirs.get(n) != ours[n]]
                    version_now = client.get_weight_version()
                    timed = rows[args.warmup :]
                    keys = sorted({k for r in timed for k in r})
                    line = {
                        "preset": preset,
                        "path": path,
                        "sglang_version": client.engine.version,
                        "slime_commit": "624b824a898ab0ec1fcb4d373004c7f3852bf515",
                        "total_ms": round(statistics.median(sum(r.values()) for r in timed), 3),
                        "phases_ms": {
                            k: round(statistics.median(r.get(k, 0.0) for r in timed), 3) for k in keys
                        },
                        "totals_ms": [round(sum(r.values()), 3) for r in timed],
                        "floor_ms": round(floor, 3),
                        "bytes": nbytes,
                        "params": len(params),
                        "slime_buckets": len(groups) if path == "slime" else None,
                        "bucket_mb": args.bucket_mb,
                        "bitwise": not wrong,
                        "weight_version": version_now,
                        "weight_version_ok": version_now == str(version),
                        "steps": len(timed),
                        "device": device_name(),
                        "commit": commit(),
                        "date": time.strftime("%Y-%m-%d"),
                    }
                    if wrong:
                        line["wrong"] = wrong[:5]
                    log(json.dumps(line))
                    lines.append(line)
                except Exception as err:  # the other path's line stays
                    trace = traceback.format_exc()[-3000:]
                    log(f"{preset} {path}: FAILED {type(err).__name__}: {err}\n{trace}")
        finally:
            writer.close()
            if dev == "cuda":
                torch.cuda.ipc_collect()
        return lines
    finally:
        engine.stop()
        if args.keep_dir and engine.log.exists():
            Path(args.keep_dir).mkdir(parents=True, exist_ok=True)
            (Path(args.keep_dir) / f"slime-{preset}.log").write_bytes(engine.log.read_bytes()[-4_000_000:])


def _round(phases: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 2) for k, v in phases.items()}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: argparse.Namespace) -> int:
    sys.path[:0] = [p for p in (str(REPO), str(REPO / "bench")) if p not in sys.path]
    import runtime_path  # noqa: F401  (colocate_runtime onto ./runtime when not installed)

    from colocate_devcluster.localredis import RedisServer

    if len(args.preset) > 1:  # one process per preset (a stopped SGLang's IPC mappings pin the last one's)
        status = 0
        for preset in args.preset:
            cmd = [sys.executable, __file__, "bench", "--preset", preset, "--paths", *args.paths]
            cmd += ["--warmup", str(args.warmup), "--steps", str(args.steps)]
            cmd += ["--bucket-mb", str(args.bucket_mb), "--device", args.device]
            cmd += ["--keep-dir", args.keep_dir] if args.keep_dir else []
            cmd += [] if args.record else ["--no-record"]
            status |= subprocess.run(cmd, check=False).returncode
        return status
    lines: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="slime-compare-") as tmp:
        root = Path(tmp)
        redis = RedisServer(root / "redis").start()
        try:
            for preset in args.preset:
                try:
                    lines += bench_preset(args, preset, redis, root)
                except Exception as err:
                    log(f"{preset}: FAILED {type(err).__name__}: {err}\n{traceback.format_exc()[-4000:]}")
        finally:
            redis.stop()
    if args.record and lines:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        with open(RESULTS, "a") as f:
            f.writelines(json.dumps(x) + "\n" for x in lines)
    if args.keep_dir and lines:
        with open(Path(args.keep_dir) / "slime_compare.jsonl", "a") as f:
            f.writelines(json.dumps(x) + "\n" for x in lines)
    print("\n=== one sync, engine calls included (median ms) ===")
    for x in lines:
        print(
            f"{x['preset']:15s} {x['path']:6s} {x['total_ms']:10.1f} floor {x['floor_ms']:7.1f} "
            f"bitwise {x['bitwise']!s:5s} version {x['weight_version_ok']!s:5s} {x['phases_ms']}"
        )
    ok = len(lines) == len(args.preset) * len(args.paths)
    return 0 if ok and all(x["bitwise"] and x["weight_version_ok"] for x in lines) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare", help="here: the megatron-core wheel into .device/slime")
    b = sub.add_parser("bench")
    b.add_argument("--preset", nargs="+", default=["qwen3-8b"], help="qwen3-8b, qwen3-30b-a3b, tiny-qwen3")
    b.add_argument("--paths", nargs="+", choices=("ours", "slime"), default=["ours", "slime"])
    b.add_argument("--warmup", type=int, default=1)
    b.add_argument("--steps", type=int, default=3)
    b.add_argument("--bucket-mb", type=int, default=512, help="slime's --update-weight-buffer-size, MiB")
    b.add_argument("--keep-dir", default=None, help="logs and JSON lines also here (the device's $OUT)")
    b.add_argument("--no-record", dest="record", action="store_false")
    b.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cpu: a smoke run against the CPU SGLang tier (PYTHONPATH from scripts/sglang-env.sh), shared "
        "memory in place of CUDA IPC; slime's CUDA-IPC serialization is not expected to work there",
    )
    args = parser.parse_args(argv)
    return prepare() if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    sys.exit(main())
