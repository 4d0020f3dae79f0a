"""A mixture of experts on CPU against llama.cpp, same file, same run: a random Qwen3-MoE-shaped model (hidden 512,
16 layers, 64 experts of width 256, 8 a token, 8 heads / 4 KV heads of 64, a 32000-token vocabulary: 420M
parameters, 59M active a token) written as a Q8_0 GGUF by the tests' writer (llama.cpp's converter's layout), its
experts kept quantized by jaxllm (the grouped int8 kernel reads only the routed experts).

Decode only, as the peers time it: one stream, 128 tokens from an empty context (`llama-bench -p 0 -n 128`;
jaxllm: a 1-token prompt, the time of 128 new tokens less that of 1); 16 streams, 32-token prompts, 128 new tokens
each (`llama-batched-bench`'s S_TG, generated tokens over the generation time; jaxllm: 16 x 128 over the time of
129 new tokens less that of 1). Both engines run two threads; they alternate in every round; medians.

    python benchmarks/moe_cpu.py [--rounds 3] [--json benchmarks/results/moe_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import machine
import peers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=16, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256,
             norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=4096)
NEW, STREAMS, PROMPT = 128, 16, 32


def build(folder: Path) -> Path:
    """The random model as a Q8_0 GGUF (weights of std 0.02: logits of a trained model's scale)."""
    import torch
    import transformers
    from gguf import GGMLQuantizationType as T

    from tests.gguf_writer import write_moe_gguf

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**SHAPE), dtype=torch.float32)
    return write_moe_gguf(model.eval(), folder / "qwen3moe-shape-q8_0.gguf", T.Q8_0)


def jaxllm_decode(llm, prompts: list[list[int]], new: int) -> float:
    """Generated tok/s of `prompts` decoding `new` tokens each: the time of new + 1 tokens less that of 1."""
    from jaxllm import SamplingParams

    def timed(n):
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=n,
                                                                              ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start
    return len(prompts) * new / (timed(new + 1) - timed(1))


def llamacpp_batched_decode(tools: Path, model: str) -> float:
    """llama-batched-bench's generation speed (S_TG) for STREAMS x (PROMPT + NEW)."""
    out = peers.run_tool([str(tools / "bin" / "llama-batched-bench"), "-m", model, "-t", "2", "-tb", "2",
                          "-c", str(STREAMS * (PROMPT + NEW) + 64), "-b", "2048", "-ub", "512", "-npp", str(PROMPT),
                          "-ntg", str(NEW), "-npl", str(STREAMS)], peers.BATCHED_NO_REPACK)
    row = [r for r in out.splitlines() if re.match(rf"\|\s+{PROMPT} \|\s+{NEW} \|\s+{STREAMS} \|", r)][0]
    return float(row.strip("|").split("|")[7])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    tools = peers.peer_dir()
    if tools is None:
        sys.exit("llama.cpp's tools are not built here (../shared/peers/build_llamacpp.sh)")
    from jaxllm import LLM

    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp))
        llm = LLM(str(path), max_num_seqs=STREAMS, max_model_len=PROMPT + NEW + 8)
        plan = dict(llm.engine.model.quantization)
        assert plan["experts.gate_up_proj"].name == "q8_0", plan
        single = [[7]]
        batch = [[(17 * s + i) % 31000 + 3 for i in range(PROMPT)] for s in range(STREAMS)]
        for prompts in (single, batch):  # warm-up
            jaxllm_decode(llm, prompts, 8)
        runs: dict[str, list[dict]] = {"jaxllm": [], "llama.cpp": []}
        for r in range(args.rounds):
            runs["jaxllm"].append({"single": jaxllm_decode(llm, single, NEW),
                                   "16 streams": jaxllm_decode(llm, batch, NEW)})
            runs["llama.cpp"].append({"single": peers.single_stream(tools, str(path), NEW),
                                      "16 streams": llamacpp_batched_decode(tools, str(path))})
            print(f"round {r}: {runs['jaxllm'][-1]} | llama.cpp {runs['llama.cpp'][-1]}", flush=True)
    summary = {k: {m: statistics.median(x[m] for x in rs) for m in ("single", "16 streams")} for k, rs in runs.items()}
    ratios = {m: summary["jaxllm"][m] / summary["llama.cpp"][m] for m in ("single", "16 streams")}
    result = {"machine": machine.describe(), "rounds": args.rounds, "shape": SHAPE, "summary": summary,
              "ratios": ratios, "runs": runs, "llama_repack_off": sorted(set(peers.repack_off))}
    print(json.dumps({"summary": summary, "ratios": ratios}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
