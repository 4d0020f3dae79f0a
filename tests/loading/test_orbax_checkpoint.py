"""orbax round trip of the converted SmolLM2: save, restore in a fresh process, identical logits."""

import json
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.loading import load_model
from jaxllm.loading.checkpoint import save_checkpoint

pytestmark = pytest.mark.slow  # checkpoints saved and loaded, in new processes

PROBE = [[1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198]]

RESTORE_SCRIPT = """
import json, sys, time
import jax.numpy as jnp, numpy as np
import gguf.quants, orbax.checkpoint  # imports and backend start-up are not what is compared
from jaxllm.loading import load_model
jnp.zeros(1).block_until_ready()
t = time.perf_counter(); load_model(None, dtype="float32"); gguf_s = time.perf_counter() - t
t = time.perf_counter(); lm = load_model(sys.argv[1], dtype="float32"); restore_s = time.perf_counter() - t
logits = np.asarray(lm.model(jnp.asarray(json.loads(sys.argv[2]))))
np.save(sys.argv[3], logits)
print(json.dumps({"gguf_s": gguf_s, "restore_s": restore_s,
                  "chat": lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])}))
"""


def test_orbax_round_trip_in_new_process(tmp_path):
    t = time.perf_counter()
    lm = load_model(None, dtype="float32")
    convert_s = time.perf_counter() - t
    save_checkpoint(lm.model, tmp_path / "ckpt", tokenizer=lm.tokenizer)
    out = subprocess.run([sys.executable, "-c", RESTORE_SCRIPT, str(tmp_path / "ckpt"), json.dumps(PROBE),
                          str(tmp_path / "logits.npy")], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\nGGUF convert: {convert_s:.2f} s here, {result['gguf_s']:.2f} s in the new process "
          f"; orbax restore in the new process: {result['restore_s']:.2f} s")
    expected = np.asarray(lm.model(jnp.asarray(PROBE)))
    np.testing.assert_array_equal(np.load(tmp_path / "logits.npy"), expected)
    assert result["chat"] == lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_quantized_checkpoint_keeps_its_formats(tmp_path):
    import pytest

    from jaxllm.loading import LoadError
    from jaxllm.loading.checkpoint import QUANT_FILE

    lm = load_model(None, load_tokenizer_too=False)  # the GGUF's Q4_1 / Q8_0, kept
    assert lm.model.quant_plan
    save_checkpoint(lm.model, tmp_path / "q")
    assert (tmp_path / "q" / QUANT_FILE).is_file()
    back = load_model(tmp_path / "q", load_tokenizer_too=False)
    assert back.model.quant_plan == lm.model.quant_plan
    assert back.model.layers.layer.mlp.down_proj.weight[...].dtype == jnp.uint8  # packed, not expanded
    np.testing.assert_array_equal(np.asarray(back.model(jnp.asarray(PROBE))), np.asarray(lm.model(jnp.asarray(PROBE))))
    with pytest.raises(LoadError, match="restored as it was saved"):
        load_model(tmp_path / "q", quantization="int8")


def test_a_gemma3_checkpoint_keeps_its_config(tiny_model_dir, tmp_path):
    """The config's nested and per-layer fields (the windowed layers' RoPE, the windows) survive the JSON."""
    folder, _ = tiny_model_dir("gemma3")
    lm = load_model(folder, dtype="float32", load_tokenizer_too=False)
    save_checkpoint(lm.model, tmp_path / "g")
    back = load_model(tmp_path / "g", dtype="float32", load_tokenizer_too=False)
    assert back.config == lm.config and back.config.local_rope.theta == 100.0
    ids = jnp.asarray([[5, 17, 300, 2, 9, 41, 8, 77, 12]])
    np.testing.assert_array_equal(np.asarray(back.model(ids)), np.asarray(lm.model(ids)))


@pytest.mark.parametrize("case", ["gpt_oss", "phi3_longrope", "qwen3_moe-q8_0"])
def test_new_families_round_trip(case, tiny_model_dir, tmp_path):
    """GPT-OSS (sinks, expert biases, the SwiGLU limit), LongRoPE's factor sets, a GGUF's quantized experts: the
    restored model's config and logits equal the saved one's."""
    from gguf import GGMLQuantizationType as T

    from tests.gguf_writer import write_moe_gguf

    name, _, qtype = case.partition("-")
    folder, hf_model = tiny_model_dir(name)
    source = write_moe_gguf(hf_model, tmp_path / "moe.gguf", T.Q8_0) if qtype else folder
    lm = load_model(source, dtype="float32", load_tokenizer_too=False)
    save_checkpoint(lm.model, tmp_path / "ckpt")
    back = load_model(tmp_path / "ckpt", dtype="float32", load_tokenizer_too=False)
    assert back.config == lm.config and back.model.quant_plan == lm.model.quant_plan
    ids = jnp.asarray([[5, 900, 17, 33, 250, 4, 61, 700, 12]])
    np.testing.assert_array_equal(np.asarray(back.model(ids)), np.asarray(lm.model(ids)))
