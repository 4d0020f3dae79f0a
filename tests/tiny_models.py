"""Tiny random Hugging Face models of every supported architecture, built locally with transformers+torch."""

from __future__ import annotations

from pathlib import Path

COMMON = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

ARCHITECTURE_CASES = {
    "llama": ("LlamaConfig", dict(rope_theta=10000.0)),
    "llama_tied_smollm": ("LlamaConfig", dict(tie_word_embeddings=True, rope_theta=100000.0)),
    "llama3_rope": ("LlamaConfig", dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "llama_linear_rope": ("LlamaConfig", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama_yarn_rope": ("LlamaConfig", dict(rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", dict(sliding_window=6, head_dim=16)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(head_dim=24, tie_word_embeddings=False)),
    # fused qkv/gate_up checkpoint tensors, half of each head rotating, a window shorter than the prompts
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.5, sliding_window=6, pad_token_id=0, bos_token_id=1,
                                eos_token_id=2, tie_word_embeddings=False)),
    # Phi-3 128k's LongRoPE: per-frequency factors for contexts up to 32 tokens (short) and beyond (long), cos/sin
    # scaled by sqrt(1 + ln 8 / ln 32)
    "phi3_longrope": ("Phi3Config", dict(partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                         tie_word_embeddings=False, original_max_position_embeddings=32,
                                         rope_scaling={"type": "longrope", "short_factor": [1.0, 1.3, 2.2, 3.9],
                                                       "long_factor": [1.5, 4.0, 11.0, 30.0]})),
    # Gemma 2: windowed and global layers alternating, a window shorter than the prompts, soft caps low enough to
    # bend scores and logits, an attention scale that is not head_dim's
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=6, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=5.0, num_hidden_layers=3)),
    # Gemma 3: q/k norms, a layer pattern of its own, linear scaling on the global layers' RoPE, a small base on the
    # windowed layers'
    "gemma3": ("Gemma3TextConfig", dict(
        head_dim=16, sliding_window=6, query_pre_attn_scalar=24, num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
    # Mixtures of experts: 8 experts, 2 (Mixtral, Qwen2-MoE) or 3 per token, renormalised or not, a shared expert
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=64,
                                         norm_topk_prob=True, tie_word_embeddings=False)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                         shared_expert_intermediate_size=96, tie_word_embeddings=False)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=6)),
    # GPT-OSS: attention sinks, biases everywhere, windowed and global layers alternating with a window shorter
    # than the prompts, YaRN RoPE, 8 experts with 3 a token and a SwiGLU limit low enough to clamp
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=3,
                                     sliding_window=6, num_hidden_layers=3, swiglu_limit=0.7,
                                     layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                      "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0,
                                                      "original_max_position_embeddings": 64},
                                     tie_word_embeddings=False)),
    # 8 heads / 4 KV heads: tensor parallel 2 and 4 divide both.
    "qwen2_tp": ("Qwen2Config", dict(num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)),
}
PARITY_CASES = [c for c in ARCHITECTURE_CASES if c != "qwen2_tp"]


def build_tiny_hf_model(case: str, folder: Path, overrides: dict | None = None):
    """Saves the model as safetensors (split into two shards with an index) and returns (folder, hf_model).
    overrides: config fields over the case's."""
    import torch
    import transformers

    config_cls, extra = ARCHITECTURE_CASES[case]
    torch.manual_seed(sum(map(ord, case)))
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **(overrides or {})})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # the default 0.02 init gives near-uniform logits; make them discriminative
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(folder, max_shard_size="200KB")
    return folder, model


CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOKENIZER_CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "Write two sentences about the sea, a city and a forest.",
    "What is the capital of France? Paris is the capital of France.", "Count slowly: one, two, three, four.",
    "Tell a long story about a robot who learns music in a library while rain falls on the moon.",
    "0123456789 !?.,;:'\"()[]{}<>/\\|@#$%^&*-_+=~`",
]


# Qwen2-VL's chat template, as its tokenizer_config.json has it (without the video and vision-id branches)
QWEN_VL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content or "
    "'image_url' in content %}<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VL_SPECIAL_TOKENS = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]  # ids 1000..1003


