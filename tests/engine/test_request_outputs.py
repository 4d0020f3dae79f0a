"""Outputs of each `RequestOutputKind`: DELTA outputs add up to the cumulative ones (text, tokens, logprobs;
prompt logprobs once) and cost what they carry, so a 4,096-token stream's chunks do not grow with its length;
FINAL_ONLY hands out one output, the whole one."""

import statistics

import pytest

from jaxllm import LLM
from jaxllm.engine import core_protocol as proto
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

LONG = 4096


@pytest.fixture(scope="module")
def engine(tiny_folder, compile_cache_dir):
    llm = LLM(str(tiny_folder), dtype="float32", attn_impl="reference", max_num_seqs=8, max_num_batched_tokens=64,
              num_pages=700, max_model_len=LONG + 64, page_size=16, compilation_cache_dir=compile_cache_dir)
    return llm.engine


def _run(engine, requests: dict[str, SamplingParams], prompt: str = "hello there, how are you") -> dict:
    got: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    for rid, params in requests.items():
        engine.add_request(rid, prompt, params, got[rid].append)
    while engine.has_unfinished_requests():
        engine.step()
    return got


def _joined(deltas: list[RequestOutput]) -> list[CompletionOutput]:
    """The choices the deltas add up to."""
    joined: dict[int, CompletionOutput] = {}
    for out in deltas:
        for c in out.outputs:
            j = joined.setdefault(c.index, CompletionOutput(c.index, "", [], None, None if c.logprobs is None else []))
            j.text += c.text
            j.token_ids = j.token_ids + c.token_ids
            j.logprobs = None if c.logprobs is None else j.logprobs + c.logprobs
            j.cumulative_logprob, j.finish_reason, j.stop_reason = c.cumulative_logprob, c.finish_reason, c.stop_reason
    return [joined[i] for i in sorted(joined)]


def test_deltas_add_up_to_the_cumulative_outputs_and_final_only_is_one(engine):
    base = dict(n=2, temperature=0.9, seed=7, max_tokens=40, logprobs=2, prompt_logprobs=1, stop=("e t",))
    # One run each: the same request in the same steps (rows of float32 XLA dots are not batch invariant)
    got = {kind.name: _run(engine, {kind.name: SamplingParams(**base, output_kind=kind)})[kind.name]
           for kind in RequestOutputKind}
    cumulative, delta, final = got["CUMULATIVE"], got["DELTA"], got["FINAL_ONLY"]
    assert len(cumulative) == len(delta) > 10 and len(final) == 1  # one per step with a token, or one at the end
    whole = cumulative[-1]
    assert whole.finished and final[0].finished and delta[-1].finished
    assert final[0].outputs == whole.outputs and final[0].prompt_logprobs == whole.prompt_logprobs
    assert _joined(delta) == whole.outputs
    for before, after in zip(cumulative, cumulative[1:], strict=False):  # every delta is exactly what was new
        d = delta[cumulative.index(after)]
        for b, a, c in zip(before.outputs, after.outputs, d.outputs, strict=True):
            assert a.text == b.text + c.text and a.token_ids == b.token_ids + c.token_ids
    assert delta[0].prompt_logprobs == whole.prompt_logprobs is not None  # sent once, with the first output
    assert all(out.prompt_logprobs is None for out in delta[1:])


def test_a_long_streams_chunks_do_not_grow_with_its_length(engine):
    params = SamplingParams(max_tokens=LONG, ignore_eos=True, temperature=0.0, logprobs=1,
                            output_kind=RequestOutputKind.DELTA)
    (deltas,) = _run(engine, {"long": params}).values()
    assert sum(len(out.outputs[0].token_ids) for out in deltas) == LONG
    # What each output carries (its tokens and their logprobs; its text may come in bursts, when a run of tokens
    # completed a character) and costs on the engine-core wire.
    assert max(len(c.token_ids) + len(c.logprobs) for out in deltas for c in out.outputs) == 2  # wherever it is
    wire = [len(proto.encode(proto.Out("long", proto.output_to_wire(out)))) for out in deltas]
    head, tail = wire[:256], wire[-256:]
    assert statistics.median(tail) <= 2 * statistics.median(head), (statistics.median(head),
                                                                     statistics.median(tail))
    # The same stream as cumulative outputs: its last chunk would carry the whole of it.
    (c,) = _joined(deltas)
    last = RequestOutput("long", None, [], [c], True)
    assert len(proto.encode(proto.Out("long", proto.output_to_wire(last)))) > 100 * statistics.median(tail)
