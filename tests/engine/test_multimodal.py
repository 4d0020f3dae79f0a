"""Vision-language requests on the engine (tiny random Qwen2.5-VL, and Qwen3-VL for parity): log-probabilities
against transformers through the paged path with chunked prefill cutting through images, the encoder cache, the
prefix cache keyed by image content, batch invariance and no compilation after warm-up, and refused inputs."""

import numpy as np
import pytest
from PIL import Image

from jaxllm import LLM
from jaxllm.engine import compile_monitor
from jaxllm.errors import InvalidRequestError
from jaxllm.sampling_params import MAX_LOGPROBS, SamplingParams

pytestmark = pytest.mark.slow  # vision-language engines

IMAGE = 1000
BUDGET = 32  # tokens a step, and image tokens encoded a step: images of up to 32 tokens, prompts in chunks
OPTIONS = dict(dtype="float32", max_num_batched_tokens=BUDGET, max_num_seqs=8, num_pages=160, page_size=8,
               max_model_len=320)
SIZES = [(112, 84), (60, 120), (200, 150), (90, 90), (150, 40)]  # width, height


def _image(i: int) -> Image.Image:
    w, h = SIZES[i % len(SIZES)]
    return Image.fromarray(np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _prompt(tok, num_images: int, text: str = "Describe the pictures, please.") -> list[int]:
    """Text, then each image's placeholder with text around it (one image-pad token per image, as templates
    write it)."""
    ids = tok.encode(text)
    for k in range(num_images):
        ids += [1002, IMAGE, 1003] + tok.encode(f" and the {k} one")
    return ids + tok.encode(" Answer:")


@pytest.fixture(scope="module")
def llm(tiny_vl_dir, compile_cache_dir):
    folder, _ = tiny_vl_dir
    return LLM(str(folder), compilation_cache_dir=compile_cache_dir, **OPTIONS)


@pytest.fixture(scope="module")
def llm3(tiny_qwen3_vl_dir, compile_cache_dir):
    folder, _ = tiny_qwen3_vl_dir
    return LLM(str(folder), compilation_cache_dir=compile_cache_dir, **OPTIONS)


def _clear_prefix_cache(engine) -> None:
    engine.block_manager.page_of_hash.clear()
    engine.block_manager.hash_of_page.clear()
    engine.block_manager.key_of_page.clear()


def _hf_logprobs(hf, spec, ids: list[int], images: list) -> np.ndarray:
    import torch

    from jaxllm.multimodal.image_processor import preprocess

    kwargs = {}
    if images:
        done = [preprocess(i, spec.processor) for i in images]
        kwargs = dict(pixel_values=torch.tensor(np.concatenate([r for r, _ in done])),
                      image_grid_thw=torch.tensor([g for _, g in done]))
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids]), mm_token_type_ids=torch.tensor([[int(t == IMAGE) for t in ids]]),
                    **kwargs).logits[0]
    return torch.log_softmax(logits.double(), -1).numpy()


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_logprobs_match_transformers_through_chunked_prefill(request, monkeypatch, family, num_images):
    """The first token's log-probabilities (the prompt prefilled in 32-token chunks, one cutting through an
    image's tokens) and the decode steps' (teacher-forced in transformers) within 1e-4."""
    qwen3 = family == "qwen3-vl"
    llm = request.getfixturevalue("llm3" if qwen3 else "llm")
    _, hf = request.getfixturevalue("tiny_qwen3_vl_dir" if qwen3 else "tiny_vl_dir")
    engine = llm.engine
    _clear_prefix_cache(engine)
    images = [_image(2 + k) for k in range(num_images)]
    cuts, ahead = [], []
    dispatch = engine.runner.dispatch

    def recording(step, bucket=None, after=None):
        ahead.append(after is not None)
        for seq, n in zip(step.seqs, step.num_new_tokens, strict=True):
            end = seq.num_computed_tokens + n
            if seq.request.mm is not None:
                cuts.extend(im for im in seq.request.mm.images if im.offset < end < im.end)
        return dispatch(step, bucket, after)

    monkeypatch.setattr(engine.runner, "dispatch", recording)
    encoded = engine.runner.encoder_cache.encoded
    engine.runner.encoder_cache.clear()
    (out,) = llm.generate({"prompt_token_ids": _prompt(llm.get_tokenizer(), num_images),
                           "multi_modal_data": {"image": images}},
                          SamplingParams(temperature=0, max_tokens=5, logprobs=MAX_LOGPROBS, ignore_eos=True),
                          use_tqdm=False)
    c = out.outputs[0]
    want = _hf_logprobs(hf, engine.mm_spec, out.prompt_token_ids + c.token_ids[:-1], images)
    n = len(out.prompt_token_ids)
    assert out.prompt_token_ids.count(IMAGE) == sum(im.num_tokens for im in engine.mm_spec.prepare(
        _prompt(llm.get_tokenizer(), num_images), images)[1].images)
    for k, entry in enumerate(c.logprobs):
        row = want[n - 1 + k]
        assert c.token_ids[k] == int(row.argmax())
        assert len(entry) >= MAX_LOGPROBS
        for tid, lp in entry.items():
            assert abs(row[tid] - lp.logprob) < 1e-4, (k, tid)
    assert engine.runner.encoder_cache.encoded - encoded == num_images  # once each, though prefilled in chunks
    assert any(ahead)  # decode steps ran ahead (async scheduling), their M-RoPE positions built one step on
    if num_images:
        assert cuts, "no prefill chunk ended inside an image"


