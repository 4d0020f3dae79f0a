"""What a family's extra ops cost: the embedded SmolLM2's own weights (its GGUF's Q4_1 / Q8_0 blocks, untouched)
rewritten as a Gemma 3 GGUF — the same shape (30 layers, hidden 576, 9 heads / 3 KV heads of 64), plus Gemma 3's
q/k norms, sandwich norms, (1 + w) float32 norms, scaled embeddings and a RoPE per kind of layer (five layers of a
512-token window to one global, as Gemma 3 1B) — against SmolLM2 itself, both served with the `smollm2-cpu`
preset. The rewritten model's tokens are noise (its q/k rows keep llama.cpp's Llama order and its new norms are
ones): only speed is compared. Workload: the shared peer workload's batch (32 x 128 prompt + 128 new tokens) and
single stream (`workload.py`); the two engines alternate within each round, in one process (separate processes
differed by up to 30% run to run on the same engine; both engines are the same code, warm); medians.

    python benchmarks/family_cost.py [--rounds 5] [--json benchmarks/results/family_cost_cpu.json]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import gguf
import machine
import numpy as np
import workload

WINDOW, PATTERN = 512, 6


def gemma3_from_llama(src: Path, dst: Path) -> Path:
    """`src` (a llama GGUF) as a gemma3 GGUF with the same weights; the norms Gemma 3 adds are ones."""
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), "gemma3", endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        name = "gemma3." + field.name[len("llama."):] if field.name.startswith("llama.") else field.name
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    layers = reader.fields["llama.block_count"].contents()
    hidden = reader.fields["llama.embedding_length"].contents()
    head_dim = hidden // reader.fields["llama.attention.head_count"].contents()
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_sliding_window(WINDOW)
    writer.add_sliding_window_pattern(PATTERN)
    extra = {f"blk.{i}.{name}": np.ones(size, np.float32) for i in range(layers)
             for name, size in (("post_attention_norm.weight", hidden), ("post_ffw_norm.weight", hidden),
                                ("attn_q_norm.weight", head_dim), ("attn_k_norm.weight", head_dim))}
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    for name, a in extra.items():
        writer.add_tensor_info(name, a.shape, a.dtype, a.nbytes, gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    for a in extra.values():
        writer.write_tensor_data(a)
    writer.close()
    return dst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    from jaxllm import LLM
    from jaxllm.loading.embedded import embedded_model_path

    with tempfile.TemporaryDirectory() as tmp:
        gemma = gemma3_from_llama(embedded_model_path(), Path(tmp) / "smollm2-as-gemma3.gguf")
        llms = {"SmolLM2": LLM(preset="smollm2-cpu"), "Gemma 3 shape": LLM(str(gemma), preset="smollm2-cpu")}
        runs: dict[str, list[dict]] = {k: [] for k in llms}
        for r in range(args.rounds):
            for label, llm in llms.items():
                runs[label].append(workload.run(llm))
                print(f"round {r}: {label} {runs[label][-1]}", flush=True)
    summary = {k: {m: statistics.median(x[m] for x in rs) for m in ("batch_tok_s", "single_tok_s")}
               for k, rs in runs.items()}
    ratios = {m: summary["Gemma 3 shape"][m] / summary["SmolLM2"][m] for m in ("batch_tok_s", "single_tok_s")}
    host = machine.describe()
    print(f"\nmedians over {args.rounds} rounds\n{machine.line(host)}")
    print(f"{'model':16s} {'batch 32 tok/s':>15s} {'single tok/s':>13s}")
    for k, m in summary.items():
        print(f"{k:16s} {m['batch_tok_s']:15.1f} {m['single_tok_s']:13.1f}")
    print(f"Gemma 3 shape / SmolLM2: batch {ratios['batch_tok_s']:.2f}x, single {ratios['single_tok_s']:.2f}x")
    machine.save(args.json, host, rounds=args.rounds, summary=summary, ratios=ratios, runs=runs)


if __name__ == "__main__":
    main()
