"""STAND-IN for an SGLang server: speaks the subset of SGLang's HTTP API the adapter uses, over a real (tiny)
torch language model, in one process. Used by the demo and fast tests only; never in production. The
conformance tier (tests/sglang_real/) runs SGLang's own code instead; this stand-in follows the same
per-version table (versions.py) and fails where SGLang fails:

- a custom loader that raises kills the server (SGLang's scheduler sends SIGQUIT to its parent);
- from 0.5.21 on, `/update_weights_from_tensor` outside `/begin_weight_update` ... `/end_weight_update` is
  refused with SGLang's message (HTTP 400);
- payloads are SGLang's (base64 of a pickle; anything but an empty named-tensor list kills the server, as
  SGLang's restricted unpickler does), weights hold garbage after a release and resume (torch_memory_saver
  without a CPU backup), releasing a released tag or resuming one that is not released kills the server;
- releasing memory while a generation runs kills the server (SGLang asserts that it is idle);
- `/get_weight_version` answers 404 (use `/model_info`), `/get_weights_by_name` a bare list, `/server_info`
  the version and arguments, `/health` runs a generation and so fails while paused, `/model_info` does not.

What it lacks: SGLang's processes (one scheduler per TP rank), its scheduler, memory saver, CUDA graphs.
Fault injection: `faults` answers 503 to the first N calls of a path (the adapter's retries); `hangs` holds
every call of a path that long before answering (a hung engine: the adapter's timeouts); `crash_at` kills
the server at the Nth call of a path, before it is handled (SGLang dying in the middle of a weight update).

Run: `python -m colocate_runtime.sglang.standin --port 30000 --custom-weight-loader PATH --sglang-version V`.
"""

from __future__ import annotations

import argparse
import base64
import importlib
import json
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from torch import nn

from colocate_runtime.sglang import versions
from colocate_runtime.sglang.versions import NEWEST, EngineTraits, traits

log = logging.getLogger(__name__)
TAGS = ("kv_cache", "weights", "cuda_graph")
DEFAULT_VERSION = ".".join(map(str, NEWEST))


class Crashed(Exception):
    """The stand-in died the way SGLang would: later requests find no server."""