def test_chat_with_image_parts_equals_generate(llm, tiny_vl_dir):
    """LLM.chat with image_url (data: URL) and image_pil parts == generate with the template's prompt."""
    import base64
    import io

    images = [_image(0), _image(1)]
    buf = io.BytesIO()
    images[0].save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (chat,) = llm.chat([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "and"},
        {"type": "image_pil", "image_pil": images[1]}, {"type": "text", "text": "what are they?"}]}], params,
        use_tqdm=False)
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                                                 {"type": "image"},
                                                                 {"type": "text", "text": "what are they?"}]}])
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    (gen,) = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, params, use_tqdm=False)
    assert chat.prompt_token_ids == gen.prompt_token_ids
    assert chat.outputs[0].token_ids == gen.outputs[0].token_ids


def test_prefix_cache_keyed_by_image_content(llm):
    """The same image again reuses its pages (and its encoding); a different image behind identical text shares
    only the pages before the image, and its output is the one computed with no cache at all."""
    engine = llm.engine
    tok = llm.get_tokenizer()
    ids = _prompt(tok, 1, "A long shared instruction that fills a few pages before the picture comes.")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a, b = _image(3), _image(4)

    def run(image):
        (out,) = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [image]}}, params,
                              use_tqdm=False)
        return out

    _clear_prefix_cache(engine)
    cache = engine.runner.encoder_cache
    cache.clear()
    first = run(a)
    offset = first.prompt_token_ids.index(IMAGE)
    page = engine.config.page_size
    assert first.num_cached_tokens == 0
    encoded = cache.encoded
    again = run(a)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # every full page, the image's included, is a hit (one token is always computed)
    assert again.num_cached_tokens == (len(first.prompt_token_ids) - 1) // page * page > offset
    other = run(b)
    assert other.num_cached_tokens == offset // page * page  # the text before the image only
    assert cache.encoded == encoded + 1  # b; a's second run read no image embeddings (or the encoder cache)
    _clear_prefix_cache(engine)
    cache.clear()
    assert run(b).outputs[0].token_ids == other.outputs[0].token_ids
    bm = engine.block_manager
    assert bm.num_free_pages == bm.num_pages


