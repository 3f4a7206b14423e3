"""The real node's pure parts, without root: its DNS answers, its containerd config, can_run's reasons."""

from __future__ import annotations

import socket
import struct
import tomllib
from pathlib import Path

import pytest

from colocate_devcluster import dns, realnode
from colocate_devcluster.realnode import RealNode, can_run

RECORDS = {"kubernetes.default.svc.cluster.local": "10.96.0.1"}


def _query(name: str, qtype: int = 1) -> bytes:
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split("."))
    return struct.pack("!HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + labels + b"\0" + struct.pack("!HH", qtype, 1)


def test_dns_answers_the_apiserver_name_and_nothing_else() -> None:
    reply = dns.answer(_query("kubernetes.default.svc.cluster.local"), RECORDS)
    ident, flags, _, answers = struct.unpack("!HHHH", reply[:8])
    assert (ident, flags & 0xF, answers) == (0x1234, 0, 1)
    assert socket.inet_ntoa(reply[-4:]) == "10.96.0.1"

    _, flags, _, answers = struct.unpack("!HHHH", dns.answer(_query("kubernetes.default.svc.x"), RECORDS)[:8])
    assert (flags & 0xF, answers) == (3, 0)  # NXDOMAIN: the resolver tries the next search domain

    aaaa = dns.answer(_query("kubernetes.default.svc.cluster.local", qtype=28), RECORDS)
    assert struct.unpack("!HHHH", aaaa[:8])[1] & 0xF == 0 and struct.unpack("!HHHH", aaaa[:8])[3] == 0


def test_containerd_config_is_toml_with_the_cri_settings_the_node_needs(tmp_path: Path) -> None:
    node = RealNode(0, tmp_path, tmp_path, "https://127.0.0.1:6443", tmp_path / "ca.crt", "token")
    node.dir.mkdir()
    config = tomllib.loads(node._containerd_config().read_text())
    cri = config["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["sandbox_image"] == "localhost/pause:colocate"
    assert cri["restrict_oom_score_adj"] is True
    assert cri["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is False
    assert config["grpc"]["address"] == str(node.socket) and len(str(node.socket)) < 108


def test_can_run_says_why_or_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    why = can_run()
    assert why is None or why.startswith("a real node needs")
    monkeypatch.setattr(realnode.os, "geteuid", lambda: 0)
    monkeypatch.setattr(
        realnode.shutil, "which", lambda tool: None if tool == "containerd" else f"/usr/bin/{tool}"
    )
    assert (can_run() or "").startswith("a real node needs containerd")
    monkeypatch.setattr(realnode.os, "geteuid", lambda: 1000)
    assert can_run() == "a real node needs root (containerd, runc, network namespaces, cgroups)"
