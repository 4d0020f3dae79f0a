"""/openapi.json is generated from the pydantic models, and the live server keeps to it: schemathesis sends
generated requests (valid and invalid, a fixed seed, loopback only) and checks every response against it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from server.openapi import openapi_document
from server.protocol import ChatCompletionRequest
from tests.server.conftest import API_KEY


def test_document_is_generated_from_the_request_models(tiny_server):
    doc = requests.get(tiny_server.url + "/openapi.json", verify=tiny_server.verify, timeout=10).json()
    assert doc == json.loads(json.dumps(openapi_document()))
    schema = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert schema["properties"].keys() == ChatCompletionRequest.model_json_schema()["properties"].keys()
    assert schema["properties"]["top_logprobs"]["anyOf"][0]["maximum"] == 20
    ref = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert ref == {"$ref": "#/components/schemas/ChatCompletionRequest"}


@pytest.mark.slow
def test_schemathesis_finds_no_server_error_and_no_undocumented_response(tiny_server, tmp_path):
    har = tmp_path / "run.har"
    report = tmp_path / "run.json"
    cmd = [str(Path(sys.executable).parent / "schemathesis"), "run", tiny_server.url + "/openapi.json",
           "-H", f"Authorization: Bearer {API_KEY}", "--tls-verify", tiny_server.verify,
           "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,"
           "response_schema_conformance,response_headers_conformance",
           "--max-examples", "40", "--seed", "20261123", "--workers", "1", "--request-timeout", "30",
           "--generation-database", "none", "--no-color",
           "--report", "json,har", "--report-json-path", str(report), "--report-har-path", str(har)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    summary = json.loads(report.read_text())
    statuses = [e["response"]["status"] for e in json.loads(har.read_text())["log"]["entries"]]
    print(f"\nschemathesis: {len(statuses)} requests, {summary['test_cases']['generated']} test cases, statuses "
          f"{ {s: statuses.count(s) for s in sorted(set(statuses))} }")
    assert run.returncode == 0, run.stdout[-5000:]
    assert len(statuses) >= 500
    assert all(0 < s < 500 for s in statuses)  # no 5xx, and no request left without an answer (status 0)
    assert summary["test_cases"]["with_failures"] == 0 and summary["test_cases"]["errored"] == 0
    assert requests.get(tiny_server.url + "/health", verify=tiny_server.verify, timeout=5).status_code == 200