def add_tiny_tokenizer(folder: Path, vocab_size: int = 1000, vision: bool = False) -> None:
    """A byte-level BPE tokenizer trained on a few sentences (every id below the tiny models' 1024 vocabulary)
    with ChatML special tokens and chat template, so a tiny model serves chat and text prompts like a real one.
    vision: plus Qwen-VL's image tokens (ids 1000..1003) and chat template."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                         "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TOKENIZER_CORPUS * 20, trainer)
    if vision:  # reserved tokens up to 1000, then the image tokens
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab_size - tok.get_vocab_size())])
        tok.add_special_tokens(VL_SPECIAL_TOKENS)
        assert tok.token_to_id(VL_SPECIAL_TOKENS[0]) == vocab_size
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>",
        "chat_template": QWEN_VL_TEMPLATE if vision else CHATML_TEMPLATE}))


ST_POOLING_MODES = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens",
                    "cls": "pooling_mode_cls_token"}


def add_sentence_transformers_files(folder: Path, pooling: str, normalize: bool = True, max_seq_length: int = 256,
                                    pad_token: str = "<|endoftext|>") -> None:
    """Makes a model folder a sentence-transformers model: its modules (Transformer, Pooling, maybe Normalize) and
    the pooling config jaxllm reads; the tokenizer gets a pad token (sentence-transformers pads batches)."""
    import json

    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, **{mode: key == pooling for key, mode in ST_POOLING_MODES.items()}}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                  "do_lower_case": False}))
    config_path = folder / "tokenizer_config.json"
    if config_path.exists():
        config = json.loads(config_path.read_text())
        config["pad_token"] = pad_token
        # tokenizer.json as it is: for a Qwen3 folder transformers would otherwise build Qwen2's own pre-tokenizer
        # (digits split one by one), which the tiny tokenizer was not trained with
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        config_path.write_text(json.dumps(config))


ENCODER_COMMON = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=160)


def build_tiny_encoder(folder: Path, family: str = "bert", classifier: bool = False, **config_overrides):
    """A tiny random BERT or XLM-RoBERTa (with a sequence-classification head: a cross-encoder) and a WordPiece
    tokenizer whose template adds [CLS]/[SEP] (pairs: [CLS] a [SEP] b [SEP], token types 0 then 1), saved as
    sentence-transformers and transformers load it. Returns (folder, hf_model)."""
    import json

    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    folder.mkdir(parents=True, exist_ok=True)
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] if family == "bert" else \
        ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    cls_tok, sep_tok, pad_tok, unk_tok = (special[2], special[3], special[0], special[1]) if family == "bert" else \
        (special[0], special[2], special[1], special[3])
    tok = Tokenizer(models.WordPiece(unk_token=unk_tok))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(TOKENIZER_CORPUS * 20, trainers.WordPieceTrainer(
        vocab_size=ENCODER_COMMON["vocab_size"], special_tokens=special, show_progress=False))
    cls_id, sep_id = tok.token_to_id(cls_tok), tok.token_to_id(sep_tok)
    if family == "bert":
        tok.post_processor = processors.TemplateProcessing(
            single=f"{cls_tok} $A {sep_tok}", pair=f"{cls_tok} $A {sep_tok} $B:1 {sep_tok}:1",
            special_tokens=[(cls_tok, cls_id), (sep_tok, sep_id)])
    else:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{cls_tok} $A {sep_tok}", pair=f"{cls_tok} $A {sep_tok} {sep_tok} $B {sep_tok}",
            special_tokens=[(cls_tok, cls_id), (sep_tok, sep_id)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "cls_token": cls_tok, "sep_token": sep_tok,
        "pad_token": pad_tok, "unk_token": unk_tok, "mask_token": special[4], "model_max_length": 512,
        "model_input_names": ["input_ids", "attention_mask"] + (["token_type_ids"] if family == "bert" else [])}))
    torch.manual_seed(7 + classifier)
    if family == "bert":
        config = transformers.BertConfig(**{**ENCODER_COMMON, **config_overrides}, type_vocab_size=2, pad_token_id=0)
        head_cls, base_cls = transformers.BertForSequenceClassification, transformers.BertModel
    else:
        config = transformers.XLMRobertaConfig(**{**ENCODER_COMMON, "max_position_embeddings": 162,
                                                  **config_overrides},
                                               type_vocab_size=1, pad_token_id=tok.token_to_id(pad_tok),
                                               bos_token_id=cls_id, eos_token_id=sep_id)
        head_cls, base_cls = transformers.XLMRobertaForSequenceClassification, transformers.XLMRobertaModel
    if classifier:
        config.num_labels = 1
    model = (head_cls if classifier else base_cls)(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            else:
                p.add_(torch.randn_like(p) * 0.05)
    model.eval()
    model.save_pretrained(folder)
    return folder, model


def build_tiny_qwen2_5_vl(folder: Path, flat_config: bool = False, family: str = "qwen2_5_vl"):
    """A tiny random Qwen2.5-VL (2 text layers with M-RoPE sections (2, 3, 3); a 2-block vision encoder, one of
    them full attention) or Qwen3-VL (`family="qwen3_vl"`: 3 Qwen3 layers, interleaved M-RoPE; a 3-block vision
    encoder with 16-pixel patches, an 8 x 8 position table and DeepStack taps after blocks 0 and 1) saved by
    transformers, with a tokenizer (Qwen-VL chat template) and a small preprocessor pixel budget; `flat_config`
    rewrites a Qwen2.5-VL config.json in the flat layout most published folders use (text fields at the top,
    ``rope_scaling: {type: mrope}``). Returns (folder, hf_model); image-pad / vision-start / vision-end token ids
    1000 / 1002 / 1003."""
    import json

    import torch
    import transformers

    ids = dict(image_token_id=1000, video_token_id=1001, vision_start_token_id=1002, vision_end_token_id=1003)
    qwen3 = family == "qwen3_vl"
    if qwen3:
        config = transformers.Qwen3VLConfig(
            text_config=dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                             rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                              "mrope_interleaved": True, "rope_theta": 10000.0}),
            vision_config=dict(depth=3, hidden_size=32, num_heads=4, intermediate_size=64, out_hidden_size=64,
                               patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0, 1]), **ids)
        model_class = transformers.Qwen3VLForConditionalGeneration
    else:
        config = transformers.Qwen2_5_VLConfig(
            text_config=dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                              "rope_theta": 10000.0}),
            vision_config=dict(depth=2, hidden_size=32, num_heads=4, intermediate_size=64, out_hidden_size=64,
                               fullatt_block_indexes=[1]), bos_token_id=None, eos_token_id=None, **ids)
        model_class = transformers.Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(3)
    model = model_class(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08)
    model.save_pretrained(folder)
    add_tiny_tokenizer(folder, vision=True)
    factor = 32 if qwen3 else 28
    (folder / "preprocessor_config.json").write_text(json.dumps({  # small images: a few dozen tokens each
        "image_processor_type": "Qwen2VLImageProcessor", "min_pixels": factor * factor * 4,
        "max_pixels": factor * factor * 48, "patch_size": factor // 2, "temporal_patch_size": 2, "merge_size": 2,
        **({"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if qwen3 else {})}))
    if flat_config:
        raw = json.loads((folder / "config.json").read_text())
        text = raw.pop("text_config")
        rope = text.pop("rope_parameters")
        raw.update(text, rope_theta=rope["rope_theta"], model_type="qwen2_5_vl",
                   rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
        (folder / "config.json").write_text(json.dumps(raw))
    return folder, model


def build_tiny_eagle3_head(folder: Path, target_config: dict, *, aux_layers: list[int] | None = None,
                           draft_vocab: int | None = None, d2t=None, seed: int = 0, own_embeddings: bool = False,
                           prefix: str = "midlayer.", std: float = 0.08) -> dict:
    """A random EAGLE-3 head for a target of `target_config` (config.json's fields), saved as vLLM and sglang load
    one (config.json with `draft_vocab_size` and `eagle_config`, model.safetensors with fc, `prefix` + the layer,
    norm, lm_head, d2t, t2d; the target's embeddings shared unless `own_embeddings`). Returns the torch tensors."""
    import json

    import numpy as np
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    e, heads, kv = target_config["hidden_size"], target_config["num_attention_heads"], \
        target_config["num_key_value_heads"]
    d, f, vocab = target_config.get("head_dim") or e // heads, target_config["intermediate_size"], \
        target_config["vocab_size"]
    rows = draft_vocab or vocab

    def r(*shape, s=std):
        return torch.randn(*shape, generator=g) * s

    p = prefix
    tensors = {
        "fc.weight": r(e, len(aux_layers or [0, 0, 0]) * e), p + "input_layernorm.weight": 1 + r(e, s=0.1),
        p + "hidden_norm.weight": 1 + r(e, s=0.1), p + "self_attn.q_proj.weight": r(heads * d, 2 * e),
        p + "self_attn.k_proj.weight": r(kv * d, 2 * e), p + "self_attn.v_proj.weight": r(kv * d, 2 * e),
        p + "self_attn.o_proj.weight": r(e, heads * d), p + "post_attention_layernorm.weight": 1 + r(e, s=0.1),
        p + "mlp.gate_proj.weight": r(f, e), p + "mlp.up_proj.weight": r(f, e), p + "mlp.down_proj.weight": r(e, f),
        "norm.weight": 1 + r(e, s=0.1), "lm_head.weight": r(rows, e),
        "d2t": torch.as_tensor(np.zeros(rows, np.int64) if d2t is None else np.asarray(d2t, np.int64)),
        "t2d": torch.zeros(vocab, dtype=torch.bool)}
    if own_embeddings:
        tensors["embed_tokens.weight"] = r(vocab, e)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    config = {k: target_config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                            "intermediate_size", "vocab_size", "rms_norm_eps",
                                            "max_position_embeddings", "rope_theta", "head_dim")
              if k in target_config}
    config |= dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                   draft_vocab_size=rows, hidden_act="silu", tie_word_embeddings=False)
    if aux_layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers, "use_aux_hidden_state": True}
    (folder / "config.json").write_text(json.dumps(config))
    return tensors
