"""SGLang adapter over its HTTP API, with memory tags tracked so repeated release/resume calls are safe.

SGLang's `release_memory_occupation` pauses torch_memory_saver regions: pausing a paused region ends the
scheduler (torch_memory_saver calls `exit(1)`), and resuming a region that is not paused raises `KeyError` in
the scheduler, which kills the server too. The client therefore keeps the set of released tags and sends only
the difference; it also tracks whether generation is paused. Every call has a timeout; calls are retried
(bounded, with backoff) only when a retry cannot repeat an effect: idempotent reads always, effectful calls
only when the request never reached the server (connection refused) or the server answered 503.

The engine's version is read from `/server_info` at the first call that depends on it (`detect()`), and its
behaviour comes from one table (versions.py): the weight-update session, plugins, the safe pause mode.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import requests
from urllib3.exceptions import NewConnectionError

from colocate_runtime.sglang.versions import PROBE_PATH, EngineTraits, traits

log = logging.getLogger(__name__)

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
PAUSE_MODES = ("abort", "retract", "in_place")


class SGLangError(RuntimeError):
    """SGLang refused a call or could not be reached within the retry budget (the message says which)."""


@dataclass(frozen=True, slots=True)
class HttpPolicy:
    timeout_s: float = 60.0  # per request; weight updates get `update_timeout_s`
    update_timeout_s: float = 600.0
    retries: int = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 4.0
    # A call that changes the engine's state (pause, release, ...) is retried after a refused connection,
    # since it never reached a server. Where SGLang restarts in place (container restart rules) a retry can
    # reach the NEW engine, which then holds a pause or a release its recovery does not know of (a second
    # release kills SGLang): such trainers set False and recover on the error instead.
    retry_unsent_effectful: bool = True


class SGLangClient:
    def __init__(
        self,
        base_url: str,
        policy: HttpPolicy | None = None,
        session: requests.Session | None = None,
        *,
        api_key: str | None = None,
        allow_untested: bool = False,
    ) -> None:
        """`api_key`: SGLang's `--api-key`, or its `--admin-api-key` where one is set (the weight-update
        endpoints then take only that one); sent as a bearer token, never logged."""
        self.base_url = base_url.rstrip("/")
        self.policy = policy or HttpPolicy()
        self.session = session or requests.Session()
        self._api_key = api_key
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        self.allow_untested = allow_untested
        self.released: set[str] = set()
        self.paused = False
        self.server_info: dict[str, Any] = {}
        self._engine: EngineTraits | None = None

    # --- the engine ---------------------------------------------------------------------------------------

    def detect(self) -> EngineTraits:
        """Read the engine's version and arguments (`/server_info`); UnsupportedEngine outside the range."""
        if self._engine is None:
            info = self._call("GET", "/server_info", None, effectful=False)
            version = info.get("version")
            if not version:
                raise SGLangError(f"{self.base_url}/server_info names no SGLang version: is this SGLang?")
            self._engine = traits(str(version), allow_untested=self.allow_untested)
            # SGLang 0.5.10 echoes its API keys here (in more than one field): keep none of them.
            self.server_info = _redacted(info, self._api_key)
            log.info("SGLang %s at %s: %s", version, self.base_url, self._engine)
        return self._engine

    @property
    def engine(self) -> EngineTraits:
        return self.detect()

    # --- transport ----------------------------------------------------------------------------------------

    def _call(
        self,
        method: str,
        path: str,
        payload: dict[str, Any] | None = None,
        *,
        effectful: bool,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        timeout = self.policy.timeout_s if timeout_s is None else timeout_s
        url = f"{self.base_url}{path}"
        delay = self.policy.backoff_s
        for attempt in range(self.policy.retries + 1):
            last = attempt == self.policy.retries
            try:
                resp = self.session.request(method, url, json=payload, timeout=(min(5.0, timeout), timeout))
            except requests.RequestException as err:
                if last or (effectful and not (self.policy.retry_unsent_effectful and _never_sent(err))):
                    raise SGLangError(f"{method} {path}: {type(err).__name__}: {err}") from None
                log.info(
                    "%s %s failed (%s); retry %d in %.1fs",
                    method,
                    path,
                    type(err).__name__,
                    attempt + 1,
                    delay,
                )
            else:
                if resp.status_code == 503 and not last:
                    log.info("%s %s: 503; retry %d in %.1fs", method, path, attempt + 1, delay)
                elif resp.status_code >= 500 and not effectful and not last:
                    log.info(
                        "%s %s: %d; retry %d in %.1fs", method, path, resp.status_code, attempt + 1, delay
                    )
                else:
                    return _body(method, path, resp)
            time.sleep(delay)
            delay = min(delay * 2, self.policy.max_backoff_s)
        raise AssertionError("unreachable")

    # --- generation ---------------------------------------------------------------------------------------

    def health(self) -> bool:
        """SGLang's `/health`: runs a one-token generation, so it fails (after 20 s) while paused."""
        return self._ok("/health")

    def ready(self) -> bool:
        """The server answers: `/model_info`, which runs no generation and answers while paused."""
        return self._ok(PROBE_PATH)

    def _ok(self, path: str) -> bool:
        try:
            return self.session.get(f"{self.base_url}{path}", timeout=self.policy.timeout_s).ok
        except requests.RequestException:
            return False

    def wait_ready(self, timeout_s: float) -> None:
        """Until the engine serves generations (its `/health`), then detect its version."""
        deadline = time.monotonic() + timeout_s
        while not self.health():
            if time.monotonic() > deadline:
                raise SGLangError(f"SGLang at {self.base_url} not healthy within {timeout_s}s")
            time.sleep(0.2)
        self.detect()

    def pause_generation(self, mode: str | None = None) -> None:
        """Pause with `mode`, by default the mode this version survives a release with (versions.py)."""
        mode = self.engine.pause_mode if mode is None else mode
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {PAUSE_MODES}")
        if not self.paused:
            self._call("POST", "/pause_generation", {"mode": mode}, effectful=True)
            self.paused = True

    def continue_generation(self) -> None:
        if self.paused:
            self._call("POST", "/continue_generation", {}, effectful=True)
            self.paused = False

    def flush_cache(self) -> None:
        self._call("POST", "/flush_cache", None, effectful=False)

    # --- memory -------------------------------------------------------------------------------------------

    def release_memory_occupation(self, tags: Iterable[str] | None = None) -> list[str]:
        """Release the given tags (all by default) that are not released yet; returns those released now."""
        todo = [t for t in _tags(tags) if t not in self.released]
        if todo:
            self._call("POST", "/release_memory_occupation", {"tags": todo}, effectful=True)
            self.released.update(todo)
        return todo

    def resume_memory_occupation(self, tags: Iterable[str] | None = None) -> list[str]:
        """Resume the given tags (all by default) that are released; returns those resumed now."""
        todo = [t for t in _tags(tags) if t in self.released]
        if todo:
            self._call("POST", "/resume_memory_occupation", {"tags": todo}, effectful=True)
            self.released.difference_update(todo)
        return todo

    def assume_released(self, tags: Iterable[str]) -> None:
        """After an adapter restart: tell the client what the engine already has released."""
        self.released.update(_tags(tags))

    # --- weights ------------------------------------------------------------------------------------------

    def update_weights_from_tensor(
        self,
        serialized_per_rank: Sequence[str],
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> str:
        """One payload per TP rank (rank r reads entry r); returns SGLang's message. On versions that need
        it, the update runs inside a weight-update session (begin ... end, also when the update fails)."""
        if "weights" in self.released:
            raise SGLangError("weights memory is released: resume the 'weights' tag before updating weights")
        with self.weight_update_session():
            body = self._call(
                "POST",
                "/update_weights_from_tensor",
                {
                    "serialized_named_tensors": list(serialized_per_rank),
                    "load_format": load_format,
                    "weight_version": weight_version,
                    "flush_cache": flush_cache,
                    "abort_all_requests": abort_all_requests,
                },
                effectful=True,
                timeout_s=self.policy.update_timeout_s,
            )
        return str(body.get("message", ""))

    @contextlib.contextmanager
    def weight_update_session(self) -> Iterator[None]:
        """`/begin_weight_update` ... `/end_weight_update` where the engine needs them; else nothing."""
        if not self.engine.session:
            yield
            return
        self._call("POST", "/begin_weight_update", {}, effectful=True)
        try:
            yield
        finally:
            self._call("POST", "/end_weight_update", {}, effectful=True)

    def get_weight_version(self) -> str | None:
        body = self._call("GET", "/model_info", None, effectful=False)
        version = body.get("weight_version")
        return None if version is None else str(version)

    def update_weight_version(self, version: str, *, abort_all_requests: bool = False) -> None:
        self._call(
            "POST",
            "/update_weight_version",
            {"new_version": version, "abort_all_requests": abort_all_requests},
            effectful=True,
        )

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        """The first `truncate_size` values of a parameter (SGLang answers a bare, nested list). Only some of
        SGLang's models implement it (Llama and Qwen2 do, Qwen3 does not: HTTP 400)."""
        body = self._call(
            "POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size}, effectful=False
        )
        return list(body.get("value") or [])


def _redacted(value: Any, secret: str | None) -> Any:
    """`value` without `*api_key*` fields and with `secret` cut out of every string, however deep."""
    if isinstance(value, dict):
        return {k: _redacted(v, secret) for k, v in value.items() if "api_key" not in str(k)}
    if isinstance(value, list | tuple):
        return [_redacted(v, secret) for v in value]
    if isinstance(value, str) and secret and secret in value:
        return value.replace(secret, "<redacted>")
    return value


def _tags(tags: Iterable[str] | None) -> list[str]:
    out = list(MEMORY_TAGS if tags is None else tags)
    unknown = [t for t in out if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; SGLang knows {MEMORY_TAGS}")
    return out


def _never_sent(err: requests.RequestException) -> bool:
    """The request cannot have reached the server: connecting failed."""
    if isinstance(err, requests.ConnectTimeout):
        return True
    reason = getattr(err.args[0], "reason", None) if err.args else None
    return isinstance(reason, NewConnectionError)


def _body(method: str, path: str, resp: requests.Response) -> dict[str, Any]:
    try:
        body = resp.json() if resp.content else {}
    except ValueError:
        body = {"message": resp.text[:500]}
    if not isinstance(body, dict):
        body = {"value": body}
    if resp.status_code >= 400 or body.get("success") is False:
        error = body.get("error")
        message = (
            body.get("message")
            or (error.get("message") if isinstance(error, dict) else error)
            or body.get("detail")
            or resp.reason
        )
        raise SGLangError(f"{method} {path}: HTTP {resp.status_code}: {message}")
    return body
