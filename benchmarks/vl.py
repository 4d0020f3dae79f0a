"""Vision-language serving on CPU, on a random Qwen2.5-VL (Qwen2.5-VL's layout scaled down: an 8-layer, 512-wide
Qwen2 decoder; an 8-block, 320-wide vision encoder with window attention and one full-attention block), built locally
by transformers, in the same run, alternating rounds, medians:

(a) text-only requests on the VL model against the same decoder served as a text model (its language tensors written
    as a Qwen2 folder): 16 prompts x 64 greedy tokens. A text-only step on a VL model schedules no encoder work; what
    is left is the image-embedding input and M-RoPE positions every step carries.
(b) image requests: 8 chat prompts, each with its own 448 x 336 image (192 image tokens), 32 greedy tokens: jaxllm's
    `LLM.generate` (batched, encoder cache emptied every round) against transformers' `generate`, one request at a
    time (its batching of images needs a processor's padding; the per-request time is what it offers), torch on 2
    threads, fed the same pixel rows. Greedy outputs are compared (random weights: ties aside they agree).

    python benchmarks/vl.py [--rounds 3] [--json benchmarks/results/vl_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.tiny_models import TOKENIZER_CORPUS, add_tiny_tokenizer  # noqa: E402

TEXT = dict(vocab_size=1024, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 1000000.0})
VISION = dict(depth=8, hidden_size=320, num_heads=5, intermediate_size=960, out_hidden_size=512,
              fullatt_block_indexes=[7])
IMAGE_SIZE = (448, 336)  # width, height: 16 x 12 merged tokens
ENGINE = dict(dtype="float32", max_num_seqs=16, max_num_batched_tokens=512, num_pages=512, max_model_len=1024,
              enable_prefix_caching=False)


def build(root: Path) -> tuple[Path, Path]:
    """(the VL folder, a text-only Qwen2 folder holding the same decoder tensors)."""
    import json as _json

    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    vl, text = root / "vl", root / "text"
    config = transformers.Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION, image_token_id=1000,
                                           video_token_id=1001, vision_start_token_id=1002, vision_end_token_id=1003,
                                           bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.save_pretrained(vl)
    add_tiny_tokenizer(vl, vision=True)
    (vl / "preprocessor_config.json").write_text(_json.dumps({
        "min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 256, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2}))
    text.mkdir()
    tensors = {}
    for f in vl.glob("*.safetensors"):
        for name, t in load_file(f).items():
            if "visual." not in name:  # the decoder's, saved as model.* or model.language_model.*
                tensors[name.replace("model.language_model.", "model.", 1)] = t
    save_file(tensors, text / "model.safetensors")
    raw = _json.loads((vl / "config.json").read_text())["text_config"]  # as saved: every default included
    rope = raw.pop("rope_parameters")
    (text / "config.json").write_text(_json.dumps({**raw, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                                                   "rope_theta": rope["rope_theta"], "tie_word_embeddings": False}))
    add_tiny_tokenizer(text)
    return vl, text


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import torch
    import transformers
    from PIL import Image

    from jaxllm import LLM, SamplingParams

    torch.set_num_threads(2)
    root = Path(tempfile.mkdtemp(prefix="jaxllm_vl_bench_"))
    vl_folder, text_folder = build(root)
    vl = LLM(str(vl_folder), **ENGINE)
    text = LLM(str(text_folder), **ENGINE)
    tok = vl.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(TOKENIZER_CORPUS[i % 6] * (1 + i % 4))} for i in range(16)]
    text_params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    rng = np.random.default_rng(0)
    w, h = IMAGE_SIZE
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(8)]
    chat = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                 {"type": "text", "text": "Describe it."}]}])
    image_prompts = [{"prompt": chat, "multi_modal_data": {"image": [im]}} for im in images]
    image_params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(vl_folder, dtype=torch.float32).eval()
    spec = vl.engine.mm_spec

    def hf_run() -> list[list[int]]:
        outs = []
        for prompt, image in zip(image_prompts, images, strict=True):
            ids, mm = spec.prepare(tok.encode(prompt["prompt"]), [image])
            (item,) = mm.images
            with torch.no_grad():
                out = hf.generate(input_ids=torch.tensor([ids]),
                                  attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  mm_token_type_ids=torch.tensor([[int(t == 1000) for t in ids]]),
                                  pixel_values=torch.tensor(item.rows), image_grid_thw=torch.tensor([item.grid]),
                                  max_new_tokens=32, min_new_tokens=32, do_sample=False)
            outs.append(out[0, len(ids):].tolist())
        return outs

    for llm, batch, params in ((vl, prompts, text_params), (text, prompts, text_params), (vl, image_prompts,
                                                                                          image_params)):
        llm.generate(batch, params, use_tqdm=False)  # warm (a one-shot first run of each shape)
    rounds = []
    for r in range(args.rounds):
        row = {}
        order = [("vl_text", vl), ("text", text)] if r % 2 == 0 else [("text", text), ("vl_text", vl)]
        for name, llm in order:
            outs, s = timed(lambda llm=llm: llm.generate(prompts, text_params, use_tqdm=False))
            row[name] = sum(len(o.outputs[0].token_ids) for o in outs) / s
            row[f"{name}_tokens"] = [o.outputs[0].token_ids for o in outs]
        vl.engine.runner.encoder_cache.clear()
        encoded = vl.engine.runner.encoder_cache.encoded
        outs, s = timed(lambda: vl.generate(image_prompts, image_params, use_tqdm=False))
        row["jaxllm_image_req_s"] = len(outs) / s
        row["jaxllm_images_encoded"] = vl.engine.runner.encoder_cache.encoded - encoded
        hf_outs, s = timed(hf_run)
        row["hf_image_req_s"] = len(hf_outs) / s
        row["image_outputs_agree"] = sum(o.outputs[0].token_ids == want for o, want in zip(outs, hf_outs, strict=True))
        rounds.append(row)
        print(f"round {r}: text-only tok/s VL {row['vl_text']:.1f} vs text model {row['text']:.1f}; image requests/s "
              f"jaxllm {row['jaxllm_image_req_s']:.2f} vs transformers {row['hf_image_req_s']:.2f} "
              f"({row['image_outputs_agree']}/8 outputs equal)", flush=True)
    same_text = all(r["vl_text_tokens"] == r["text_tokens"] for r in rounds)
    med = {k: statistics.median(r[k] for r in rounds) for k in ("vl_text", "text", "jaxllm_image_req_s",
                                                               "hf_image_req_s")}
    result = {
        "text_only_tok_s": {"vl_model": med["vl_text"], "text_model": med["text"],
                            "ratio": med["vl_text"] / med["text"], "outputs_identical": same_text},
        "image_requests_s": {"jaxllm": med["jaxllm_image_req_s"], "transformers": med["hf_image_req_s"],
                             "ratio": med["jaxllm_image_req_s"] / med["hf_image_req_s"],
                             "outputs_agree": [r["image_outputs_agree"] for r in rounds],
                             "images_encoded_per_round": [r["jaxllm_images_encoded"] for r in rounds]},
        "rounds": [{k: v for k, v in r.items() if not k.endswith("_tokens")} for r in rounds],
        "setup": {"text": TEXT, "vision": VISION, "image_size": IMAGE_SIZE, "engine": ENGINE, "torch_threads": 2},
    }
    print(json.dumps({k: result[k] for k in ("text_only_tok_s", "image_requests_s")}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
