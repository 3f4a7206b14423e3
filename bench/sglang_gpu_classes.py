"""SGLang's own model classes, without a server: our CUDA IPC writes into their real fused parameters.

For SGLang versions that cannot run whole on the lent H200 (0.5.10: a CUDA 12 kernel built for torch 2.9;
0.5.23: a kernel missing 5 symbols of the device's torch 2.11; ../shared/research/sglang-gpu.md), this builds
the Qwen3 and Qwen3-MoE classes of the SGLang on PYTHONPATH the way its scheduler does, but nothing else of
the server: the process config (0.5.10: `set_global_server_args_for_scheduler`; 0.5.23: `publish` of the
runtime context), torch distributed and model parallel at world 1, DP attention and the MoE config, then
`get_model_loader(LoadConfig(load_format="dummy")).load_model(...)`, all as the version's own ModelRunner /
scheduler calls them. On CUDA the model is built inside torch_memory_saver's `weights` region (preload mode:
the engine process runs with LD_PRELOAD of the hook library, as SGLang's scheduler does), so its parameters
live in memory the saver can release.

Per architecture, in one engine process (SGLang's side) and one trainer process:
1. build the model in the region; record every parameter's address;
2. release (pause) and resume the region: the physical memory goes and comes back at the same addresses;
3. the trainer publishes weights shaped like SGLang's parameters (`new_writer(...).publish`, real CUDA IPC),
   and the engine installs them with `load_colocated_step(model, [])`: the very function SGLang calls as our
   custom weight loader, on this model object (targets: the model's parameters by name);
4. a second instance of the same class, outside the region, is loaded by SGLang's own `model.load_weights`
   of the same weights under checkpoint names (q/k/v_proj, gate/up_proj, experts.E.*);
5. both are compared bitwise, parameter by parameter (FusedMoE's w13/w2 included), and the addresses
   against step 1. Steps 2-5 run twice (two training steps).
No forward pass runs: on the device the kernel package and flashinfer are stubs
(tests/sglang_gpu/classes_stubs/sitecustomize.py says which and why), and building these models calls neither.

    python bench/sglang_gpu_classes.py [--arch qwen3 qwen3_moe] [--device cuda|cpu]

On the H200: `bash bench/colocated_device.sh sglang-classes` (both versions; scripts/sglang-classes-carry.sh
builds what it carries). Here: `PYTHONPATH=$(bash scripts/sglang-env.sh 0.5.23) .venv/bin/python
bench/sglang_gpu_classes.py --device cpu` (the CPU tier's SGLang, shared memory instead of CUDA IPC, no
memory saver). One JSON line per version x arch goes to bench/results/sglang_gpu_classes.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(REPO), str(REPO / "bench")) if p not in sys.path]

import runtime_path  # noqa: E402,F401  (colocate_runtime onto ./runtime when not installed)
import torch  # noqa: E402

RESULTS = REPO / "bench" / "results" / "sglang_gpu_classes.jsonl"
STEPS = 2
# What the stubs stand in for, on the device (tests/sglang_gpu/classes_stubs/sitecustomize.py).
STUBS_FILE = REPO / "tests" / "sglang_gpu" / "classes_stubs" / "sitecustomize.py"


def log(msg: str) -> None:
    print(f"[sglang-classes {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- SGLang's own initialisation, per version -------------------------------------------------------------


def server_args(model_dir: Path, device: str) -> Any:
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path=str(model_dir),
        load_format="dummy",
        device=device,
        tp_size=1,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        attention_backend="triton" if device == "cuda" else "torch_native",
        sampling_backend="pytorch",
        disable_cuda_graph=True,
        mem_fraction_static=0.05 if device == "cuda" else 0.3,
        context_length=1024,
        random_seed=0,
    )


class SGLangModels:
    """One process's SGLang: its config published and torch distributed up at world 1, as its scheduler
    does (0.5.10: scheduler.py init_moe_gemm_config + model_runner.py init_torch_distributed; 0.5.23:
    scheduler.py run_scheduler_process `publish` + `bootstrap.init_parallel_runtime/init_layer_runtime`).
    `build()` is ModelRunner.load_model's model construction (the loader of `--load-format dummy`)."""

    def __init__(self, model_dir: Path, device: str) -> None:
        import sglang
        from sglang.srt.configs.model_config import ModelConfig

        self.version = sglang.__version__
        self.device = device
        self.args = server_args(model_dir, device)
        port = free_port()
        try:
            from sglang.srt import runtime_context as rc  # 0.5.2x: the process-wide runtime context
        except ImportError:
            rc = None
        if rc is not None and hasattr(rc, "publish"):
            from sglang.srt.distributed import bootstrap
            from sglang.srt.layers.moe import initialize_moe_config

            world_rank = rc.spawn_world_rank(self.args, tp_rank=0, pp_rank=0)
            rc.publish(self.args, role="scheduler", ranks=rc.SpawnRanks(world_rank=world_rank, gpu_id=0))
            self.model_config = ModelConfig.from_server_args(self.args)
            bootstrap.init_parallel_runtime(server_args=self.args, device=device, dist_port=port)
            bootstrap.init_layer_runtime(model_config=self.model_config)
            if hasattr(self.model_config.hf_text_config, "num_experts_per_tok"):
                initialize_moe_config()
            self.init = "runtime_context.publish + bootstrap.init_parallel_runtime + initialize_moe_config"
        else:
            from sglang.srt.distributed.parallel_state import (
                get_default_distributed_backend,
                init_distributed_environment,
                initialize_model_parallel,
            )
            from sglang.srt.layers.dp_attention import initialize_dp_attention
            from sglang.srt.layers.moe import initialize_moe_config
            from sglang.srt.server_args import set_global_server_args_for_scheduler

            set_global_server_args_for_scheduler(self.args)
            self.model_config = ModelConfig.from_server_args(self.args)
            if hasattr(self.model_config.hf_config, "num_experts_per_tok"):
                initialize_moe_config(self.args)
            if device == "cuda":
                torch.cuda.set_device(0)
            init_distributed_environment(
                backend=get_default_distributed_backend(device),
                world_size=1,
                rank=0,
                local_rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{port}",
            )
            initialize_model_parallel(tensor_model_parallel_size=1)
            initialize_dp_attention(server_args=self.args, model_config=self.model_config)
            self.init = "set_global_server_args_for_scheduler + init_distributed_environment + initialize_*"

    def build(self) -> torch.nn.Module:
        from sglang.srt.configs.device_config import DeviceConfig
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.distributed.parallel_state import monkey_patch_vllm_parallel_state
        from sglang.srt.model_loader.loader import get_model_loader

        monkey_patch_vllm_parallel_state()
        try:
            loader = get_model_loader(
                load_config=LoadConfig(load_format="dummy"), model_config=self.model_config
            )
            return loader.load_model(
                model_config=self.model_config, device_config=DeviceConfig(self.device, 0)
            )
        finally:
            monkey_patch_vllm_parallel_state(reverse=True)