class TinyLM(nn.Module):
    """A real, tiny causal LM: embedding, one gated MLP block, RMS norm, LM head (bf16 and an fp32 norm)."""

    def __init__(self, vocab: int = 64, dim: int = 32, hidden: int = 48, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def param(*shape: int, dtype: torch.dtype = torch.bfloat16) -> nn.Parameter:
            return nn.Parameter((torch.randn(*shape, generator=g) * 0.2).to(dtype))

        self.embed_tokens = param(vocab, dim)
        self.up_proj = param(hidden, dim)
        self.down_proj = param(dim, hidden)
        self.norm = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.lm_head = param(vocab, dim)

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens[ids].float()
        h = h + torch.nn.functional.silu(h @ self.up_proj.float().t()) @ self.down_proj.float().t()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        return h @ self.lm_head.float().t()

    @torch.no_grad()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """Log-probs of the next token at each position (the engine's own, as SGLang's return_logprob)."""
        return torch.log_softmax(self.logits(torch.tensor(ids)), dim=-1)

    @torch.no_grad()
    def greedy(self, ids: list[int], max_new_tokens: int) -> list[int]:
        seq = list(ids)
        for _ in range(max_new_tokens):
            seq.append(int(self.logits(torch.tensor(seq))[-1].argmax()))
        return seq[len(ids) :]


class StandinState:
    def __init__(
        self,
        model: nn.Module,
        loaders: dict[str, Callable[[nn.Module, Any], None]],
        faults: dict[str, int] | None = None,
        *,
        version: str = DEFAULT_VERSION,
        on_crash: Callable[[str], None] | None = None,
        api_key: str | None = None,
        crash_at: dict[str, int] | None = None,
    ) -> None:
        self.model = model
        self.crash_at = dict(crash_at or {})
        self.loaders = loaders
        self.faults = dict(faults or {})
        self.hangs: dict[str, float] = {}
        self.engine: EngineTraits = traits(version)
        self.on_crash = on_crash
        self.api_key = api_key
        self.released: set[str] = set()
        self.paused = False
        self.session = False
        self.generating = 0
        self.crashed: str | None = None
        self.weight_version = "initial"
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def handle(
        self, method: str, path: str, body: dict[str, Any], authorization: str | None = None
    ) -> tuple[int, Any]:
        # As SGLang's --api-key: a bearer token on every path but the probes' (/health*, /ready*, /metrics).
        if self.api_key and authorization != f"Bearer {self.api_key}" and not _unauthenticated(path):
            return 401, {"error": "Unauthorized"}
        if path in self.hangs:
            with self.lock:
                self.calls.append(path)
            time.sleep(self.hangs[path])
            return 503, {"success": False, "message": "stand-in: hung"}
        if path == "/generate":  # outside the lock: a release while it runs is what SGLang asserts against
            return self.generate(body)
        with self.lock:
            if self.crashed is not None:
                raise Crashed(self.crashed)
            self.calls.append(path)
            if self.crash_at.get(path) == self.calls.count(path):
                self.crash(f"{path}: injected crash at call {self.crash_at[path]}")
                raise Crashed("injected crash")
            if self.faults.get(path, 0) > 0:
                self.faults[path] -= 1
                return 503, {"success": False, "message": "stand-in: injected 503"}
            route = _ROUTES.get(path)
            if route is None:
                return 404, {"detail": "Not Found"}
            try:
                return getattr(self, route)(body)
            except Exception as err:  # an exception in SGLang's scheduler ends the server
                self.crash(f"{path}: {type(err).__name__}: {err}")
                raise Crashed(str(err)) from err

    def crash(self, why: str) -> None:
        log.error("stand-in: scheduler hit an exception, the server dies (as SGLang's does): %s", why)
        self.crashed = why
        if self.on_crash is not None:
            self.on_crash(why)

    # --- routes -------------------------------------------------------------------------------------------

    def health(self, body: dict) -> tuple[int, dict]:
        if self.paused:  # SGLang's /health generates one token: held while paused, 503 after its timeout
            return 503, {}
        return 200, {}

    def server_info(self, body: dict) -> tuple[int, dict]:
        return 200, {
            "version": self.engine.version,
            "tp_size": 1,
            "dp_size": 1,
            "custom_weight_loader": sorted(self.loaders),
            "enable_memory_saver": True,
        }

    def model_info(self, body: dict) -> tuple[int, dict]:
        return 200, {"model_path": "stand-in", "weight_version": self.weight_version}

    def ready(self, body: dict) -> tuple[int, dict]:
        if versions.parse(self.engine.version) < (0, 5, 20):
            return 404, {"detail": "Not Found"}
        return (503 if self.paused else 200), {}  # SGLang: not ready while paused

    def generate(self, body: dict) -> tuple[int, dict]:
        with self.lock:
            if self.crashed is not None:
                raise Crashed(self.crashed)
            if self.paused:  # SGLang holds the request until continue; the stand-in refuses it instead
                return 503, {"success": False, "message": "generation is paused"}
            if "weights" in self.released:
                return 400, {"success": False, "message": "weights memory is released"}
            self.generating += 1
        try:
            ids = [int(x) for x in body["input_ids"]]
            n = int(body.get("sampling_params", {}).get("max_new_tokens", 8))
            out = self.model.greedy(ids, n)
            meta: dict[str, Any] = {"weight_version": self.weight_version}
            if body.get("return_logprob"):  # SGLang's shape: [logprob, token id, text] per output token
                logprobs = self.model.logprobs(ids + out)[len(ids) - 1 : -1]
                meta["output_token_logprobs"] = [
                    [float(lp[t]), t, None] for lp, t in zip(logprobs, out, strict=True)
                ]
            return 200, {"output_ids": out, "meta_info": meta}
        finally:
            with self.lock:
                self.generating -= 1

    def pause_generation(self, body: dict) -> tuple[int, dict]:
        self.paused = True
        return 200, {"success": True, "message": "paused"}

    def continue_generation(self, body: dict) -> tuple[int, dict]:
        self.paused = False
        return 200, {"success": True, "message": "continued"}

    def release_memory_occupation(self, body: dict) -> tuple[int, Any]:
        tags = body.get("tags") or list(TAGS)
        if self.generating:
            raise AssertionError("release_memory_occupation should be called only when server is idle.")
        again = sorted(set(tags) & self.released)
        if again:  # torch_memory_saver: "Cannot pause allocation that is not active", exit(1)
            raise RuntimeError(f"tags {again} already released")
        if "weights" in tags:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.fill_(float("nan"))  # the content of released pages is undefined
        self.released.update(tags)
        return 200, None

    def resume_memory_occupation(self, body: dict) -> tuple[int, Any]:
        tags = body.get("tags") or list(TAGS)
        missing = sorted(set(tags) - self.released)
        if missing:  # SGLang: `offload_tags.remove(tag)` raises KeyError in the scheduler
            raise KeyError(f"tags {missing} are not released")
        self.released.difference_update(tags)
        return 200, None

    def begin_weight_update(self, body: dict) -> tuple[int, dict]:
        if not self.engine.session:
            return 404, {"detail": "Not Found"}
        if self.session:
            return 400, {"success": False, "message": "a weight-update session is already open"}
        self.session = True
        return 200, {"success": True, "message": "Success"}

    def end_weight_update(self, body: dict) -> tuple[int, dict]:
        if not self.engine.session:
            return 404, {"detail": "Not Found"}
        if not self.session:
            return 400, {"success": False, "message": "no weight-update session is open"}
        self.session = False
        return 200, {"success": True, "message": "Success"}

    def update_weights_from_tensor(self, body: dict) -> tuple[int, dict]:
        if self.engine.session and not self.session:
            return 400, {
                "success": False,
                "message": "update_weights_from_tensor must run between begin_weight_update() and "
                "end_weight_update()",
            }
        fmt = body.get("load_format")
        loader = self.loaders.get(fmt or "")
        if loader is None:
            raise NotImplementedError(f"Unknown load_format={fmt}")
        payloads = body.get("serialized_named_tensors") or []
        named = _unpickle_empty(payloads[0])  # rank 0's entry, as SGLang's TP rank 0 reads it
        loader(self.model, named)  # raises: the server dies, as SGLang's does
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return 200, {"success": True, "message": "Success"}

    def flush_cache(self, body: dict) -> tuple[int, Any]:
        if not self.paused and "kv_cache" not in self.released:
            return 400, {"message": "Cache not flushed. Please check the server is idle."}
        return 200, "Cache flushed."

    def get_weight_version(self, body: dict) -> tuple[int, dict]:
        return 404, {
            "detail": "Endpoint '/get_weight_version' is deprecated. Please use '/model_info' instead."
        }

    def update_weight_version(self, body: dict) -> tuple[int, dict]:
        self.weight_version = str(body["new_version"])
        return 200, {"success": True, "message": "updated", "new_version": self.weight_version}

    def get_weights_by_name(self, body: dict) -> tuple[int, Any]:
        p = dict(self.model.named_parameters())[body["name"]]
        flat = p.detach().float().reshape(-1)[: int(body.get("truncate_size", 100))]
        return 200, flat.tolist()


def _unauthenticated(path: str) -> bool:
    return path.startswith(("/health", "/ready", "/metrics"))


def _unpickle_empty(payload: str) -> list:
    """SGLang unpickles payloads with an allow-list; the stand-in accepts only an empty list."""
    named = pickle.loads(base64.b64decode(payload)) if payload else None
    if named != []:
        raise pickle.UnpicklingError(f"stand-in accepts only an empty named-tensor list, got {type(named)}")
    return named


_ROUTES: dict[str, str] = {
    f"/{name}": name
    for name in (
        "health",
        "server_info",
        "model_info",
        "ready",
        "begin_weight_update",
        "end_weight_update",
        "generate",
        "pause_generation",
        "continue_generation",
        "release_memory_occupation",
        "resume_memory_occupation",
        "update_weights_from_tensor",
        "flush_cache",
        "get_weight_version",
        "update_weight_version",
        "get_weights_by_name",
    )
}


def _handler(state: StandinState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else {}
            except ValueError:
                body = None
            if not isinstance(body, dict):
                code, reply = 400, {"success": False, "message": "body is not a JSON object"}
            else:
                try:
                    path = self.path.split("?", 1)[0]
                    code, reply = state.handle(method, path, body, self.headers.get("Authorization"))
                except Crashed:
                    self.close_connection = True  # no answer: the server is gone
                    return
            data = (reply if isinstance(reply, str) else json.dumps(reply)).encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain" if isinstance(reply, str) else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("stand-in %s", fmt % args)

    return Handler


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:  # a caller gave up (its timeout)
        log.debug("stand-in: connection from %s ended early", client_address, exc_info=True)


def serve(state: StandinState, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """Start serving on a daemon thread; `server.server_address` has the port, `server.shutdown()` stops."""
    server = _Server((host, port), _handler(state))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="sglang-standin", daemon=True).start()
    return server


def import_loader(path: str) -> Callable[[nn.Module, Any], None]:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    # As in SGLang: one flag takes every name (nargs="*"); a repeated flag keeps only its last occurrence.
    p.add_argument("--custom-weight-loader", nargs="*", default=[])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sglang-version", default=DEFAULT_VERSION, help="the SGLang release to behave like")
    p.add_argument("--api-key", default=None, help="require this bearer token, as SGLang's --api-key does")
    p.add_argument("--faults", default="{}", help='JSON {"/path": n}: answer 503 to the first n calls')
    p.add_argument("--crash-at", default="{}", help='JSON {"/path": n}: die at the n-th call of the path')
    p.add_argument(
        "--run-plugins",
        action="store_true",
        help="run our sglang.srt.plugins hook at start, as SGLang >= 0.5.11 does in each worker",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s standin %(message)s")
    torch.set_num_threads(1)
    state = StandinState(
        TinyLM(seed=args.seed),
        {path: import_loader(path) for path in args.custom_weight_loader},
        json.loads(args.faults),
        version=args.sglang_version,
        on_crash=lambda why: os._exit(1),
        api_key=args.api_key,
        crash_at=json.loads(args.crash_at),
    )
    if args.run_plugins and state.engine.plugins:
        from colocate_runtime.sglang.plugin import after_model_runner_init

        after_model_runner_init(None)  # starts the colocated side and registers this engine instance
    server = serve(state, args.host, args.port)
    log.info("SGLang stand-in on %s:%d", *server.server_address[:2])
    threading.Event().wait()


if __name__ == "__main__":
    main()
