"""The engine-core wire format: deltas rebuild the exact cumulative outputs, messages round-trip, the secret's
proof checks."""

from jaxllm.engine import core_protocol as proto
from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput
from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams


def _out(text, ids, logprobs, finished=False, reason=None):
    return RequestOutput("core-id", None, [1, 2], [
        CompletionOutput(0, text, ids, -0.5 * len(ids), logprobs, reason, None),
        CompletionOutput(1, text.upper(), [i + 100 for i in ids], None, None, reason, "stop!" if reason else None)],
        finished, num_cached_tokens=16)


def test_deltas_rebuild_every_cumulative_output():
    lp = [{5: Logprob(-0.1, 1, "a"), 7: Logprob(-2.0, 2, "b")}, {6: Logprob(-0.2, 1, "c")},
          {9: Logprob(-1.5, 7, "\ufffd")}]
    outputs = [_out("he", [5], lp[:1]), _out("hello", [5, 6], lp[:2]),
               _out("help", [5, 6, 9], lp[:3]),  # not a prefix extension: the text was rewritten
               _out("help", [5, 6, 9], lp[:3], finished=True, reason="stop")]
    deltas, got = proto.OutputDeltas(), []
    assembler = proto.OutputAssembler("client-id", "prompt", [1, 2], got.append)
    for out in outputs:
        wire = proto.decode(proto.encode("out", "client-id", deltas.delta(out)))
        assembler.apply(wire[2])
    assert len(got) == len(outputs)
    for mine, theirs in zip(got, outputs, strict=True):
        assert mine.request_id == "client-id" and mine.prompt == "prompt" and mine.prompt_token_ids == [1, 2]
        assert mine.outputs == theirs.outputs and mine.finished == theirs.finished
        assert mine.num_cached_tokens == 16
    assert got[0].outputs[0].token_ids is not got[1].outputs[0].token_ids  # earlier outputs never change


def test_a_delta_carries_only_what_is_new():
    deltas = proto.OutputDeltas()
    deltas.delta(_out("x" * 1000, list(range(500)), None))
    _, _, _, choices, prompt = deltas.delta(_out("x" * 1001, list(range(501)), None))
    index, keep, text, ids, *_ = choices[0]
    assert (index, keep, text, ids) == (0, 1000, "x", [500])
    assert prompt is None  # no prompt logprobs asked for


def test_prompt_logprobs_cross_once():
    scored = [None, {7: Logprob(-1.5, 3, "b"), 5: Logprob(-0.2, 1, "a")}]
    deltas = proto.OutputDeltas()
    got = []
    client = proto.OutputAssembler("r", "ab", [4, 7], got.append)
    for text, ids in (("x", [1]), ("xy", [1, 2])):
        out = _out(text, ids, None)
        out.prompt_logprobs = scored
        delta = proto.decode(proto.encode("out", "r", deltas.delta(out)))[2]
        assert (delta[4] is not None) == (text == "x")  # sent with the first output only
        client.apply(delta)
    assert got[0].prompt_logprobs == got[1].prompt_logprobs == scored


def test_sampling_params_round_trip_and_are_validated_again():
    p = SamplingParams(n=2, temperature=0.3, logit_bias={7: -1.0}, stop=("\n",), seed=3,
                       structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    wire = proto.decode(proto.encode("add", "r", None, [1, 2], p, None))
    assert proto.params_from_wire(wire[4]) == p
    bad = {**proto.decode(proto.encode("p", p))[1], "temperature": -1.0}
    try:
        proto.params_from_wire(bad)
    except ValueError:
        pass
    else:
        raise AssertionError("a negative temperature passed")


def test_proof_of_the_secret():
    nonce = proto.new_nonce()
    assert proto.verify("s3cret", nonce, proto.prove("s3cret", nonce))
    assert not proto.verify("s3cret", nonce, proto.prove("other", nonce))
    assert not proto.verify("s3cret", proto.new_nonce(), proto.prove("s3cret", nonce))
    assert not proto.verify("s3cret", nonce, "not bytes")


def test_pooling_params_and_outputs_cross_the_wire():
    import numpy as np
    import pytest

    from jaxllm.outputs import PoolingOutput, PoolingRequestOutput
    from jaxllm.pooling_params import PoolingParams

    params = PoolingParams(dimensions=8, normalize=False, truncate_prompt_tokens=100)
    back = proto.params_from_wire(proto.decode(proto.encode("add", params))[1])
    assert back == params and isinstance(back, PoolingParams)
    with pytest.raises(ValueError):  # validated again on the core's side (msgspec wraps the error)
        proto.params_from_wire({"task": "embed", "dimensions": 0})
    vector = np.random.default_rng(0).standard_normal(8).astype(np.float32)
    out = PoolingRequestOutput("r", None, [1, 2, 3], PoolingOutput(vector), True, num_cached_tokens=2)
    got = []
    delta = proto.decode(proto.encode("out", "r", proto.OutputDeltas().delta(out)))[2]
    proto.OutputAssembler("r", "text", [1, 2, 3], got.append).apply(delta)
    assert got[0].finished and got[0].num_cached_tokens == 2 and got[0].prompt == "text"
    np.testing.assert_array_equal(got[0].outputs.data, vector)