# --- the engine process (SGLang's side) -------------------------------------------------------------------


def param_table(model: torch.nn.Module) -> dict[str, dict]:
    return {
        n: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch."), "ptr": p.data_ptr()}
        for n, p in model.named_parameters()
    }


def engine(args: argparse.Namespace) -> int:
    """SGLang's side: builds, releases/resumes, installs what the trainer publishes, compares. Writes the
    report to --report (the driver reads it)."""
    from sglang_gpu import TINY, to_checkpoint, trained

    from colocate_runtime.sglang.loader import close_all, load_colocated_step, start_colocated

    work = Path(args.work)
    cuda = args.device == "cuda"
    config = TINY[args.arch]
    model_dir = work / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config, indent=1))
    report: dict[str, Any] = {"arch": args.arch, "steps": []}
    checks: list[dict] = []

    def check(name: str, ok: bool, **detail: Any) -> None:
        checks.append({"check": name, "ok": bool(ok), **detail})
        log(f"{'PASS' if ok else 'FAIL'} {args.arch}: {name} {json.dumps(detail)[:300] if detail else ''}")

    trainer = None
    try:
        t0 = time.perf_counter()
        sg = SGLangModels(model_dir, args.device)
        report.update(sglang_version=sg.version, init=sg.init, init_s=round(time.perf_counter() - t0, 2))
        saver = None
        if cuda:
            from torch_memory_saver import torch_memory_saver as saver

            free0 = torch.cuda.mem_get_info()[0]
            with saver.region(tag="weights"):
                model = sg.build()
            torch.cuda.synchronize()
        else:
            model = sg.build()
        report["class"] = f"{type(model).__module__}.{type(model).__qualname__}"
        params = param_table(model)
        ptrs0 = {n: p["ptr"] for n, p in params.items()}
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        report.update(params=len(params), param_bytes=nbytes, memory_saver=cuda)
        report["fused"] = sorted(
            {n.split(".")[-2] + "." + n.split(".")[-1] for n in params if "layers.0." in n}
        )
        log(f"{args.arch}: {report['class']} built by SGLang {sg.version}: {len(params)} params, {nbytes} B")
        (work / "params.json").write_text(json.dumps(params))
        if cuda:
            report["built_in_region_bytes"] = free0 - torch.cuda.mem_get_info()[0]

        start_colocated(model, [])  # the preflight responder, as ColocatedRollout.start() has SGLang run it
        trainer = subprocess.Popen(
            [sys.executable, __file__, "trainer", "--device", args.device, "--work", str(work)],
            cwd=REPO,
            env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
        )
        reference = sg.build()  # SGLang's own load_weights goes into this one (outside the region)
        for step in range(1, STEPS + 1):
            row: dict[str, Any] = {"step": step}
            if cuda:
                torch.cuda.synchronize()
                before = torch.cuda.mem_get_info()[0]
                saver.pause("weights")
                released = torch.cuda.mem_get_info()[0]
                saver.resume("weights")
                resumed = torch.cuda.mem_get_info()[0]
                row.update(released_bytes=released - before, resumed_bytes=released - resumed)
            load_colocated_step(model, [])  # what SGLang runs for `--custom-weight-loader`, on this model
            if cuda:
                torch.cuda.synchronize()
            weights = trained(params, seed=step, device="cpu")
            ckpt = to_checkpoint(weights, config)
            dev = next(reference.parameters()).device
            reference.load_weights([(n, t.to(dev)) for n, t in ckpt.items()])
            ours = dict(model.named_parameters())
            theirs = dict(reference.named_parameters())
            wrong_published = [n for n, t in weights.items() if not same(ours[n], t)]
            wrong_reference = [n for n in theirs if n not in ours or not same(ours[n], theirs[n])]
            moved = [n for n, p in ours.items() if p.data_ptr() != ptrs0[n]]
            row.update(
                wrong_published=wrong_published[:5], wrong_reference=wrong_reference[:5], moved=moved[:5]
            )
            report["steps"].append(row)
            check(
                f"step {step}: our install bitwise = published",
                not wrong_published,
                wrong=wrong_published[:5],
            )
            check(
                f"step {step}: bitwise = SGLang's own load_weights",
                not wrong_reference,
                wrong=wrong_reference[:5],
            )
            check(f"step {step}: parameter addresses kept", not moved, moved=moved[:5])
            if cuda:
                check(
                    f"step {step}: the release freed the parameters' memory",
                    row["released_bytes"] >= nbytes and row["resumed_bytes"] >= nbytes,
                    released=row["released_bytes"],
                    resumed=row["resumed_bytes"],
                    param_bytes=nbytes,
                )
        rc = trainer.wait(timeout=180)
        check("trainer: every step ACKed (wait_and_free)", rc == 0, rc=rc)
        close_all()
    except Exception as err:
        check(
            "no exception",
            False,
            error=f"{type(err).__name__}: {err}"[:2000],
            trace=traceback.format_exc()[-3000:],
        )
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
    report["checks"] = checks
    report["ok"] = bool(checks) and all(c["ok"] for c in checks)
    Path(args.report).write_text(json.dumps(report))
    return 0 if report["ok"] else 1


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach(), b.detach().to(a.device)
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


