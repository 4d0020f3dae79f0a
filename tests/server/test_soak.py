"""benchmarks/soak.py against the test server: 200 requests with random sampling parameters, 30% of clients
walking away mid-answer, 64 at a time. No failures other than the walk-aways, no leaked page, nothing stuck,
RSS within 100 MB of after the warm-up, /health p99 under 100 ms."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import API_KEY, ROOT

pytestmark = pytest.mark.slow  # 200 requests against a live server (~3 min)


def test_soak_200_requests(server, tmp_path):
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--base-url", server.url,
                          "--api-key", API_KEY, "--requests", "200", "--concurrency", "64", "--seed", "1",
                          "--json", str(out)], capture_output=True, text=True, timeout=900)
    result = json.loads(Path(out).read_text())
    print("\n" + json.dumps({k: v for k, v in result.items() if k != "failures"}))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert result["problems"] == []
    assert result["failed"] == 0 and result["leaked_pages"] == 0 and result["stuck_requests"] == 0
    assert 30 <= result["disconnected"] <= 90 and result["ok"] + result["disconnected"] == 200
    assert result["rss_growth_mb"] <= 100 and result["health_p99_ms"] < 100
