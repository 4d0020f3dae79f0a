"""A GGUF cut to its first N transformer blocks: the embedded SmolLM2 (92 MB) does not fit what travels to a lent
device machine (64 MiB with the working tree), 10 of its 30 blocks do (54 MB). The cut model keeps the real
weights, tokenizer and chat template, so greedy agreement between two engines is measured on real logits.

    python benchmarks/truncate_gguf.py --layers 10 --out .devmodel/smollm2-10l.gguf   # from the embedded model
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import gguf


def truncate(src: str | Path, dst: str | Path, layers: int) -> int:
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    total = reader.fields[count_key].contents()
    if not 0 < layers <= total:
        raise ValueError(f"{src} has {total} blocks; cannot keep {layers}")
    writer = gguf.GGUFWriter(str(dst), arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    kept = [t for t in reader.tensors
            if not (m := re.match(r"blk\.(\d+)\.", t.name)) or int(m.group(1)) < layers]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return Path(dst).stat().st_size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", help="a GGUF (default: the embedded model)")
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    src = args.src
    if src is None:
        from jaxllm.loading.embedded import embedded_model_path
        src = embedded_model_path()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    print(f"{args.out}: {truncate(src, args.out, args.layers) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