# --- the trainer process ----------------------------------------------------------------------------------


def trainer(args: argparse.Namespace) -> int:
    """Publishes step 1..STEPS of weights shaped like SGLang's parameters and waits for each ACK."""
    from sglang_gpu import trained

    from colocate_runtime.colocated.config import ColocateConfig
    from colocate_runtime.colocated.wiring import new_writer

    work = Path(args.work)
    params = json.loads((work / "params.json").read_text())
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    writer = new_writer(ColocateConfig.from_env(os.environ), device=0 if cuda else None)
    try:
        for step in range(1, STEPS + 1):
            weights = {n: t.to(args.device) for n, t in trained(params, seed=step, device="cpu").items()}
            pending = writer.publish(step, weights, weight_version=f"v{step}")
            writer.wait_and_free(pending)
            log(f"trainer: step {step} installed ({len(weights)} tensors)")
    finally:
        writer.close()
    return 0


# --- the driver -------------------------------------------------------------------------------------------


def preload_library() -> str:
    """torch_memory_saver's preload hook (the CUDA major of this torch), as SGLang puts it in LD_PRELOAD."""
    from torch_memory_saver.utils import get_binary_path_from_package

    return str(get_binary_path_from_package("torch_memory_saver_hook_mode_preload"))


def cudart_dirs() -> list[str]:
    """Where torch's own libcudart lies (the preload hook links against it, and loads before torch)."""
    out = []
    for entry in sys.path:
        for lib in Path(entry or ".").glob("nvidia/*/lib/libcudart.so*"):
            out.append(str(lib.parent))
    return sorted(set(out))


def stubs() -> dict[str, str]:
    """The stubs' one-line whys, when the stub package is on this process's path (the device)."""
    mod = sys.modules.get("sitecustomize")
    return dict(getattr(mod, "WHY", {}) or {})


def other_model_modules(arch: str) -> list[str]:
    import importlib.util

    spec = importlib.util.find_spec("sglang")  # not imported: the driver stays light
    models = Path(spec.origin).parent / "srt" / "models"
    return sorted(p.stem for p in models.glob("*.py") if p.stem not in (arch, "__init__"))


