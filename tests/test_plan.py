"""`python -m jaxllm.plan` against a hand computation for Llama-3.1-8B on one H100 (bfloat16)."""

import pytest

from jaxllm.engine.config import EngineConfig
from jaxllm.plan import DEVICES, GIB, bundled_model_config, main, make_plan


@pytest.fixture(autouse=True)
def _default_allocator(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)


def test_llama_8b_on_h100_matches_the_hand_computation():
    engine = EngineConfig.from_preset("llama-3.1-8b-h100")
    cfg = bundled_model_config(engine.served_model_name)
    plan = make_plan(cfg, engine, DEVICES["h100"], tp=1, context=1024)
    # Parameters: embedding and LM head (untied) 128256 x 4096 each; per layer q/k/v (32 + 2 x 8 heads) x 128 rows,
    # o 4096 x 4096, gate/up/down 3 x 14336 x 4096, two norms; the final norm.
    v, e, f, layers = 128256, 4096, 14336, 32
    params = 2 * v * e + layers * ((32 + 16) * 128 * e + e * e + 3 * f * e + 2 * e) + e
    assert params == 8_030_261_248
    assert plan.weight_bytes == plan.weight_bytes_per_device == 2 * params
    assert plan.kv_bytes_per_token == 2 * layers * 8 * 128 * 2 == 128 * 1024
    budget = (0.75 * 80 * GIB - 2 * params) * 0.9  # JAX's default allocator share, then kv_memory_fraction
    assert plan.num_pages == int(budget) // (128 * 1024 * 16) == 20755
    assert plan.max_model_len == 32768
    assert plan.max_concurrency == pytest.approx(20755 * 16 / 32768)
    # Batch 1 reads every weight and 1024 tokens of KV a step.
    assert plan.decode_tok_s[1] == pytest.approx(3.35e12 / (2 * params + 1024 * 128 * 1024))
    assert plan.decode_tok_s[256] == pytest.approx(256 * 3.35e12 / (2 * params + 256 * 1024 * 128 * 1024))


def test_tensor_parallel_splits_weights_and_kv():
    engine = EngineConfig.from_preset("llama-3.1-70b-tp8")
    cfg = bundled_model_config(engine.served_model_name)
    plan = make_plan(cfg, engine, DEVICES["h100"], tp=8, context=1024)
    replicated = 2 * (cfg.num_layers * 2 + 1) * cfg.hidden_size  # the norms, bfloat16
    assert plan.weight_bytes_per_device == (plan.weight_bytes - replicated) // 8 + replicated
    assert plan.kv_bytes_per_token_per_device == plan.kv_bytes_per_token // 8 == 40 * 1024


def test_the_command_prints_a_plan(capsys):
    main(["--preset", "llama-3.1-70b-tp8", "--device", "v6e"])
    out = capsys.readouterr().out
    assert "TPU v6e x 8" in out and "decode roofline, batch 1" in out and "maximum concurrency" in out


def test_a_float8_cache_halves_kv_bytes_and_doubles_pages():
    engine = EngineConfig.from_preset("llama-3.1-8b-h100", kv_cache_dtype="float8_e4m3fn")
    plan = make_plan(bundled_model_config(engine.served_model_name), engine, DEVICES["h100"], tp=1, context=1024)
    assert plan.kv_bytes_per_token == 64 * 1024
    assert plan.num_pages == 2 * 20755 or plan.num_pages == 2 * 20755 + 1


def _plan(*argv, **env):
    import os
    import subprocess
    import sys
    from pathlib import Path

    environ = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "JAXLLM_"))} | env
    return subprocess.run([sys.executable, "-m", "jaxllm", "plan", *argv], capture_output=True, text=True,
                          env=environ, cwd=Path(__file__).resolve().parents[1], timeout=300)


