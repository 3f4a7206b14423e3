"""STAND-IN for an SGLang server (SGLang cannot be installed here): speaks the subset of SGLang's HTTP API the
adapter uses, over a real (tiny) torch language model. Used by tests and demos only; never in production.

Endpoints as SGLang names them: `/health`, `/generate` (greedy), `/pause_generation`, `/continue_generation`,
`/release_memory_occupation`, `/resume_memory_occupation`, `/update_weights_from_tensor`, `/flush_cache`,
`/get_weight_version`, `/update_weight_version`, `/get_weights_by_name`. Where SGLang misbehaves, the stand-in
fails loudly instead: releasing a tag twice answers 500 (SGLang can hang there), resuming a tag that is not
released answers 500, and resumed weights hold garbage (as torch_memory_saver pages without a CPU backup do)
until they are updated. Differences from SGLang: a payload of `/update_weights_from_tensor` is base64 JSON (a
list of named tensors, empty for the colocated loader) rather than SGLang's serializer output, and only custom
loaders (`--custom-weight-loader`) are supported. Fault injection (`faults`) answers 503 to the first N calls
of a path, to exercise the adapter's retries.

Run: `python -m colocate_runtime.sglang.standin --port 30000 --custom-weight-loader PATH`.
"""

from __future__ import annotations

import argparse
import base64
import importlib
import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)
TAGS = ("kv_cache", "weights", "cuda_graph")


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
    ) -> None:
        self.model = model
        self.loaders = loaders
        self.faults = dict(faults or {})
        self.released: set[str] = set()
        self.paused = False
        self.weight_version = "initial"
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def handle(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self.lock:
            self.calls.append(path)
            if self.faults.get(path, 0) > 0:
                self.faults[path] -= 1
                return 503, {"success": False, "message": "stand-in: injected 503"}
            route = _ROUTES.get(path)
            if route is None:
                return 404, {"success": False, "message": f"no route {path}"}
            try:
                return route(self, body)
            except Exception as err:  # a loader failure is a success=false answer, as in SGLang
                log.exception("stand-in %s failed", path)
                return 400, {"success": False, "message": f"{type(err).__name__}: {err}"}

    # --- routes -------------------------------------------------------------------------------------------

    def health(self, body: dict) -> tuple[int, dict]:
        return 200, {}

    def generate(self, body: dict) -> tuple[int, dict]:
        if self.paused:
            return 503, {"success": False, "message": "generation is paused"}
        if "weights" in self.released:
            return 400, {"success": False, "message": "weights memory is released"}
        ids = [int(x) for x in body["input_ids"]]
        n = int(body.get("sampling_params", {}).get("max_new_tokens", 8))
        return 200, {
            "output_ids": self.model.greedy(ids, n),
            "meta_info": {"weight_version": self.weight_version},
        }

    def pause_generation(self, body: dict) -> tuple[int, dict]:
        self.paused = True
        return 200, {"success": True, "message": "paused"}

    def continue_generation(self, body: dict) -> tuple[int, dict]:
        self.paused = False
        return 200, {"success": True, "message": "continued"}

    def release_memory_occupation(self, body: dict) -> tuple[int, dict]:
        tags = body.get("tags") or list(TAGS)
        again = sorted(set(tags) & self.released)
        if again:
            return 500, {"success": False, "message": f"tags {again} already released (SGLang can hang here)"}
        if "weights" in tags:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.fill_(float("nan"))  # the content of released pages is undefined
        self.released.update(tags)
        return 200, {"success": True, "message": f"released {tags}"}

    def resume_memory_occupation(self, body: dict) -> tuple[int, dict]:
        tags = body.get("tags") or list(TAGS)
        missing = sorted(set(tags) - self.released)
        if missing:
            return 500, {"success": False, "message": f"tags {missing} are not released"}
        self.released.difference_update(tags)
        return 200, {"success": True, "message": f"resumed {tags}"}

    def update_weights_from_tensor(self, body: dict) -> tuple[int, dict]:
        if "weights" in self.released:
            return 400, {"success": False, "message": "weights memory is released"}
        fmt = body.get("load_format")
        loader = self.loaders.get(fmt or "")
        if loader is None:
            return 400, {"success": False, "message": f"stand-in supports custom loaders only, not {fmt!r}"}
        payloads = body.get("serialized_named_tensors") or []
        named = json.loads(base64.b64decode(payloads[0])) if payloads else []
        loader(self.model, named)
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return 200, {"success": True, "message": "Succeeded to update model weights."}

    def flush_cache(self, body: dict) -> tuple[int, dict]:
        if not self.paused and "kv_cache" not in self.released:
            return 400, {"success": False, "message": "cannot flush while requests may be running"}
        return 200, {"success": True, "message": "Cache flushed."}

    def get_weight_version(self, body: dict) -> tuple[int, dict]:
        return 200, {"weight_version": self.weight_version}

    def update_weight_version(self, body: dict) -> tuple[int, dict]:
        self.weight_version = str(body["new_version"])
        return 200, {"success": True, "message": "updated"}

    def get_weights_by_name(self, body: dict) -> tuple[int, dict]:
        p = dict(self.model.named_parameters())[body["name"]]
        flat = p.detach().float().reshape(-1)[: int(body.get("truncate_size", 100))]
        return 200, {"parameter": flat.tolist()}


_ROUTES: dict[str, Callable[[StandinState, dict], tuple[int, dict]]] = {
    f"/{name}": getattr(StandinState, name)
    for name in (
        "health",
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
                code, reply = state.handle(method, self.path.split("?", 1)[0], body)
            data = json.dumps(reply).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
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


def serve(state: StandinState, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """Start serving on a daemon thread; `server.server_address` has the port, `server.shutdown()` stops."""
    server = ThreadingHTTPServer((host, port), _handler(state))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="sglang-standin", daemon=True).start()
    return server


def import_loader(path: str) -> Callable[[nn.Module, Any], None]:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def start_loader_preflight(path: str) -> None:
    """What a real deployment's worker module does at worker start: the loader module's IPC preflight
    responder (colocated/preflight.py), when it has one."""
    start = getattr(importlib.import_module(path.rpartition(".")[0]), "start_preflight", None)
    if start is not None:
        start()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--custom-weight-loader", action="append", default=[])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--faults", default="{}", help='JSON {"/path": n}: answer 503 to the first n calls')
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s standin %(message)s")
    torch.set_num_threads(1)
    state = StandinState(
        TinyLM(seed=args.seed),
        {path: import_loader(path) for path in args.custom_weight_loader},
        json.loads(args.faults),
    )
    for path in args.custom_weight_loader:
        start_loader_preflight(path)
    server = serve(state, args.host, args.port)
    log.info("SGLang stand-in on %s:%d", *server.server_address[:2])
    threading.Event().wait()


if __name__ == "__main__":
    main()
