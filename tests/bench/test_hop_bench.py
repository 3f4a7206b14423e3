"""The meta-store hop benchmark (bench/hop_bench.py) runs the protocol's real calls between two processes on a
real redis-server and writes one row per idle gap, every hop timed (figures are not asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import hop_bench

pytestmark = pytest.mark.timeout(120)


def test_every_hop_of_every_gap_is_timed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hops.json"
    assert hop_bench.main(["--steps", "15", "--gaps-ms", "0", "2", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["gap_ms"] for r in results] == [0.0, 2.0]
    for row in results:
        hops = {k: v for k, v in row.items() if k != "gap_ms"}
        assert set(hops) == {"publish", "wake", "fetch", "ack", "held", "chain"}
        assert all(0 < h["p50"] <= h["p90"] for h in hops.values())
        assert hops["chain"]["p50"] >= hops["fetch"]["p50"]  # the chain contains the reader's fetch
    assert "| idle gap ms |" in capsys.readouterr().out


def test_too_few_steps_is_refused_clearly() -> None:
    with pytest.raises(SystemExit):
        hop_bench.main(["--steps", "5"])
