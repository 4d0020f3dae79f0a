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
class SpecRows:
    """A speculating engine's sample rows, R = min(S * K, T) of them (K = 1 + the drafts a sequence may have): in a
    step with drafts, every drafted sequence samples after its last token and after each draft."""
    rows: jax.Array  # [R] i32: the token row each sample row reads
    seq: jax.Array  # [R] i32: the sequence (sampling row) it samples for
    offset: jax.Array  # [R] i32: its position among that sequence's samples (0: after the last token)
    active: jax.Array  # [] bool: the step has drafts (else the S plain rows are sampled, padded to R)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    ids: jax.Array  # [T] i32 (a step dispatched ahead: the previous step's tokens, on the device)
    positions: jax.Array  # [T] i32; [3, T] with M-RoPE
    meta: AttentionMetadata
    logit_rows: jax.Array  # [S] i32: the token row each sequence that gets a token samples after
    sampling: SamplingTensors
    prompt_targets: jax.Array  # [T] i32: each row's next prompt token to score (-1: none)
    images: jax.Array | None = None  # [levels, T, E]: image embeddings in place of image tokens (VL models)
    spec: SpecRows | None = None  # an engine that speculates: the step's sample rows
    lora: jax.Array | None = None  # [T] i32: an engine with LoRA adapters: each token's adapter slot (-1: none)


@dataclasses.dataclass
class BuiltInputs:
    inputs: StepInputs
    rows: list[Sequence]  # the sequences that get a token, in row order
    spans: list[prompt_logprobs.Span]  # the rows that score prompt tokens
    # a step with drafts: per row of `rows`, its first sample row (of R) and its drafts
    samples: list[tuple[int, list[int]]] | None = None


class StepInputBuilder:
    def __init__(self, *, buckets: list[tuple[int, int]], page_size: int, max_model_len: int,
                 sampling: SamplingInputs, images: tuple[int, int, object] | None = None, sample_positions: int = 1,
                 lora: bool = False):
        """images: a vision-language model's (levels, hidden size, dtype) of its image embeddings;
        sample_positions: K, the rows a sequence may sample in one step (1 + its drafts; 1 without speculation);
        lora: the model has LoRA tables (each step says every token's adapter slot)."""
        self.lora = lora
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
              ahead: int = 0, assumed: list[list[int]] | None = None) -> BuiltInputs:
        """embeds: a vision-language model's image embeddings by image hash; ahead: tokens each sequence has
        beyond its host state (a step dispatched after one not read back yet; its ids come from the device);
        assumed: instead, per sequence, the tokens it has beyond its host state, known to the host (a step
        dispatched on a guess of what the one before it yields: `Drafter.guess`)."""
        t, s = bucket
        ids = np.zeros(t, np.int32)
        positions = np.zeros((3, t) if self.mrope else t, np.int32)
        images = None
        rows: list[Sequence] = []
        logit_rows = np.zeros(s, np.int32)
        drafts = step.drafts or [[]] * len(step.seqs)
        samples: list[tuple[int, list[int]]] = []  # per row: its first sample row, its drafts
        tokens: list[int] = []  # the step's ids, when the host knows them (not ahead)
        starts: list[int] = []
        lora = np.full(t, -1, np.int32) if self.lora else None
        at = num_samples = 0
        known = assumed is not None or not ahead  # the host knows the step's ids
        gains = [len(a) for a in assumed] if assumed is not None else [ahead] * len(step.seqs)
        row_gains: list[int] = []  # of the sequences that sample, in row order
        for i, (seq, n, drafted, gain) in enumerate(zip(step.seqs, step.num_new_tokens, drafts, gains, strict=True)):
            if lora is not None and seq.lora_slot is not None:
                lora[at:at + n] = seq.lora_slot
            start = seq.num_computed_tokens + gain
            starts.append(start)
            if known:
                history = seq.token_ids + assumed[i] if gain else seq.token_ids
                tokens += history[start:start + n - len(drafted)]
                tokens += drafted
            if self.mrope:  # positions per sequence: its images' rows, or its text's on all three axes
                mm = seq.request.mm
                if mm is not None:
                    positions[:, at:at + n] = mm.position_rows(start, n)
                    for im in mm.images_in(start, start + n):
                        if images is None:
                            images = np.zeros(self.no_images[t].shape, self.no_images[t].dtype)
                        a, b = max(start, im.offset), min(start + n, im.end)
                        images[:, at + a - start:at + b - start] = embeds[im.hash][:, a - im.offset:b - im.offset]
                else:
                    positions[:, at:at + n] = np.arange(start, start + n)
            at += n
            # the chunk reaches the end (its drafts included): sample
            if start + n == seq.num_tokens + gain + len(drafted) and seq.pooled is None:
                logit_rows[len(rows)] = at - 1 - len(drafted)
                rows.append(seq)
                row_gains.append(gain)
                samples.append((num_samples, drafted))
                num_samples += 1 + len(drafted)
        if known:
            ids[:at] = tokens
        if not self.mrope:  # one array operation over the step, not a numpy call per sequence
            q = np.fromiter(step.num_new_tokens, np.int64, len(starts))
            first = np.cumsum(q) - q  # each sequence's first row in the step
            positions[:at] = np.arange(at) + np.repeat(np.asarray(starts, np.int64) - first, q)
        meta = AttentionMetadata.build(
            query_lens=step.num_new_tokens,
            context_lens=[a + n for a, n in zip(starts, step.num_new_tokens, strict=True)],
            block_tables=[q.block_table for q in step.seqs], page_size=self.page_size, num_tokens=t,
            num_seqs=s, max_pages_per_seq=self.max_pages_per_seq)
        if not any(gains) and any(q.request.prompt_logprobs is not None for q in step.seqs):
            targets, spans = prompt_logprobs.targets(step.seqs, step.num_new_tokens, t)
        else:  # nothing to score (every decode step): the device-resident constant, no transfer
            targets, spans = self.no_prompt_targets[t], []
        if self.mrope:
            images = self.no_images[t] if images is None else images
        speculative = any(d for _, d in samples)
        spec = None
        if self.sample_positions > 1:
            spec = self._spec_rows(t, s, logit_rows, samples if speculative else [])
        inputs = StepInputs(ids, positions, meta, logit_rows, self.sampling.build(rows, s, row_gains), targets, images,
                            spec, lora)
        return BuiltInputs(inputs, rows, spans, samples if speculative else None)

    def sample_rows(self, bucket: tuple[int, int]) -> int:
        """R: the rows a step of `bucket` samples (S without speculation)."""
        t, s = bucket
        return s if self.sample_positions == 1 else min(s * self.sample_positions, t)

    def _spec_rows(self, t: int, s: int, logit_rows: np.ndarray, samples: list[tuple[int, list[int]]]) -> SpecRows:
        r = self.sample_rows((t, s))
        rows, seq, offset = np.zeros(r, np.int32), np.zeros(r, np.int32), np.zeros(r, np.int32)
        for i, (first, drafted) in enumerate(samples):
            m = 1 + len(drafted)  # after the last token and after each draft: consecutive token rows
            rows[first:first + m] = logit_rows[i] + np.arange(m)
            seq[first:first + m] = i
            offset[first:first + m] = np.arange(m)
        return SpecRows(rows, seq, offset, np.bool_(bool(samples)))
