"""The engine-core wire format: outputs of every kind cross it unchanged, every message round-trips and malformed
ones are refused, the secret's proof checks."""

from jaxllm.engine import core_protocol as proto
from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput
from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams


def _out(text, ids, logprobs, finished=False, reason=None):
    return RequestOutput("core-id", None, [1, 2], [
        CompletionOutput(0, text, ids, -0.5 * len(ids), logprobs, reason, None),
        CompletionOutput(1, text.upper(), [i + 100 for i in ids], None, None, reason, "stop!" if reason else None)],
        finished, num_cached_tokens=16)


def _across(out, request_id="client-id", prompt="prompt", prompt_ids=(1, 2)):
    """out -> the wire (inside a step's Outs) -> the output the client's request gets."""
    wire = proto.decode_core(proto.encode(proto.Outs([proto.Out(request_id, proto.output_to_wire(out))])))
    return proto.output_from_wire(wire.items[0].output, request_id, prompt, list(prompt_ids))


def test_outputs_cross_the_wire_unchanged():
    lp = [{5: Logprob(-0.1, 1, "a"), 7: Logprob(-2.0, 2, "b")}, {6: Logprob(-0.2, 1, "c")},
          {9: Logprob(-1.5, 7, "\ufffd")}]
    outputs = [_out("he", [5], lp[:1]),  # cumulative outputs, and deltas (what is new), cross alike
               _out("llo", [6], lp[1:2]), _out("", [], []), _out("help", [5, 6, 9], lp[:3], finished=True,
                                                                   reason="stop")]
    for out in outputs:
        got = _across(out)
        assert got.request_id == "client-id" and got.prompt == "prompt" and got.prompt_token_ids == [1, 2]
        assert got.outputs == out.outputs and got.finished == out.finished and got.num_cached_tokens == 16
        assert got.prompt_logprobs is None and got.error is None


def test_prompt_logprobs_and_errors_cross():
    scored = [None, {7: Logprob(-1.5, 3, "b"), 5: Logprob(-0.2, 1, "a")}]
    out = _out("x", [1], None, finished=True, reason="error")
    out.prompt_logprobs, out.error = scored, "ValueError: boom"
    got = _across(out, "r", "ab", [4, 7])
    assert got.prompt_logprobs == scored and got.error == "ValueError: boom"


def test_sampling_params_round_trip_and_are_validated_again():
    p = SamplingParams(n=2, temperature=0.3, logit_bias={7: -1.0}, stop=("\n",), seed=3,
                       structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    wire = proto.decode_client(proto.encode(proto.Add("r", None, [1, 2], proto.params_to_wire(p))))
    assert proto.params_from_wire(wire.params) == p
    bad = {**proto.params_to_wire(p), "temperature": -1.0}
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
    wire = proto.decode_client(proto.encode(proto.Add("r", "text", [1], proto.params_to_wire(params))))
    back = proto.params_from_wire(wire.params)
    assert back == params and isinstance(back, PoolingParams)
    with pytest.raises(ValueError):  # validated again on the core's side (msgspec wraps the error)
        proto.params_from_wire({"task": "embed", "dimensions": 0})
    vector = np.random.default_rng(0).standard_normal(8).astype(np.float32)
    out = PoolingRequestOutput("r", None, [1, 2, 3], PoolingOutput(vector), True, num_cached_tokens=2)
    got = []
    got.append(_across(out, "r", "text", [1, 2, 3]))
    assert got[0].finished and got[0].num_cached_tokens == 2 and got[0].prompt == "text"
    np.testing.assert_array_equal(got[0].outputs.data, vector)


def _every_message():
    from jaxllm.multimodal.image_processor import ImageProcessorConfig
    from jaxllm.multimodal.inputs import MultiModalSpec
    from jaxllm.sampling_params import RequestLimits

    info = proto.CoreInfo(model_name="m", limits=RequestLimits(50, 128, max_n=4, hidden_size=8,
                                                               tasks=("generate", "embed")),
                          eos_token_ids=(2, 3), score_template="{{ a }}",
                          mm_spec=MultiModalSpec(ImageProcessorConfig(max_pixels=9999), 5, 6, 7, max_images=2),
                          max_num_seqs=4, max_waiting_requests=9, page_size=16, model="/m", revision="r", rank=1,
                          stats={"num_requests": 3})
    lp = proto.WireLogprob(7, -0.5, 1, "a")
    choice = proto.WireChoice(0, "xy", [7, 8], [[lp], [lp]], -1.0, "stop", "\n")
    return [
        proto.Hello(), proto.Auth(b"proof"), proto.Challenge(b"n" * 32), proto.Ready(info), proto.Refused("no"),
        proto.Add("r", "text", [1, 2], proto.params_to_wire(SamplingParams(max_tokens=3)), "salt",
                  [proto.WireImage(b"\0" * 8, (1, 2, 2))]),
        proto.Add("r", None, [1], proto.params_to_wire(SamplingParams())), proto.Abort("r"),
        proto.Outs([proto.Out("r", proto.WireGeneration(True, 16, None, [choice], [None, [lp]])),
                    proto.Out("p", proto.WirePooling(True, 0, "why", b"\0" * 4)),
                    proto.Fail("q", "full", "busy")]),
        proto.Fail("r", "invalid", "bad"), proto.Stats({"num_requests": 1, "kv_cache_usage": 0.5}),
    ]


def test_every_message_round_trips():
    client_side = (proto.Hello, proto.Auth, proto.Add, proto.Abort)
    kinds = set()
    for message in _every_message():
        decode = proto.decode_client if isinstance(message, client_side) else proto.decode_core
        back = decode(proto.encode(message))
        assert back == message and type(back) is type(message)
        kinds.add(type(message))
    every = {proto.Hello, proto.Auth, proto.Challenge, proto.Ready, proto.Refused, proto.Add, proto.Abort,
             proto.Outs, proto.Fail, proto.Stats}
    assert kinds == every  # and every one of them was tried


def test_malformed_messages_are_refused():
    import msgspec
    import pytest

    good = msgspec.msgpack.encode(["add", "r", None, [1, 2], {}])
    assert isinstance(proto.decode_client(good), proto.Add)
    for bad in (["add", 5, None, [1], {}], ["add", "r", None, ["x"], {}], ["nope"], ["abort"], [], {"a": 1},
                ["ready", {}], "hello", ["outs", [["out", "r", ["gen", True]]]]):
        with pytest.raises(msgspec.ValidationError):
            proto.decode_client(msgspec.msgpack.encode(bad))
    with pytest.raises(msgspec.DecodeError):
        proto.decode_client(b"\xc1 not msgpack")
    with pytest.raises(msgspec.ValidationError):  # a core message is not a client message
        proto.decode_client(proto.encode(proto.Stats({})))
