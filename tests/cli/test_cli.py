"""The ``jaxllm`` command's parsing: vLLM's flags onto the server's settings (a flag wins over its variable, the
command line over --config), argparse's errors with the closest flag, and one line with exit status 2 for a bad
value or an unreachable model, before anything starts."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxllm.cli import build_parser
from jaxllm.cli.serve import FLAGS, apply_config_file, environment
from server.settings import ServerSettings

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_flags_map_onto_the_settings_they_name():
    args = parse("org/model", "--tensor-parallel-size", "2", "-dp", "1", "--max-model-len", "4096", "--dtype",
                 "bfloat16", "--no-enable-prefix-caching", "--kv-cache-dtype", "float8_e4m3fn", "--api-key", "k",
                 "--limit-mm-per-prompt", '{"image": 2}', "--allowed-origins", '["https://a.example", "https://b"]',
                 "--gpu-memory-utilization", "0.8", "--max-num-seqs", "32", "--seed", "7", "--block-size", "32",
                 "--port", "9000", "--served-model-name", "m", "--revision", "v1", "--uvicorn-log-level", "debug",
                 "--enable-expert-parallel")
    args.model = args.model_tag
    env, address = environment(args, {"JAXLLM_MAX_NUM_SEQS": "8", "JAXLLM_BIND": "127.0.0.1:8000"})
    assert address is None
    assert env["JAXLLM_BIND"] == "127.0.0.1:9000"  # the host from the variable, the port from the flag
    s = ServerSettings.from_env(env)
    e = s.engine
    assert (e.model, e.revision, e.served_model_name, e.tensor_parallel_size, e.max_model_len, e.dtype) == (
        "org/model", "v1", "m", 2, 4096, "bfloat16")
    assert (e.enable_prefix_caching, e.kv_cache_dtype, e.limit_mm_per_prompt, e.kv_memory_fraction) == (
        False, "float8_e4m3fn", 2, 0.8)
    assert (e.max_num_seqs, e.seed, e.page_size) == (32, 7, 32)  # the flag won over JAXLLM_MAX_NUM_SEQS=8
    assert e.enable_expert_parallel and env["JAXLLM_ENABLE_EXPERT_PARALLEL"] == "true"
    assert s.api_key == "k" and s.allowed_origins == ("https://a.example", "https://b")
    assert env["JAXLLM_LOG_LEVEL"] == "debug" and env["JAXLLM_DATA_PARALLEL_SIZE"] == "1"


def test_a_variable_stays_when_its_flag_is_not_given():
    env, _ = environment(parse(), {"JAXLLM_MAX_NUM_SEQS": "8", "JAXLLM_API_KEY": "from-env"})
    assert env["JAXLLM_MAX_NUM_SEQS"] == "8" and env["JAXLLM_API_KEY"] == "from-env"
    assert all(f.env not in env for f in FLAGS if f.env and f.env not in ("JAXLLM_MAX_NUM_SEQS", "JAXLLM_API_KEY"))


def test_serve_modes_and_an_inline_chat_template():
    env, address = environment(parse("--headless", "--data-parallel-address", "10.0.0.5",
                                     "--data-parallel-rpc-port", "6000", "--chat-template", "{{ messages }}"), {})
    assert address == "tcp://10.0.0.5:6000"
    assert Path(env["JAXLLM_CHAT_TEMPLATE"]).read_text() == "{{ messages }}"
    env, _ = environment(parse("--api-server-count", "3", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                               "10.0.0.1", "--master-port", "7000"), {})
    assert (env["JAXLLM_API_SERVERS"], env["JAXLLM_NUM_HOSTS"], env["JAXLLM_HOST_RANK"]) == ("3", "2", "1")
    assert env["JAXLLM_COORDINATOR_ADDRESS"] == "10.0.0.1:7000"


def test_a_config_file_gives_what_the_command_line_does_not(tmp_path):
    (tmp_path / "c.yaml").write_text("max-model-len: 2048\nmax_num_seqs: 16\nenable-prefix-caching: false\n"
                                     "allowed-origins: [\"https://x\"]\n")
    args = parse("--config", str(tmp_path / "c.yaml"), "--max-num-seqs", "4")
    apply_config_file(args)
    env, _ = environment(args, {})
    assert (env["JAXLLM_MAX_MODEL_LEN"], env["JAXLLM_MAX_NUM_SEQS"]) == ("2048", "4")
    assert env["JAXLLM_ENABLE_PREFIX_CACHING"] == "false" and env["JAXLLM_ALLOWED_ORIGINS"] == "https://x"
    (tmp_path / "bad.yaml").write_text("max-modl-len: 2048\n")
    with pytest.raises(ValueError, match="unknown key 'max-modl-len' \\(did you mean max-model-len\\?\\)"):
        apply_config_file(parse("--config", str(tmp_path / "bad.yaml")))


def jaxllm(*argv: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("JAXLLM_", "HF_"))}
    environ.update(env)
    return subprocess.run([sys.executable, "-m", "jaxllm", *argv], cwd=ROOT, env=environ, capture_output=True,
                          text=True, timeout=120)


def test_errors_are_one_line_and_exit_status_2(tmp_path):
    run = jaxllm("serve", "--tensor-paralel-size", "2")
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1] == (
        "jaxllm serve: error: unrecognized arguments: --tensor-paralel-size (did you mean --tensor-parallel-size?)")
    run = jaxllm("serve", "--kv-cache-dtype", "int3")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == [
        "jaxllm serve: error: engine config: kv_cache_dtype must be auto or one of float32, bfloat16, float16, "
        "float8_e4m3fn, float8_e5m2"]
    run = jaxllm("serve", str(tmp_path / "nowhere"))
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        f"jaxllm serve: error: {tmp_path / 'nowhere'}: no such file or folder (nor a Hugging Face hub id such as "
        "org/name or org/name:Q4_K_M)"]
    run = jaxllm("serve", "acme/model", HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path))
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1] == (
        "jaxllm serve: error: acme/model: not in the local Hugging Face cache, and the hub cannot be reached "
        "(offline: HF_HUB_OFFLINE is set, or no connection)")
    run = jaxllm("serve", "--headless")
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1] == (
        "jaxllm serve: error: set JAXLLM_ENGINE_SECRET: the engine cores and the API servers share it")


def test_help_is_grouped_as_vllms_and_other_subcommands_are_reachable():
    run = jaxllm("serve", "--help")
    assert run.returncode == 0
    for title in ("model: what to load", "engine: KV cache and scheduling", "parallelism", "serve modes",
                  "frontend: the HTTP server"):
        assert title in run.stdout
    run = jaxllm("plan", "--preset", "llama-3.1-8b-h100")
    assert run.returncode == 0 and "decode roofline" in run.stdout
    assert jaxllm("generate", "--help").stdout.startswith("usage: python -m jaxllm.generate")


def test_the_serving_docs_list_every_flag():
    readme = (ROOT / "docs" / "serving.md").read_text()
    for flag in FLAGS:
        name = flag.names[0]
        shown = f"--[no-]{name[2:]}" if flag.kind is None and flag.env else name
        assert f"`{shown}" in readme, name
        if flag.env:
            assert f"`{flag.env}`" in readme, flag.env