def test_mixed_text_and_image_batch_is_invariant_and_compiles_nothing(llm):
    """Text and image requests (0-2 images of different sizes) arriving while others run: each output equals the
    request run alone; no compilation after warm-up (images of any size share the encoder's buckets); every page
    free after."""
    engine = llm.engine
    tok = llm.get_tokenizer()
    requests = []
    for i in range(10):
        k = i % 3
        images = [_image(i + j) for j in range(k)]
        requests.append((f"r{i}", {"prompt_token_ids": _prompt(tok, k, f"Request {i}: tell me more."),
                                   "multi_modal_data": {"image": images}}))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = {}
    for rid, prompt in requests:
        _clear_prefix_cache(engine)
        (out,) = llm.generate(prompt, params, use_tqdm=False)
        alone[rid] = out.outputs[0].token_ids
    _clear_prefix_cache(engine)
    engine.runner.encoder_cache.clear()
    before = compile_monitor.snapshot()
    pending, results = list(requests), {}
    for rid, prompt in pending[:3]:
        engine.add_request(rid, prompt["prompt_token_ids"], params,
                           prepared=engine.prepare_prompt(prompt["prompt_token_ids"], params, None,
                                                          prompt["multi_modal_data"]["image"]))
    pending = pending[3:]
    while engine.has_unfinished_requests() or pending:
        if pending:
            rid, prompt = pending.pop(0)
            engine.add_request(rid, None, params, prepared=engine.prepare_prompt(
                prompt["prompt_token_ids"], params, None, prompt["multi_modal_data"]["image"]))
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    assert compile_monitor.snapshot() == before
    assert results == alone
    bm = engine.block_manager
    assert bm.num_free_pages == bm.num_pages


def test_preempted_image_request_is_not_encoded_again(llm, tiny_vl_dir, compile_cache_dir):
    """With pages for about two requests, four image requests preempt each other: outputs equal those of the
    engine with room for all, and each image is encoded once."""
    folder, _ = tiny_vl_dir
    small = LLM(str(folder), compilation_cache_dir=compile_cache_dir, **{**OPTIONS, "num_pages": 24,
                                                                         "enable_prefix_caching": False})
    tok = small.get_tokenizer()
    prompts = [{"prompt_token_ids": _prompt(tok, 1, f"Number {i}."), "multi_modal_data": {"image": [_image(i)]}}
               for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.runner.encoder_cache.encoded == 4
    want = llm.generate(prompts, params, use_tqdm=False)  # room for all
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]


def test_bad_image_inputs_are_refused(llm, tiny_model_dir, compile_cache_dir):
    engine = llm.engine
    tok = llm.get_tokenizer()
    params = SamplingParams(max_tokens=2)
    too_many = [_image(i) for i in range(engine.mm_spec.max_images + 1)]
    cases = [
        ({"prompt_token_ids": _prompt(tok, len(too_many)), "multi_modal_data": {"image": too_many}}, "at most"),
        ({"prompt_token_ids": _prompt(tok, 2), "multi_modal_data": {"image": [_image(0)]}}, "placeholders"),
        ({"prompt_token_ids": _prompt(tok, 0) + [IMAGE] * 5}, "placeholders"),  # image tokens with no image
        ({"prompt_token_ids": _prompt(tok, 1), "multi_modal_data": {"image": ["not an image"]}}, "PIL"),
        ({"prompt_token_ids": _prompt(tok, 1), "multi_modal_data": {"image": [
            Image.new("RGB", (2000, 4))]}}, "aspect ratio"),
    ]
    for prompt, message in cases:
        with pytest.raises(InvalidRequestError, match=message) as e:
            llm.generate(prompt, params, use_tqdm=False)
        assert e.value.param == "multi_modal_data"
    with pytest.raises(InvalidRequestError, match="could not be decoded"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "data:image/png;base64,aGVsbG8gd29ybGQ="}}]}], params, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="does not fetch remote images"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "http://127.0.0.1:9/cat.png"}}]}], params, use_tqdm=False)
    assert not engine.requests and engine.block_manager.num_free_pages == engine.block_manager.num_pages
    text_only = LLM(str(tiny_model_dir("llama")[0]), compilation_cache_dir=compile_cache_dir, dtype="float32",
                    max_num_batched_tokens=32, max_num_seqs=4, num_pages=32)
    with pytest.raises(InvalidRequestError, match="does not take images"):
        text_only.generate({"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": [_image(0)]}}, params,
                           use_tqdm=False)
