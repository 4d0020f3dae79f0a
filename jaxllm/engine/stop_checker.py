"""When a sequence stops after a new token: vLLM's rules, in its order (a grammar's end, EOS, stop token ids, stop
strings, then length)."""

from __future__ import annotations

from jaxllm.engine.sequence import Sequence


def stops_by_id(seq: Sequence, tokens: list[int], eos_token_ids: tuple[int, ...]) -> bool:
    """Whether one of `tokens` would end `seq` by its id alone (EOS unless ignored, a stop token), min_tokens
    aside (a sequence that drafts is past it: `Drafter._may_draft`)."""
    p = seq.params
    return any(t in p.stop_token_ids or (not p.ignore_eos and t in eos_token_ids) for t in tokens)


def check_stop(seq: Sequence, token: int, stop_str: str | None, eos_token_ids: tuple[int, ...],
               max_model_len: int) -> tuple[str, int | str | None] | None:
    """(finish_reason, stop_reason) once `token` (already appended, and fed to the detokenizer, which found
    `stop_str`) ends `seq`; None while it goes on. Advances a constrained sequence's grammar by the token."""
    p = seq.params
    done = seq.num_output_tokens >= p.min_tokens
    if seq.matcher is not None:
        if not seq.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused a token its own mask allowed: {seq.matcher.get_error()}")
        if seq.matcher.is_stopped():  # the grammar is complete (or EOS ended it): nothing more may follow
            return "stop", None
    if done and not p.ignore_eos and token in eos_token_ids:
        return "stop", None
    if done and token in p.stop_token_ids:
        return "stop", token
    if done and stop_str is not None:
        return "stop", stop_str
    if (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or seq.num_tokens >= max_model_len:
        return "length", None
    return None
