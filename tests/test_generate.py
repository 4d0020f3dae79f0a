"""`python -m jaxllm.generate` end to end on the embedded model."""

import re
import subprocess
import sys

import pytest


def run(*args, stdin=None, cache=None):
    return subprocess.run([sys.executable, "-m", "jaxllm.generate", *args,
                           "--compilation-cache-dir", str(cache or "")],
                          input=stdin, capture_output=True, text=True, timeout=600)


def test_help_documents_every_sampling_option():
    out = subprocess.run([sys.executable, "-m", "jaxllm.generate", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for flag in ("--temperature", "--top-p", "--top-k", "--min-p", "--presence-penalty", "--frequency-penalty",
                 "--repetition-penalty", "--seed", "--stop", "--stop-token-ids", "--min-tokens", "--ignore-eos",
                 "--logprobs", "--max-tokens", "--model", "--preset", "--raw", "--system"):
        assert flag in out, flag


def test_streams_an_answer_and_reports_counts(tmp_path):
    r = run("What is the capital of France?", "--max-tokens", "12", "--max-num-seqs", "2",
            "--max-num-batched-tokens", "64", "--num-pages", "64", "--max-model-len", "256", cache=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "generated tokens:" in r.stderr and "tok/s" in r.stderr
    report = re.search(r"load ([\d.]+) s \(KV cache ([\d.]+) s\), compile ([\d.]+) s \((\d+) buckets\), time to first "
                       r"token ([\d.]+) s, decode ([\d.]+) tok/s", r.stderr)
    assert report, r.stderr
    assert float(report[3]) > 0 and report[4] == "2"  # a fresh cache: the prompt's and the decode step's shapes


@pytest.mark.slow
def test_second_run_loads_its_steps_from_the_executable_cache(tmp_path):
    args = ("What is the capital of France?", "--max-tokens", "8", "--max-num-seqs", "2", "--max-num-batched-tokens",
            "64", "--max-model-len", "256")
    first, second = run(*args, cache=tmp_path), run(*args, cache=tmp_path)
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert first.stdout == second.stdout and "Paris" in second.stdout
    assert len(list((tmp_path / "executables").iterdir())) == 2
    compile_s = [float(re.search(r"compile ([\d.]+) s", r.stderr)[1]) for r in (first, second)]
    assert compile_s[1] < compile_s[0] / 2, compile_s  # loaded, not traced and compiled


def test_prompts_from_stdin_and_bad_options(tmp_path):
    r = run("--raw", "--max-tokens", "3", "--ignore-eos", "--max-num-seqs", "2", "--max-num-batched-tokens", "64",
            "--num-pages", "64", "--max-model-len", "256", stdin="One, two,\nRed, green,\n", cache=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("[") >= 2 and "generated tokens: 6" in r.stderr
    bad = run("hi", "--temperature", "-1")
    assert bad.returncode == 2 and "temperature" in bad.stderr


@pytest.mark.slow
def test_structured_output_options(tmp_path):
    sizes = ("--max-num-seqs", "2", "--max-num-batched-tokens", "64", "--num-pages", "64", "--max-model-len", "256",
             "--max-tokens", "64")
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, '
                      '"required": ["city"], "additionalProperties": false}')
    r = run("Where is the Eiffel tower?", "--json-schema", f"@{schema}", "--temperature", "1", "--seed", "3",
            *sizes, cache=tmp_path)
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(r'\{"city": "[^"]{0,12}"\}\n*', r.stdout), r.stdout
    r = run("Is Paris in France?", "--choice", "yes", "--choice", "no", *sizes, cache=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() in ("yes", "no"), r.stdout + r.stderr
    bad = run("hi", "--regex", "((", *sizes, cache=tmp_path)
    assert bad.returncode == 2 and "unclosed group" in bad.stderr
    bad = run("hi", "--json-schema", "{not json")
    assert bad.returncode == 2 and "--json-schema is not JSON" in bad.stderr
