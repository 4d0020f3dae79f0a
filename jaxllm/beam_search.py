"""Beam search, as vLLM's `LLM.beam_search` runs it: each step asks the engine for one token of every live beam
with its top 2 x beam_width log probabilities (a batch of ordinary requests, whose shared prefixes the prefix cache
serves), extends each beam by each of them, and keeps the `beam_width` best by length-penalized cumulative log
probability; a beam that ends in EOS is set aside as complete. The answer per prompt: the best `beam_width` of the
complete and the live beams."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jaxllm.outputs import Logprob
from jaxllm.sampling_params import MAX_LOGPROBS, SamplingParams, check_float, check_int

if TYPE_CHECKING:
    from jaxllm.llm import LLM


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        # the top 2 x beam_width logprobs of a step are the candidates: the engine returns at most MAX_LOGPROBS
        check_int("beam_width", self.beam_width, 1, MAX_LOGPROBS // 2)
        check_int("max_tokens", self.max_tokens, 1, 1 << 20)
        check_float("temperature", self.temperature, 0, 2)
        check_float("length_penalty", self.length_penalty, -10, 10)


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam: the prompt's tokens then the generated ones (vLLM's layout), a {token: Logprob} per generated
    token, and the text of all its tokens."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (it ended in EOS) or "length"
    stop_reason: int | None = None  # the EOS token that ended it


@dataclasses.dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


def beam_score(tokens: list[int], cum_logprob: float, eos_token_ids: Sequence[int], length_penalty: float) -> float:
    """Cumulative log probability over length ** length_penalty (a final EOS not counted), as vLLM scores beams."""
    length = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    return cum_logprob / (length ** length_penalty)


def beam_search(llm: LLM, prompts: Sequence[str | dict[str, Any]], params: BeamSearchParams,
                use_tqdm: bool = False) -> list[BeamSearchOutput]:
    engine = llm.engine
    if engine.tokenizer is None:
        raise ValueError("beam search needs a tokenizer (its texts)")
    eos = set(engine.eos_token_ids)
    step = SamplingParams(n=1, max_tokens=1, temperature=params.temperature, logprobs=2 * params.beam_width,
                          ignore_eos=True)
    salts, live, done = [], [], []
    for prompt in prompts:
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        source = prompt if isinstance(prompt, str) else prompt.get("prompt_token_ids", prompt.get("prompt"))
        ids = list(engine.prepare_prompt(source, step, salt)[1])
        salts.append(salt)
        live.append([BeamSearchSequence(ids, [])])
        done.append([])

    def key(beam: BeamSearchSequence) -> float:
        return beam_score(beam.tokens, beam.cum_logprob, eos, params.length_penalty)

    for _ in range(params.max_tokens):
        batch = []
        for i, beams in enumerate(live):
            for beam in beams:
                if len(beam.tokens) < engine.max_model_len:
                    batch.append((i, beam))
                else:  # the context is full: it can only end here
                    beam.finish_reason = "length"
                    done[i].append(beam)
        if not batch:
            break
        outs = llm.generate([{"prompt_token_ids": b.tokens, **({"cache_salt": salts[i]} if salts[i] else {})}
                             for i, b in batch], step, use_tqdm=use_tqdm)
        grown: list[list[BeamSearchSequence]] = [[] for _ in live]
        for (i, beam), out in zip(batch, outs, strict=True):
            for token, lp in out.outputs[0].logprobs[0].items():
                new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [out.outputs[0].logprobs[0]],
                                         beam.cum_logprob + lp.logprob)
                if token in eos and not params.ignore_eos:
                    new.finish_reason, new.stop_reason = "stop", token
                    done[i].append(new)
                else:
                    grown[i].append(new)
        live = [sorted(g, key=key, reverse=True)[:params.beam_width] for g in grown]
    results = []
    for beams, finished in zip(live, done, strict=True):
        for beam in beams:
            beam.finish_reason = "length"
        best = sorted(finished + beams, key=key, reverse=True)[:params.beam_width]
        for beam in best:
            shown = beam.tokens if params.include_stop_str_in_output or beam.stop_reason is None else beam.tokens[:-1]
            beam.text = engine.tokenizer.decode(shown)
        results.append(BeamSearchOutput(best))
    return results