@pytest.mark.slow
def test_plan_a_model_by_name(tiny_model_dir, tmp_path):
    """`jaxllm plan MODEL`: a folder, a hub id (only config.json is fetched), a bundled config by its hub name; a
    model that cannot be found is one line and exit status 2."""
    from tests.loading.fake_hub import FakeHub, Repo

    folder, _ = tiny_model_dir("llama")
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    hub = FakeHub({"acme/tiny": Repo(files)})
    try:
        env = dict(HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(tmp_path / "cache"), HF_HUB_DISABLE_PROGRESS_BARS="1")
        local = _plan(str(folder), "--preset", "llama-3.1-8b-h100", **env)
        by_id = _plan("acme/tiny", **env)
        assert local.returncode == by_id.returncode == 0, by_id.stderr
        assert "decode roofline, batch 1" in by_id.stdout and by_id.stdout == local.stdout
        assert hub.downloads("acme/tiny") == ["config.json"]  # not the weights
        offline = _plan("acme/tiny", HF_HUB_OFFLINE="1", **env)  # the warm cache answers
        assert offline.returncode == 0 and offline.stdout == by_id.stdout
        missing = _plan("acme/nothing-here", **env)
        assert missing.returncode == 2 and missing.stderr.strip().splitlines()[-1].startswith(
            "error: acme/nothing-here: ")
        assert "Traceback" not in missing.stderr
    finally:
        hub.close()
    bundled = _plan("meta-llama/Llama-3.1-70B-Instruct", "--tp", "8", HF_HUB_OFFLINE="1")
    assert bundled.returncode == 0 and "80 layers" in bundled.stdout


def test_qwen3_moe_keeps_every_expert_and_reads_the_routed_ones():
    """Qwen3-30B-A3B: all 128 experts resident; a batch-1 step reads 8 of them per layer (its ~3B active
    parameters), a batch of b tokens the share 1 - (1 - 8/128) ** b."""
    engine = EngineConfig.from_preset("llama-3.1-8b-h100")
    cfg = bundled_model_config("Qwen/Qwen3-30B-A3B")
    plan = make_plan(cfg, engine, DEVICES["h100"], tp=1, context=1024)
    experts = 48 * 128 * 3 * 768 * 2048  # layers x experts x (gate, up, down) x width x hidden
    assert plan.expert_bytes_per_device == 2 * experts
    dense = plan.weight_bytes - 2 * experts
    assert 3.0e9 < (dense + 2 * experts * 8 / 128) / 2 < 3.5e9  # "A3B": active parameters
    kv = 1024 * plan.kv_bytes_per_token
    assert plan.decode_tok_s[1] == pytest.approx(3.35e12 / (dense + 2 * experts * 8 / 128 + kv))
    batch = max(plan.decode_tok_s)  # the most sequences whose context fits
    share = 1 - (1 - 8 / 128) ** batch
    assert batch > 1 and 8 / 128 < share < 1
    assert plan.decode_tok_s[batch] == pytest.approx(batch * 3.35e12 / (dense + 2 * experts * share + batch * kv))


def test_whole_experts_over_the_tp_devices_take_the_same_share_of_each(capsys):
    """--enable-expert-parallel: each of 4 devices holds 32 whole experts instead of a quarter of every expert's
    rows, the same bytes; a model without experts is refused in one line."""
    cfg = bundled_model_config("Qwen/Qwen3-30B-A3B")
    rows = make_plan(cfg, EngineConfig.from_preset("llama-3.1-8b-h100"), DEVICES["h100"], tp=4, context=1024)
    whole = make_plan(cfg, EngineConfig.from_preset("llama-3.1-8b-h100", enable_expert_parallel=True),
                      DEVICES["h100"], tp=4, context=1024)
    assert whole.expert_bytes_per_device == rows.expert_bytes_per_device == 2 * 48 * 128 * 3 * 768 * 2048 // 4
    assert whole.weight_bytes_per_device == rows.weight_bytes_per_device
    assert main(["--preset", "llama-3.1-8b-h100", "--tp", "4", "--enable-expert-parallel"]) == 2
    assert capsys.readouterr().err.strip() == "error: enable_expert_parallel needs a mixture-of-experts model"
