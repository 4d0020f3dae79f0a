"""A step's inputs, padded to its bucket: what the step executable takes besides the weights and the KV cache."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxllm.attention_metadata import AttentionMetadata
from jaxllm.engine import prompt_logprobs
from jaxllm.engine.sampler import SamplingTensors
from jaxllm.engine.sampling_inputs import SamplingInputs
from jaxllm.engine.scheduler import ScheduledStep
from jaxllm.engine.sequence import Sequence


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    ids: jax.Array  # [T] i32 (a step dispatched ahead: the previous step's tokens, on the device)
    positions: jax.Array  # [T] i32; [3, T] with M-RoPE
    meta: AttentionMetadata
    # [S, K] i32: each sequence's rows that get a token: K sample positions (1 + its speculative tokens; a plain
    # step samples one, after the last token of a chunk that reaches the sequence's end)
    logit_rows: jax.Array
    sampling: SamplingTensors
    prompt_targets: jax.Array  # [T] i32: each row's next prompt token to score (-1: none)
    images: jax.Array | None = None  # [levels, T, E]: image embeddings in place of image tokens (VL models)


@dataclasses.dataclass
class BuiltInputs:
    inputs: StepInputs
    rows: list[Sequence]  # the sequences that get a token, in row order
    spans: list[prompt_logprobs.Span]  # the rows that score prompt tokens


class StepInputBuilder:
    def __init__(self, *, buckets: list[tuple[int, int]], page_size: int, max_model_len: int,
                 sampling: SamplingInputs, images: tuple[int, int, object] | None = None, sample_positions: int = 1):
        """images: a vision-language model's (levels, hidden size, dtype) of its image embeddings;
        sample_positions: K, the rows each sequence may sample (1 without speculation)."""
        self.page_size, self.sampling, self.sample_positions = page_size, sampling, sample_positions
        self.max_pages_per_seq = -(-max_model_len // page_size)
        self.mrope = images is not None
        put = jax.device_put
        self.no_prompt_targets = {t: put(np.full(t, -1, np.int32)) for t, _ in buckets}
        self.no_images = {} if images is None else {  # text-only steps pass these: nothing to transfer
            t: put(np.zeros((images[0], t, images[1]), images[2])) for t, _ in buckets}

    @property
    def constants(self) -> dict[str, jax.Array]:
        return self.sampling.constants | {f"prompt_targets/{t}": a for t, a in self.no_prompt_targets.items()}

    def build(self, step: ScheduledStep, bucket: tuple[int, int], embeds: dict[bytes, np.ndarray] | None = None,
              ahead: int = 0) -> BuiltInputs:
        """embeds: a vision-language model's image embeddings by image hash; ahead: tokens each sequence has
        beyond its host state (a step dispatched after one not read back yet; its ids come from the device)."""
        t, s = bucket
        ids = np.zeros(t, np.int32)
        positions = np.zeros((3, t) if self.mrope else t, np.int32)
        images = None
        rows: list[Sequence] = []
        logit_rows = np.zeros((s, self.sample_positions), np.int32)
        at = 0
        for seq, n in zip(step.seqs, step.num_new_tokens, strict=True):
            start = seq.num_computed_tokens + ahead
            if not ahead:
                ids[at:at + n] = seq.token_ids[start:start + n]
            mm = seq.request.mm
            if mm is not None:
                positions[:, at:at + n] = mm.position_rows(start, n)
                for im in mm.images_in(start, start + n):
                    if images is None:
                        images = np.zeros(self.no_images[t].shape, self.no_images[t].dtype)
                    a, b = max(start, im.offset), min(start + n, im.end)
                    images[:, at + a - start:at + b - start] = embeds[im.hash][:, a - im.offset:b - im.offset]
            else:
                positions[..., at:at + n] = np.arange(start, start + n)
            at += n
            if start + n == seq.num_tokens + ahead and seq.pooled is None:  # the chunk reaches the end: sample
                logit_rows[len(rows), :] = at - 1
                rows.append(seq)
        meta = AttentionMetadata.build(
            query_lens=step.num_new_tokens, context_lens=[q.num_computed_tokens + ahead + n for q, n in
                                                          zip(step.seqs, step.num_new_tokens, strict=True)],
            block_tables=[q.block_table for q in step.seqs], page_size=self.page_size, num_tokens=t,
            num_seqs=s, max_pages_per_seq=self.max_pages_per_seq)
        if not ahead and any(q.request.prompt_logprobs is not None for q in step.seqs):
            targets, spans = prompt_logprobs.targets(step.seqs, step.num_new_tokens, t)
        else:  # nothing to score (every decode step): the device-resident constant, no transfer
            targets, spans = self.no_prompt_targets[t], []
        if self.mrope:
            images = self.no_images[t] if images is None else images
        inputs = StepInputs(ids, positions, meta, logit_rows, self.sampling.build(rows, s, ahead), targets, images)
        return BuiltInputs(inputs, rows, spans)
