"""The bounded load test (benchmarks/server_load.py), briefly: the real `vllm-moa serve` with the
shipped demo models under one client of every kind (MoA drafting chains and trees, raw verify
calls, /v1/generate whole and streamed, clients that hang up mid-stream or mid-request, abandoned
sessions, health probes) for ~10 s, with limits that make it refuse. No 5xx but 503 refusals, no
transport error the client did not cause, every completed greedy output equal to plain greedy
decoding, and, once the idle TTL has freed the abandoned sessions, nothing leaked (the leak check
fills exactly the server's session count and token budget)."""

import importlib

import pytest

from vllm_moa.shipped import SHIPPED

pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
pytestmark = [pytest.mark.skipif(not (SHIPPED / "target" / "model.safetensors").is_file(),
                                 reason="this checkout ships no demo models"),
              pytest.mark.timeout(900)]



def _load_script():
    return importlib.import_module("benchmarks.server_load")  # the repository root is on pytest's pythonpath


def test_server_under_bounded_load_answers_exactly_and_leaks_nothing(tmp_path):
    server_load = _load_script()
    out = tmp_path / "server_load.json"
    # main() raises LoadTestFailed (with the first failure) after writing its results if any check fails
    result = server_load.main(["--duration", "10", "--clients", str(len(server_load.KINDS)), "--prompts", "4",
                               "--session-ttl", "3", "--no-progress", "--out", str(out)])
    assert result["passed"] and not result["failures"]
    summary = result["summary"]
    assert summary["server_errors_5xx_other_than_503"] == 0
    assert not [code for code in summary["status_counts"] if code.startswith("5") and code != "503"]
    assert summary["transport_errors_not_deliberate"] == {}
    # every client kind completed at least one generation, and every one checked was exact
    assert all(summary["completed_exact_by_kind"][kind] >= 1 for kind in server_load.KINDS), summary
    assert not any("mismatch" in outcomes for outcomes in summary["outcomes_by_kind"].values())
    assert summary["status_counts"].get("200", 0) > 50
    assert summary["latency_ms_2xx"]["verify"]["n"] > 0 and summary["latency_ms_2xx"]["health"]["n"] > 0
    assert result["leak_check"]["ok"] and result["leak_check"]["refused_when_full"] == [503, 503]
    assert result["rss_mb"]["samples"] and result["server_exit_code"] == 0
    assert out.is_file() and out.with_suffix(".png").stat().st_size > 0
