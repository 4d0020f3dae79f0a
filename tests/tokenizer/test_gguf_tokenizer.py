"""The tokenizer rebuilt from SmolLM2's GGUF metadata against an independent implementation of llama.cpp's
rules for the `smollm` pre-tokenizer: digits split one by one, then the GPT-2 regex, byte-level BPE by
merge rank, special tokens matched in the text first."""

import functools

import pytest
import regex

from jaxllm.loading import load_tokenizer
from jaxllm.loading.gguf_file import GGUFFile

TRICKY = [
    "Hello world",
    "I have 123 apples and 4.56 pears in 2024",
    " 42 leading space before digits, and x=10+20",
    "naïve café, Ünïcödé: 日本語のテキスト, emoji 🙂👍🏽 and ∑∞",
    "  two leading spaces, trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nend",
    "don't you'll I'm we've they'd IT'S",
    "<|im_start|>user\nWhat is 7*8?<|im_end|>\n<|im_start|>assistant\n",
    "code: def f(x):\n    return x**2  # square",
    "",
]

# llama.cpp, LLAMA_VOCAB_PRE_TYPE_SMOLLM: these two expressions, applied in order.
DIGITS = regex.compile(r"\p{N}")
GPT2 = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")


def _byte_to_unicode() -> dict[int, str]:
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class ReferenceTokenizer:
    def __init__(self, meta):
        self.tokens = meta["tokenizer.ggml.tokens"]
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(meta["tokenizer.ggml.merges"])}
        types = meta["tokenizer.ggml.token_type"]
        self.special = sorted((t for t, ty in zip(self.tokens, types, strict=True) if ty == 3), key=len,
                              reverse=True)
        self.b2u = _byte_to_unicode()

    @functools.cache  # noqa: B019 - the reference lives for one test module
    def bpe(self, word: str) -> tuple[int, ...]:
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get(pair, float("inf")), i)
                     for i, pair in enumerate(zip(parts, parts[1:], strict=False))]
            rank, i = min(pairs)
            if rank == float("inf"):
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return tuple(self.ids[p] for p in parts)

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        pattern = "(" + "|".join(map(regex.escape, self.special)) + ")"
        for piece in regex.split(pattern, text):
            if piece in self.ids and piece in self.special:
                out.append(self.ids[piece])
                continue
            for chunk in _split_keep(DIGITS, piece):
                for word in GPT2.findall(chunk):
                    out += self.bpe("".join(self.b2u[b] for b in word.encode("utf-8")))
        return out


def _split_keep(pattern, text):
    """Splits text so that each match of pattern is its own chunk (llama.cpp's regex split)."""
    pos, chunks = 0, []
    for m in pattern.finditer(text):
        if m.start() > pos:
            chunks.append(text[pos:m.start()])
        chunks.append(m.group())
        pos = m.end()
    if pos < len(text):
        chunks.append(text[pos:])
    return chunks


@pytest.fixture(scope="module")
def tokenizers_pair(smollm2_path):
    return load_tokenizer(smollm2_path), ReferenceTokenizer(GGUFFile(smollm2_path).metadata)


@pytest.mark.parametrize("text", TRICKY)
def test_tokenization_matches_llama_cpp_rules(text, tokenizers_pair):
    tok, ref = tokenizers_pair
    assert tok.encode(text) == ref.encode(text)


def test_digits_are_single_tokens_and_text_round_trips(tokenizers_pair):
    tok, _ = tokenizers_pair
    ids = tok.encode(" 2024")
    assert [tok.decode([i]) for i in ids] == [" ", "2", "0", "2", "4"]
    for text in TRICKY:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_special_tokens(tokenizers_pair):
    tok, _ = tokenizers_pair
    assert tok.encode("<|im_start|>")[0] == 1 and tok.eos_token_ids == (2,) and tok.bos_token_id == 1
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"


# A SentencePiece vocabulary ('llama', as Llama 2, Mistral and Phi-3 GGUF files have): byte fallback pieces, then
# pieces whose scores order the merges.
SPM_PIECES = (["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] +
              ["\u2581", "h", "e", "l", "o", "w", "r", "d", "\u2581h", "he", "ll", "llo", "\u2581he", "\u2581hello",
               "\u2581w", "or", "\u2581wor", "\u2581world", "lo"])
# What llama.cpp's llama-server (/tokenize, add_special) returned for these texts on a phi3 GGUF with this
# vocabulary (checked by hand: the suite does not build llama.cpp).
LLAMA_CPP_SPM = {"hello world!": [1, 272, 275, 262, 266, 36], " hello  world": [1, 259, 272, 259, 275, 262, 266],
                 "hello\nworld": [1, 272, 13, 264, 274, 262, 266], "héllo": [1, 267, 198, 172, 270]}


def test_a_sentencepiece_vocabulary_tokenizes_as_llama_cpp(tmp_path):
    import gguf
    import numpy as np

    from jaxllm.tokenizer.gguf_tokenizer import tokenizer_from_gguf

    n = len(SPM_PIECES)
    w = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "phi3")
    w.add_tokenizer_model("llama")
    w.add_token_list(SPM_PIECES)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(n - 259)])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (n - 259))
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_tensor("token_embd.weight", np.zeros((n, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = tokenizer_from_gguf(GGUFFile(tmp_path / "spm.gguf").metadata, "spm.gguf")
    for text, ids in LLAMA_CPP_SPM.items():
        assert tok.encode(text) == ids, text
        assert tok.decode(ids, skip_special_tokens=True) == text, text
