"""Models by name (`jaxllm.loading.resolve`): Hugging Face hub ids fetched from a hub on loopback (HF_ENDPOINT)
into a cache made in the test (huggingface_hub's own layout, HF_HUB_CACHE), in fresh processes that read the
environment as a user's would: only the files the loaders read, a warm cache offline, revisions, llama.cpp's
``org/name:QUANT`` GGUF convention, and one line for every failure."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxllm.loading.errors import LoadError
from jaxllm.loading.resolve import looks_like_hub_id, resolve_model
from tests.loading.fake_hub import FakeHub, Repo

ROOT = Path(__file__).resolve().parents[2]
CONFIG_V1 = json.dumps({"model_type": "llama", "revision": "v1"}).encode()
CONFIG_V2 = json.dumps({"model_type": "llama", "revision": "v2"}).encode()
PLAIN = {"config.json": CONFIG_V2, "generation_config.json": b'{"g": 1}', "tokenizer.json": b'{"t": 1}',
         "tokenizer_config.json": b'{"c": 1}', "model-00001-of-00002.safetensors": b"a" * 64,
         "model-00002-of-00002.safetensors": b"b" * 64, "model.safetensors.index.json": b"{}",
         # what a hub repository also carries and the loaders never read
         "pytorch_model.bin": b"p" * 64, "onnx/model.onnx": b"o", "flax_model.msgpack": b"f", "README.md": b"#",
         "tiny.Q8_0.gguf": b"g"}
NEEDED = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"}
GGUFS = {"tiny-Q4_K_M.gguf": b"1", "tiny-Q4_K_S.gguf": b"2", "tiny-q8_0.gguf": b"3", "tiny-F16.gguf": b"4",
         "tiny-Q6_K-00001-of-00002.gguf": b"5", "tiny-Q6_K-00002-of-00002.gguf": b"6", "README.md": b"#"}
OLD_COMMIT = "1" * 40


@pytest.fixture
def hub():
    hub = FakeHub({
        "acme/tiny": Repo(dict(PLAIN), branches={"v1": OLD_COMMIT},
                          revisions={OLD_COMMIT: {**PLAIN, "config.json": CONFIG_V1}}),
        "acme/tiny-GGUF": Repo(dict(GGUFS)),
        "acme/twins-GGUF": Repo({"a-Q4_0.gguf": b"1", "b.Q4_0.gguf": b"2"}),
        "acme/gated": Repo(dict(PLAIN), gated=True),
    })
    yield hub
    hub.close()


def resolve(hub: FakeHub, cache: Path, name: str, revision: str | None = None, **env) -> tuple[int, str]:
    """resolve_model in a fresh process with the hub's variables: (exit status, its one line or the path)."""
    code = "\n".join(["import sys", "from jaxllm.loading.resolve import resolve_model",
                      "from jaxllm.loading.errors import LoadError", "try:",
                      "    print(resolve_model(sys.argv[1], revision=sys.argv[2] or None).path)",
                      "except LoadError as e:", "    print(e)", "    sys.exit(2)"])
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    environ.update(HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(cache), HF_HUB_DISABLE_PROGRESS_BARS="1", **env)
    run = subprocess.run([sys.executable, "-c", code, name, revision or ""], env=environ, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode in (0, 2), run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stdout + run.stderr
    return run.returncode, lines[0]


def test_names_that_are_hub_ids():
    assert looks_like_hub_id("Qwen/Qwen2.5-1.5B-Instruct") and looks_like_hub_id("org/name:Q4_K_M")
    assert not looks_like_hub_id("/models/llama") and not looks_like_hub_id("model.gguf")
    assert not looks_like_hub_id("a/b/c") and not looks_like_hub_id("org/name:Q4 K")


def test_local_paths_and_the_embedded_model(tmp_path, smollm2_path):
    assert resolve_model(None).path == smollm2_path and resolve_model(None).source == "embedded"
    local = resolve_model(str(tmp_path))
    assert (local.path, local.name, local.source) == (tmp_path, tmp_path.name, "local")
    with pytest.raises(LoadError, match=r"nowhere: no such file or folder \(nor a Hugging Face hub id"):
        resolve_model(tmp_path / "nowhere")


def test_a_hub_id_fetches_only_what_the_loaders_read_and_then_works_offline(hub, tmp_path):
    status, path = resolve(hub, tmp_path, "acme/tiny")
    assert status == 0 and Path(path).parent.parent.name == "models--acme--tiny"  # huggingface_hub's cache layout
    assert set(hub.downloads("acme/tiny")) == NEEDED
    assert json.loads((Path(path) / "config.json").read_text())["revision"] == "v2"
    asked = len(hub.requests)
    assert resolve(hub, tmp_path, "acme/tiny", HF_HUB_OFFLINE="1") == (0, path)  # warm cache, offline
    assert len(hub.requests) == asked  # the hub was not asked


def test_a_revision_resolves_its_own_snapshot(hub, tmp_path):
    status, path = resolve(hub, tmp_path, "acme/tiny", revision="v1")
    assert status == 0 and Path(path).name == OLD_COMMIT
    assert json.loads((Path(path) / "config.json").read_text())["revision"] == "v1"
    assert resolve(hub, tmp_path, "acme/tiny", revision="v1", HF_HUB_OFFLINE="1") == (0, path)
    status, line = resolve(hub, tmp_path, "acme/tiny", revision="v9")
    assert status == 2 and line == "acme/tiny: no revision 'v9' in the repository"


@pytest.mark.parametrize(("quant", "file"), [("Q4_K_M", "tiny-Q4_K_M.gguf"), ("q4_k_s", "tiny-Q4_K_S.gguf"),
                                             ("Q8_0", "tiny-q8_0.gguf"), ("f16", "tiny-F16.gguf")])
def test_a_quantization_tag_picks_that_gguf_file(hub, tmp_path, quant, file):
    status, path = resolve(hub, tmp_path, f"acme/tiny-GGUF:{quant}")
    assert status == 0 and Path(path).name == file
    assert hub.downloads("acme/tiny-GGUF") == [file]  # that file only
    assert resolve(hub, tmp_path, f"acme/tiny-GGUF:{quant}", HF_HUB_OFFLINE="1") == (0, path)


def test_quantization_errors_list_the_files(hub, tmp_path):
    files = "tiny-F16.gguf, tiny-Q4_K_M.gguf, tiny-Q4_K_S.gguf, tiny-Q6_K-00001-of-00002.gguf, " \
            "tiny-Q6_K-00002-of-00002.gguf, tiny-q8_0.gguf"
    assert resolve(hub, tmp_path, "acme/tiny-GGUF:Q4_K") == (
        2, f"acme/tiny-GGUF:Q4_K: no GGUF file in the repository has the quantization Q4_K (GGUF files: {files})")
    assert resolve(hub, tmp_path, "acme/twins-GGUF:Q4_0") == (
        2, "acme/twins-GGUF:Q4_0: several GGUF files have the quantization Q4_0: a-Q4_0.gguf, b.Q4_0.gguf")
    status, line = resolve(hub, tmp_path, "acme/tiny-GGUF:Q6_K")
    assert status == 2 and "is split into 2 parts" in line
    resolve(hub, tmp_path, "acme/tiny-GGUF:Q8_0")  # warm one file; offline, only that one is known
    assert resolve(hub, tmp_path, "acme/tiny-GGUF:Q4_K_M", HF_HUB_OFFLINE="1") == (
        2, "acme/tiny-GGUF:Q4_K_M: no GGUF file in the cached snapshot (offline) has the quantization Q4_K_M "
           "(GGUF files: tiny-q8_0.gguf)")


def test_unreachable_models_are_one_line(hub, tmp_path):
    assert resolve(hub, tmp_path, "acme/missing") == (
        2, "acme/missing: no such repository on the hub (or it is private: set HF_TOKEN)")
    assert resolve(hub, tmp_path, "acme/tiny", HF_HUB_OFFLINE="1") == (
        2, "acme/tiny: not in the local Hugging Face cache, and the hub cannot be reached (offline: HF_HUB_OFFLINE "
           "is set, or no connection)")
    assert resolve(hub, tmp_path, "acme/gated") == (
        2, "acme/gated: the repository is gated: accept its terms on the hub and set HF_TOKEN")
    status, path = resolve(hub, tmp_path, "acme/gated", HF_TOKEN="hf_test")  # a token is sent: the hub lets it in
    assert status == 0 and Path(path, "config.json").is_file()
    assert resolve(hub, tmp_path, "acme/tiny-GGUF") == (
        2, "acme/tiny-GGUF: the repository has no config.json (a GGUF repository? name a file in it with "
           "acme/tiny-GGUF:QUANT)")


@pytest.mark.slow
def test_generate_runs_a_model_by_hub_id(hub, tmp_path, tiny_folder):
    """`python -m jaxllm.generate --model org/name` gives the local folder's output; a missing repo is one line,
    exit status 2."""
    folder = tiny_folder  # (a copy with a tokenizer: the shared tiny model must stay without one)
    hub.repos["acme/tiny-llama"] = Repo({p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()})
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    environ.update(HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(tmp_path), HF_HUB_DISABLE_PROGRESS_BARS="1")

    def generate(model: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "jaxllm.generate", "--model", model, "--raw", "--max-tokens", "6",
                               "--max-model-len", "64", "--dtype", "float32", "--logprobs", "2", "The quick brown fox"],
                              env=environ, cwd=ROOT, capture_output=True, text=True, timeout=300)

    by_id, local = generate("acme/tiny-llama"), generate(str(folder))
    assert by_id.returncode == 0 and local.returncode == 0, by_id.stderr[-2000:] + local.stderr[-2000:]
    assert by_id.stdout == local.stdout and by_id.stdout.count(":-") >= 6  # each step's top logprobs, equal
    assert "[acme/tiny-llama]" in by_id.stderr  # the model is named as it was asked for
    missing = generate("acme/nothing")
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.strip() == "error: acme/nothing: no such repository on the hub (or it is private: set " \
                                     "HF_TOKEN)"
