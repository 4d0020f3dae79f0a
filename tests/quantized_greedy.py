"""What "greedy output equal within quantization" means in the GGUF tests: an engine serving a quantized file
generates greedily, and at every step its token is the float reference's top token after the same prefix, or
within the quantization's rounding of it."""

from __future__ import annotations

import numpy as np


def assert_greedy_within(llm, reference, prompts: list[list[int]], *, tokens: int = 8, margin: float = 0.1,
                         exact_share: float = 0.75, lora_request=None) -> None:
    """reference: a transformers model (float32). Each token's reference logit is at most `margin` below the
    reference's top logit at that step (Q8_0 of weights of std 0.08: errors ~0.05 on logits of ~2), and at least
    `exact_share` of the tokens are the reference's top token (near-ties are few)."""
    import torch

    from jaxllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora_request)
    exact = 0
    for prompt, out in zip(prompts, outs, strict=True):
        got = list(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + got])).logits[0, len(prompt) - 1:-1].numpy()  # [tokens, V]
        chosen = logits[np.arange(len(got)), got]
        assert np.all(chosen >= logits.max(axis=-1) - margin), (chosen, logits.max(axis=-1))
        exact += int(np.sum(np.argmax(logits, axis=-1) == got))
    assert exact >= exact_share * tokens * len(prompts), exact
