"""Continuous-batching scheduler with a token budget per step.

Each step: running sequences first (a decode takes one token, a prompt being prefilled takes its next chunk),
then waiting ones in arrival order while the budget, the sequence limit and free pages allow. A chunk that reaches
an image whose embeddings are not in the encoder cache schedules the image's encoding, within the encoder's own
budget of image tokens per step; when that budget is spent, the chunk stops before the image. Long prompts
are prefilled in chunks alongside decodes. When pages run out, the most recently admitted running sequence is
preempted: its pages are freed and it goes back to the front of the queue to be recomputed later (prompt and
generated tokens alike, mostly from the prefix cache).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import TYPE_CHECKING

from jaxllm.engine.block_manager import BlockManager
from jaxllm.engine.encoder_cache import EncoderCache
from jaxllm.engine.sequence import Sequence, SequenceStatus
from jaxllm.multimodal.inputs import ImageItem

if TYPE_CHECKING:
    from jaxllm.lora.manager import LoRAManager


@dataclasses.dataclass
class ScheduledStep:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence, tokens computed this step
    encode: list[ImageItem] = dataclasses.field(default_factory=list)  # images to encode before the step
    # per sequence, the speculative tokens it computes after its last one (empty: none); set with `num_new_tokens`
    drafts: list[list[int]] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked: bool = True, encoder_cache: EncoderCache | None = None, encoder_budget: int = 0,
                 loras: LoRAManager | None = None):
        """chunked: prompts may be split over steps (a causal model); an encoder's inputs run whole, each within
        one step's budget (the frontend refuses longer ones). encoder_cache, encoder_budget: a vision-language
        model's cache of image embeddings (read here, filled by the model runner) and image tokens encoded per
        step at most. loras: the `jaxllm.lora.LoRAManager` of an engine with adapters: a sequence is admitted only
        with a device slot for its adapter (else it waits, and others go ahead), and gives the slot back when it
        stops running."""
        self.bm = block_manager
        self.chunked = chunked
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0
        self.encoder_cache, self.encoder_budget = encoder_cache, encoder_budget
        self.loras = loras

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _ready(self, seq: Sequence, ends: dict[Sequence, int]) -> bool:
        """Choices 1..n-1 of a request wait until choice 0 has computed the prompt, or computes its end in this
        step (`ends`: where each sequence's chunk in it ends), then share its pages."""
        leader = seq.request.seqs[0]
        return seq is leader or leader.finished or max(leader.num_computed_tokens, ends.get(leader, 0)) >= \
            leader.num_prompt_tokens

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.release(seq)
        if self.loras is not None:
            self.loras.release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _fit_images(self, seq: Sequence, start: int, n: int, step: ScheduledStep) -> int:
        """Tokens of [start, start + n) this step can compute: up to the first image that is neither cached nor
        encoded this step and does not fit the encoder's budget left (whose encoding is otherwise scheduled)."""
        mm = seq.request.mm
        if mm is None:
            return n
        queued = {im.hash for im in step.encode}
        left = self.encoder_budget - sum(im.num_tokens for im in step.encode)
        for im in mm.images_in(start, start + n):
            if im.hash in queued or im.hash in self.encoder_cache:
                continue
            if im.num_tokens > left:
                return max(0, im.offset - start)
            step.encode.append(im)
            queued.add(im.hash)
            left -= im.num_tokens
        return n

    def schedule(self) -> ScheduledStep:
        try:
            return self._schedule()
        finally:
            self.bm.forget_promises()  # only a request admitted in this same step may share a promised page

    def _schedule(self) -> ScheduledStep:
        budget = self.max_num_batched_tokens
        step = ScheduledStep([], [])
        preempted = False
        for seq in list(self.running):
            if seq not in self.running:  # preempted earlier in this loop
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n > 0 and seq.request.mm is not None:
                n = self._fit_images(seq, seq.num_computed_tokens, n, step)
            if n <= 0:
                continue
            drafts = seq.drafts[:budget - 1] if n == 1 else []  # a decode verifies its drafts in the same step
            if drafts and self.bm.can_grow(seq, seq.num_computed_tokens + 1 + len(drafts)):
                n += len(drafts)
            else:  # drafts never preempt anyone: without room for them the sequence decodes one token
                drafts = []
            while not self.bm.can_grow(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            self.bm.grow(seq, seq.num_computed_tokens + n)
            if self.waiting:  # a prompt this step admits may share the pages it fills
                self.bm.promise(seq, seq.num_computed_tokens + n)
            step.seqs.append(seq)
            step.num_new_tokens.append(n)
            step.drafts.append(drafts)
            budget -= n
            if budget == 0:
                break
        if preempted:  # no admissions in a step that had to preempt
            return step
        skipped: list[Sequence] = []
        ends = {q: q.num_computed_tokens + n for q, n in zip(step.seqs, step.num_new_tokens, strict=True)} \
            if self.waiting else {}
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._ready(seq, ends):
                skipped.append(self.waiting.popleft())
                continue
            # Mean and CLS pooling read every token's hidden state, an encoder's tokens attend to each other, and
            # prompt logprobs score every prompt token: a prefix-cache hit would skip some.
            every_token = not self.chunked or (seq.pooled is not None and seq.pooled.pooling is not None
                                               and seq.pooled.pooling.needs_every_token) or \
                (seq.request.prompt_logprobs is not None and seq.index == 0)  # every prompt token is scored
            cached = [] if every_token else self.bm.cached_prefix(seq)
            start = len(cached) * self.bm.page_size
            n = min(seq.num_tokens - start, budget)
            if not self.chunked and n < seq.num_tokens - start:
                break  # whole or not at all: the next step has the budget
            if seq.request.mm is not None:
                encode_before = len(step.encode)
                n = self._fit_images(seq, start, n, step)
                if n == 0:
                    break
            if self.bm.pages_needed(start + n) - len(cached) > self.bm.num_free_pages - sum(
                    1 for p in cached if self.bm.ref_counts[p] == 0):
                if seq.request.mm is not None:
                    del step.encode[encode_before:]
                break
            if self.loras is not None and not self.loras.acquire(seq):  # every adapter slot is in use by others
                skipped.append(self.waiting.popleft())
                continue
            self.waiting.popleft()
            self.bm.allocate_prefix(seq, cached)
            seq.num_computed_tokens = seq.num_cached_tokens = start
            self.bm.grow(seq, start + n)
            ends[seq] = start + n
            if self.waiting:
                self.bm.promise(seq, start + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            step.seqs.append(seq)
            step.num_new_tokens.append(n)
            step.drafts.append([])
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return step

    def lookahead(self, step: ScheduledStep) -> ScheduledStep | None:
        """The decode step that follows `step` (all decodes) for the same sequences, one token each, to be run before
        `step`'s tokens are read back (they reach it on the device); None when something waits to be admitted (it
        goes first) or a sequence has no room for one more token without preempting. Grows the pages now."""
        if self.waiting or not step.seqs:
            return None
        need = sum(self.bm.pages_needed(q.num_computed_tokens + 2) - len(q.block_table) for q in step.seqs)
        if need > self.bm.num_free_pages:
            return None
        for seq in step.seqs:
            self.bm.grow(seq, seq.num_computed_tokens + 2)
        return ScheduledStep(list(step.seqs), [1] * len(step.seqs), drafts=[[] for _ in step.seqs])

    def lookahead_guessed(self, step: ScheduledStep, guessed: list[tuple[list[int], list[int]]]
                          ) -> ScheduledStep | None:
        """The drafted step that follows `step` (drafted, not read back yet) for the same sequences if `step` yields
        what `guessed` says: per sequence, the tokens it is taken to gain, and the drafts after them. Its ids are
        the last of those tokens and the drafts; None as `lookahead`, or past the token budget. Grows the pages
        now (`drop_guessed` gives them back if the guess fails)."""
        if self.waiting or not step.seqs:
            return None
        if sum(1 + len(d) for _, d in guessed) > self.max_num_batched_tokens:
            return None
        ends = {q: q.num_computed_tokens + len(gain) + 1 + len(d) for q, (gain, d) in zip(step.seqs, guessed,
                                                                                            strict=True)}
        if sum(max(0, self.bm.pages_needed(end) - len(q.block_table)) for q, end in ends.items()) > \
                self.bm.num_free_pages:
            return None
        for seq, end in ends.items():
            self.bm.grow(seq, end)
        return ScheduledStep(list(step.seqs), [1 + len(d) for _, d in guessed], drafts=[d for _, d in guessed])

    def drop_guessed(self, step: ScheduledStep) -> None:
        """A guessed step (`lookahead_guessed`) whose guess failed: its results are not used, and its sequences
        keep the pages their progress needs (its KV writes lie past that progress, and are rewritten before
        anything reads them)."""
        for seq in step.seqs:
            if not seq.finished:
                self.bm.truncate(seq, seq.num_computed_tokens)

    def update_from_output(self, step: ScheduledStep, rejected: list[int] | None = None) -> list[int | None]:
        """Advances each sequence of the step that ran by the tokens it computed, less its `rejected` drafts (their
        KV slots are rolled back), and registers its pages that became full in the prefix cache: with admission
        and preemption, the only writer of a sequence's progress. Returns where each sequence's chunk started
        (None: it ended while the step ran, finished or aborted)."""
        starts: list[int | None] = []
        for i, (seq, n) in enumerate(zip(step.seqs, step.num_new_tokens, strict=True)):
            if seq.finished:
                starts.append(None)
                continue
            starts.append(seq.num_computed_tokens)
            seq.num_computed_tokens += n
            if rejected and rejected[i]:
                self.rollback(seq, seq.num_computed_tokens - rejected[i])
            self.bm.cache_full_pages(seq)
        return starts

    def rollback(self, seq: Sequence, num_computed: int) -> None:
        """Takes seq's progress back to `num_computed` tokens (tokens computed past them were rejected: a
        speculative step's drafts) and frees the pages past them; the caller drops the rejected tokens."""
        if not seq.num_cached_tokens <= num_computed <= seq.num_computed_tokens:
            raise ValueError(f"cannot roll {seq} back to {num_computed} tokens")
        seq.num_computed_tokens = num_computed
        self.bm.truncate(seq, num_computed)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """The one way a sequence ends (a stop rule, a length, an abort, an error): records why, removes it from
        the queues and frees its pages."""
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.release(seq)
        if self.loras is not None:
            self.loras.release(seq)
        seq.status = SequenceStatus.FINISHED
