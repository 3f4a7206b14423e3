"""`colocate_runtime.sglang.serve` starts REAL SGLang with the key from SGLANG_API_KEY: SGLang refuses calls
without it, our client gets in with it, and the key is on no process's command line and in no log line.

The same CPU launch as the conformance tier (server.py), TP 1, no loaders: only the key's path is tested.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import requests

from colocate_devcluster.processes import free_port
from colocate_runtime.sglang import serve
from colocate_runtime.sglang.client import HttpPolicy, SGLangClient
from tests.sglang_real import server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
VERSION = "0.5.23"  # the launcher is version-independent (`--api-key` exists in every supported release)
KEY = f"key-{secrets.token_hex(16)}"


def test_a_key_in_the_environment_and_on_the_command_line_is_refused() -> None:
    env = {serve.API_KEY_ENV: KEY}
    assert serve.with_api_key(["--port", "1"], env) == ["--port", "1", "--api-key", KEY]
    assert serve.with_api_key(["--port", "1"], {}) == ["--port", "1"]
    for argv in (["--api-key", "x"], ["--api-key=x"]):
        with pytest.raises(serve.KeyOnCommandLine) as refused:
            serve.with_api_key(argv, env)
        assert KEY not in str(refused.value)


def _tree(proc: subprocess.Popen) -> list[psutil.Process]:
    root = psutil.Process(proc.pid)
    return [root, *root.children(recursive=True)]


@pytest.fixture(scope="module")
def sglang(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen, int, Path]]:
    work = tmp_path_factory.mktemp("serve")
    port = free_port()
    cmd = server.command(server.write_tiny_model(work / "model"), port, 1, loaders=())
    assert cmd[1:3] == ["-m", "tests.sglang_real.cpu_launch"]
    cmd[1:3] = ["-m", "colocate_runtime.sglang.serve"]  # instead of `python -m sglang.launch_server`
    env = server.environment(1, {**os.environ, "PYTHONPATH": server.pythonpath(VERSION)})
    env[serve.API_KEY_ENV] = KEY
    log = work / "sglang.log"
    proc = server.launch(cmd, env, log)
    try:
        yield proc, port, log
    finally:
        server.stop(proc)


def test_sglang_requires_the_key_and_our_client_sends_it(sglang) -> None:
    _, port, _ = sglang
    url = f"http://127.0.0.1:{port}"
    assert requests.get(f"{url}/model_info", timeout=30).status_code == 401
    wrong = {"Authorization": "Bearer not-the-key"}
    assert requests.get(f"{url}/model_info", headers=wrong, timeout=30).status_code == 401
    client = SGLangClient(url, HttpPolicy(timeout_s=60), api_key=KEY)
    client.wait_ready(60)
    assert client.server_info.get("version") == VERSION


def test_the_key_is_on_no_command_line_and_in_no_log_line(sglang) -> None:
    proc, _, log = sglang
    processes = _tree(proc)
    assert len(processes) >= 2, "SGLang's scheduler and detokenizer run as child processes"
    for p in processes:
        cmdline = Path(f"/proc/{p.pid}/cmdline").read_bytes().decode(errors="replace")
        assert KEY not in cmdline, f"pid {p.pid}: {cmdline!r}"
    text = log.read_text(errors="replace")
    assert "api_key" in text and serve.REDACTED in text, "SGLang logs its arguments: the test looks at them"
    assert KEY not in text