def drive(args: argparse.Namespace) -> int:
    from importlib.metadata import version

    from sglang_gpu import commit, device_name

    from colocate_devcluster.localredis import RedisServer

    lines = []
    with tempfile.TemporaryDirectory(prefix="sglang-classes-") as tmp:
        root = Path(tmp)
        redis = RedisServer(root / "redis").start()
        try:
            for arch in args.arch:
                work = root / arch
                (work / "shm").mkdir(parents=True)
                env = {
                    **os.environ,
                    "COLOCATE_JOB_NAME": f"classes-{arch}",
                    "COLOCATE_NAMESPACE": "sglang-classes",
                    **redis.env(),
                    "COLOCATE_TRANSPORT": "CudaIPC" if args.device == "cuda" else "SharedMemory",
                    "COLOCATE_SHM_DIR": str(work / "shm"),
                    "COLOCATE_VERIFY": "SampledChecksum",
                    "COLOCATE_STEP_TIMEOUT_SECONDS": "120",
                    "COLOCATE_HEARTBEAT_TTL_SECONDS": "10",
                    "COLOCATE_IPC_PREFLIGHT": "Wait",
                    "PYTHONUNBUFFERED": "1",
                }
                env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
                # SGLang imports every module of sglang/srt/models for its registry: all but this one skipped.
                env.setdefault("SGLANG_DISABLED_MODEL_ARCHS", ",".join(other_model_modules(arch)))
                if args.device == "cuda":
                    env["LD_PRELOAD"] = ":".join(p for p in (preload_library(), env.get("LD_PRELOAD")) if p)
                    env["LD_LIBRARY_PATH"] = ":".join([*cudart_dirs(), env.get("LD_LIBRARY_PATH", "")]).strip(
                        ":"
                    )
                else:
                    env.update(CUDA_VISIBLE_DEVICES="", SGLANG_USE_CPU_ENGINE="1")
                    env["SGLANG_NCCL_SO_PATH"] = "/nonexistent/cpu-only/libnccl.so.2"
                report_file = work / "report.json"
                cmd = [sys.executable, __file__, "engine", "--arch", arch, "--device", args.device]
                cmd += ["--work", str(work), "--report", str(report_file)]
                t0 = time.perf_counter()
                rc = subprocess.run(cmd, cwd=REPO, env=env, check=False, timeout=args.timeout).returncode
                if report_file.exists():
                    report = json.loads(report_file.read_text())
                else:
                    report = {
                        "arch": arch,
                        "ok": False,
                        "checks": [{"check": "engine wrote a report", "ok": False, "rc": rc}],
                    }
                steps = report.get("steps", [])
                line = {
                    "sglang_version": report.get("sglang_version", version("sglang")),
                    "arch": arch,
                    "class": report.get("class"),
                    "params": report.get("params"),
                    "param_bytes": report.get("param_bytes"),
                    "bitwise": bool(steps)
                    and all(not s["wrong_published"] and not s["wrong_reference"] for s in steps),
                    "addresses_kept": bool(steps) and all(not s["moved"] for s in steps),
                    "memory_saver": report.get("memory_saver", False),
                    "released_bytes": [s.get("released_bytes") for s in steps],
                    "steps": len(steps),
                    "ok": report.get("ok", False),
                    "stubs": stubs(),
                    "init": report.get("init"),
                    "transport": env["COLOCATE_TRANSPORT"],
                    "torch": torch.__version__,
                    "transformers": version("transformers"),
                    "seconds": round(time.perf_counter() - t0, 1),
                    "commit": commit(),
                    "date": time.strftime("%Y-%m-%d"),
                    "device": device_name() if args.device == "cuda" else "cpu",
                }
                failed = [c for c in report.get("checks", []) if not c["ok"]]
                if failed:
                    line["failed"] = failed[:3]
                lines.append(line)
                log(json.dumps(line))
        finally:
            redis.stop()
    if args.record:
        with open(args.results, "a") as f:
            f.writelines(json.dumps(x) + "\n" for x in lines)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(x) + "\n" for x in lines)
    for x in lines:
        print(
            f"{'PASS' if x['ok'] else 'FAIL'}  sglang {x['sglang_version']} {x['arch']:9s} "
            f"bitwise={x['bitwise']} addresses_kept={x['addresses_kept']}"
        )
    return 0 if lines and all(x["ok"] for x in lines) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("role", nargs="?", default="drive", choices=("drive", "engine", "trainer"))
    p.add_argument("--arch", nargs="+", default=["qwen3", "qwen3_moe"], choices=("qwen3", "qwen3_moe"))
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--no-record", dest="record", action="store_false")
    p.add_argument("--out", help="append the lines to this file too (the device's $OUT)")
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--report", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "engine":
        args.arch = args.arch[0]
        return engine(args)
    if args.role == "trainer":
        return trainer(args)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
