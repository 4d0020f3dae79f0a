"""Writes tiny GGUF files the way llama.cpp's converter does (q/k rows permuted for the llama arch)."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _writer(path: Path, arch: str, cfg) -> gguf.GGUFWriter:
    """A writer with the model's shape in `arch`'s metadata keys."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    return w


def write_llama_gguf(hf_model, path: Path, weight_type: T = T.F32, extra_tensors: dict | None = None) -> Path:
    cfg = hf_model.config
    w = _writer(path, "llama", cfg)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"<tok{i}>" for i in range(cfg.vocab_size)])
    w.add_token_types([1] * cfg.vocab_size)
    w.add_eos_token_id(2)
    heads = {"self_attn.q_proj": cfg.num_attention_heads, "self_attn.k_proj": cfg.num_key_value_heads}
    _add_hf_tensors(w, hf_model, HF_TO_GGUF, weight_type,
                    lambda module, a: permute(a, heads[module]) if module in heads else a)
    for gname, (raw, qtype) in (extra_tensors or {}).items():
        w.add_tensor(gname, raw, raw_dtype=qtype)
    _finish(w)
    return path


def _add_hf_tensors(w, hf_model, names: dict[str, str], weight_type: T, transform=lambda module, a: a) -> None:
    """The model's tensors under their GGUF names (`names`: layer module -> GGUF name), matrices in
    `weight_type`."""
    for name, tensor in hf_model.state_dict().items():
        a = tensor.numpy().astype(np.float32)
        parts = name.split(".")
        if parts[1] == "layers":
            module = ".".join(parts[3:-1])
            a = transform(module, a)
            gname = f"blk.{parts[2]}.{names[module]}.{parts[-1]}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        if a.ndim == 2 and weight_type != T.F32:
            w.add_tensor(gname, quants.quantize(a, weight_type), raw_dtype=weight_type)
        else:
            w.add_tensor(gname, a)


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_synthetic_llama_gguf(path: Path, *, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int,
                               vocab: int, weight_type: T, seed: int = 0) -> Path:
    """A llama GGUF of random blocks of `weight_type` in every matrix (float32 norms): a large model written in
    seconds, for memory and loading tests (its outputs are noise)."""
    from tests.quant_blocks import random_blocks

    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"<tok{i}>" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_eos_token_id(2)
    shapes = {"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_q.weight": (hidden, hidden),
                       f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
                       f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
                       f"blk.{i}.attn_output.weight": (hidden, hidden), f"blk.{i}.ffn_gate.weight": (ffn, hidden),
                       f"blk.{i}.ffn_up.weight": (ffn, hidden), f"blk.{i}.ffn_down.weight": (hidden, ffn)})
    for k, (name, shape) in enumerate(shapes.items()):
        w.add_tensor(name, random_blocks(weight_type, shape, seed + k), raw_dtype=weight_type)
    ones = np.ones(hidden, np.float32)
    w.add_tensor("output_norm.weight", ones)
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_phi3_gguf(hf_model, path: Path, weight_type: T = T.F32, spm_vocab: bool = False) -> Path:
    """A phi3 GGUF as llama.cpp's converter writes one: q/k/v stacked in `attn_qkv` and gate/up in `ffn_up`
    (Hugging Face's row order, no permutation), the rotary dimensions and the sliding window in the metadata;
    LongRoPE's factor sets as the tensors `rope_factors_long` / `rope_factors_short`, with the original context
    length and the attention factor (sqrt(1 + ln(scale) / ln(original))) in the metadata.
    spm_vocab: a SentencePiece vocabulary as real Phi-3 files have (llama.cpp loads no BPE vocabulary without merges);
    else a byte-level BPE one without merges, as the llama files of these tests."""
    cfg = hf_model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    w = _writer(path, "phi3", cfg)
    w.add_rope_dimension_count(int(head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0)))
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
    rope = cfg.rope_parameters
    if rope.get("long_factor"):
        original = rope.get("original_max_position_embeddings") or cfg.original_max_position_embeddings
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
    _add_vocab(w, cfg.vocab_size, spm_vocab)
    _add_hf_tensors(w, hf_model, {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up", **HF_TO_GGUF},
                    weight_type)
    _finish(w)
    return path


def _add_vocab(w, vocab_size: int, spm: bool) -> None:
    """A SentencePiece vocabulary (unk, bos, eos, then "▁t<i>"), or a byte-level BPE one without merges."""
    if spm:
        w.add_tokenizer_model("llama")
        w.add_token_list(["<unk>", "<s>", "</s>"] + [f"\u2581t{i}" for i in range(3, vocab_size)])
        w.add_token_scores([0.0] * vocab_size)
        w.add_token_types([2, 3, 3] + [1] * (vocab_size - 3))
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list([f"<tok{i}>" for i in range(vocab_size)])
        w.add_token_types([1] * vocab_size)
    w.add_eos_token_id(2)


GEMMA_TO_GGUF = {**HF_TO_GGUF, "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
                 "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def write_gemma_gguf(hf_model, path: Path, weight_type: T = T.F32) -> Path:
    """A gemma2 or gemma3 GGUF as llama.cpp's converter writes one: norms stored as 1 + w, the sandwich norms under
    their own names, no LM head (tied), the soft caps, the window and the windowed layers' RoPE base in the metadata,
    and a SentencePiece vocabulary. The windowed layers are written as one flag per layer
    (`attention.sliding_window_pattern`, which llama.cpp reads before its default pattern). There is no
    `query_pre_attn_scalar`: llama.cpp scales by head_dim ** -0.5."""
    cfg = hf_model.config
    arch = {"gemma2": "gemma2", "gemma3_text": "gemma3"}[cfg.model_type]
    w = _writer(path, arch, cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_sliding_window(cfg.sliding_window)
    w.add_sliding_window_pattern([kind == "sliding_attention" for kind in cfg.layer_types])
    rope = cfg.rope_parameters
    if arch == "gemma2":
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        if rope["full_attention"].get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["full_attention"]["factor"])
    _add_vocab(w, cfg.vocab_size, spm=True)
    shifted = _ShiftedNorms(hf_model)
    _add_hf_tensors(w, shifted, GEMMA_TO_GGUF, weight_type)
    _finish(w)
    return path


class _ShiftedNorms:
    """The model's state dict as llama.cpp's converter writes Gemma's: norms + 1, the tied LM head left out."""

    def __init__(self, hf_model):
        self.hf_model = hf_model

    def state_dict(self) -> dict:
        return {name: t + 1 if name.endswith("norm.weight") else t
                for name, t in self.hf_model.state_dict().items() if name != "lm_head.weight"}


def _add_moe_metadata(w, cfg, experts: int, width: int | None) -> None:
    """What every MoE file's metadata says of attention and the experts: head_dim, the norm's epsilon, the expert
    count, top-k and (`width`; None: Mixtral's, as wide as `feed_forward_length`) an expert's width."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if width is not None:
        w.add_expert_feed_forward_length(width)


def write_moe_gguf(hf_model, path: Path, weight_type: T = T.F32) -> Path:
    """A Qwen3-MoE ("qwen3moe"), Qwen2-MoE ("qwen2moe") or Mixtral ("llama" with experts) GGUF as llama.cpp's
    converter writes one: each layer's experts stacked per projection (`ffn_gate_exps`, `ffn_up_exps`,
    `ffn_down_exps`, [experts, out, in]), the router in `ffn_gate_inp`, a shared expert's tensors `*_shexp`, the
    experts' count, top-k and widths in the metadata; q/k rows permuted for the llama architecture only."""
    cfg = hf_model.config
    arch = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}[cfg.model_type]
    w = _writer(path, arch, cfg)
    _add_moe_metadata(w, cfg, cfg.num_local_experts if arch == "llama" else cfg.num_experts,
                      None if arch == "llama" else cfg.moe_intermediate_size)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if getattr(cfg, "sliding_window", None):  # the tiny Mixtral's (real Mixtral configs have none)
        w.add_sliding_window(cfg.sliding_window)
    _add_vocab(w, cfg.vocab_size, spm=True)  # llama.cpp loads no BPE vocabulary without merges
    names = {**HF_TO_GGUF, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
             "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
             "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
    heads = {"self_attn.q_proj": cfg.num_attention_heads, "self_attn.k_proj": cfg.num_key_value_heads}
    for name, tensor in hf_model.state_dict().items():
        a = tensor.numpy().astype(np.float32)
        parts = name.split(".")
        kind = parts[-1] if parts[-1] in ("weight", "bias") else "weight"
        if parts[1] == "layers":
            module = ".".join(parts[3:-1]) if parts[-1] in ("weight", "bias") else ".".join(parts[3:])
            if module == "mlp.experts.gate_up_proj":  # [experts, 2 * mlp, hidden]: gate rows, then up rows
                f = a.shape[1] // 2
                out = {"ffn_gate_exps": a[:, :f], "ffn_up_exps": a[:, f:]}
            elif module == "mlp.experts.down_proj":
                out = {"ffn_down_exps": a}
            else:
                if arch == "llama" and module in heads:
                    a = permute(a, heads[module])
                out = {names[module]: a}
            out = {f"blk.{parts[2]}.{k}.{kind}": v for k, v in out.items()}
        else:
            out = {{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight"}[name]: a}
        for gname, v in out.items():
            if v.ndim >= 2 and weight_type != T.F32 and "ffn_gate_inp" not in gname:
                w.add_tensor(gname, quants.quantize(np.ascontiguousarray(v), weight_type), raw_dtype=weight_type)
            else:
                w.add_tensor(gname, np.ascontiguousarray(v))
    _finish(w)
    return path


def write_gpt_oss_gguf(hf_model, path: Path, expert_type: T = T.F32) -> Path:
    """A "gpt-oss" GGUF as llama.cpp's converter writes one: each layer's experts split per projection and
    transposed to [experts, out, in] (gate and up from the interleaved columns of `gate_up_proj`), each with its
    bias, the router in `ffn_gate_inp`, the sinks in `attn_sinks`, the second norm in `post_attention_norm`, the
    window and YaRN in the metadata (no SwiGLU limit: llama.cpp fixes it at 7.0). `expert_type` MXFP4: the experts'
    weights in GGML's MXFP4 blocks (the released models' type), the rest float32."""
    cfg = hf_model.config
    w = _writer(path, "gpt-oss", cfg)
    _add_moe_metadata(w, cfg, cfg.num_local_experts, cfg.intermediate_size)
    w.add_sliding_window(cfg.sliding_window)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    _add_vocab(w, cfg.vocab_size, spm=True)
    names = {**HF_TO_GGUF, "post_attention_layernorm": "post_attention_norm", "mlp.router": "ffn_gate_inp"}
    for name, tensor in hf_model.state_dict().items():
        a = tensor.float().numpy()
        parts = name.split(".")
        if parts[1] != "layers":
            out = {{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight"}[name]: a}
        else:
            blk = f"blk.{parts[2]}"
            module = ".".join(parts[3:])
            if module == "self_attn.sinks":
                out = {f"{blk}.attn_sinks.weight": a}
            elif module == "mlp.experts.gate_up_proj":  # [experts, in, 2 * mlp], gate and up columns interleaved
                t = np.swapaxes(a, -1, -2)
                out = {f"{blk}.ffn_gate_exps.weight": t[:, 0::2], f"{blk}.ffn_up_exps.weight": t[:, 1::2]}
            elif module == "mlp.experts.gate_up_proj_bias":
                out = {f"{blk}.ffn_gate_exps.bias": a[:, 0::2], f"{blk}.ffn_up_exps.bias": a[:, 1::2]}
            elif module == "mlp.experts.down_proj":  # [experts, mlp, hidden]
                out = {f"{blk}.ffn_down_exps.weight": np.swapaxes(a, -1, -2)}
            elif module == "mlp.experts.down_proj_bias":
                out = {f"{blk}.ffn_down_exps.bias": a}
            else:
                out = {f"{blk}.{names[module.rpartition('.')[0]]}.{parts[-1]}": a}
        for gname, v in out.items():
            v = np.ascontiguousarray(v, np.float32)
            if expert_type != T.F32 and "_exps.weight" in gname:
                w.add_tensor(gname, quants.quantize(v, expert_type), raw_dtype=expert_type)
            else:
                w.add_tensor(gname, v)
    _finish(w)
    return path
