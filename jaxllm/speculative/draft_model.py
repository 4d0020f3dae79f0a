"""A draft model (vLLM's "draft_model" method): a smaller or quantized model with the target's tokenizer proposes
each sequence's next k tokens greedily; the target verifies them in its next step (`verify`: a draft is kept when
the target's own sample at its position equals it, so the output is plain decoding's at any temperature).

The draft keeps its own paged KV in pages with the target's ids (`draft_runner`), and this class tracks how many
of each sequence's tokens it holds: after a step that kept a of m drafts, the draft's KV is right up to the
sequence's length before the step plus min(a, m - 1) (the drafts it wrote and the target kept; the last draft
was never fed back). Before a step the scheduler reserves the drafts' pages (`propose` returns placeholders of
the length `fill` computes); a sequence far behind (a prompt the draft has not read) catches up in chunks within
a step's token budget before it drafts. Preemption drops what the draft held (its pages were freed)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxllm.config import ConfigError
from jaxllm.speculative.draft_runner import DraftRunner
from jaxllm.speculative.methods import Proposer, ProposerContext

if TYPE_CHECKING:
    from jaxllm.engine.scheduler import ScheduledStep
    from jaxllm.engine.sequence import Sequence
    from jaxllm.speculative.config import SpeculativeConfig


class DraftModelProposer(Proposer):
    """Also the base of a method whose draft keeps paged KV of its own in rows that follow a sequence's tokens
    (`shift`: row p reads token p + shift) and drafts greedily on device (`eagle3`)."""
    shift = 0  # row p of the draft's cache reads the sequence's token p + shift

    def __init__(self, config: SpeculativeConfig, context: ProposerContext):
        if context.draft is None or not context.buckets:
            raise ConfigError(f"speculative_config: {config.method} runs in an engine that loaded its draft model")
        self.k = config.num_speculative_tokens
        self.runner = self.make_runner(context)
        self.held: dict[int, tuple[int, int]] = {}  # seq_id -> (rows in the draft's cache, its preemptions then)
        self.drafted: dict[int, tuple[int, int]] = {}  # seq_id -> (its rows, drafts) in the step being verified
        self.eligible: dict[int, Sequence] = {}  # this step's sequences that may draft (they decode)
        # this step's drafting sequences, and the rows a catch-up step reads for them first
        self.reserved_seqs = self.reserved_tokens = 0

    def make_runner(self, context: ProposerContext) -> DraftRunner:
        return DraftRunner(context.draft, k=self.k, num_pages=context.num_pages, page_size=context.page_size,
                           max_model_len=context.max_model_len, buckets=list(context.buckets),
                           kv_cache_dtype=context.kv_cache_dtype, mesh=context.mesh)

    def rows_after(self, rows: int, drafts: int, rejected: int) -> int:
        """The draft's rows still right once the target kept `drafts - rejected` of the `drafts` it drafted from
        `rows` rows: those, and the drafts it wrote and the target kept (the last draft was never fed back)."""
        return rows + min(drafts - rejected, drafts - 1)

    def held_rows(self, seq: Sequence) -> int:
        n, preemptions = self.held.get(seq.seq_id, (0, seq.num_preemptions))
        return n if preemptions == seq.num_preemptions else 0

    def begin(self, running: list[Sequence]) -> None:
        live = {seq.seq_id for seq in running}
        self.held = {i: v for i, v in self.held.items() if i in live}
        self.drafted = {i: v for i, v in self.drafted.items() if i in live}
        self.eligible = {}
        self.reserved_seqs = self.reserved_tokens = 0

    def propose(self, seq: Sequence, max_drafts: int) -> list[int]:
        self.eligible[seq.seq_id] = seq
        ahead = max(0, seq.num_tokens - self.shift - self.runner.tail - self.held_rows(seq))  # a catch-up reads first
        if self.reserved_tokens + ahead > self.runner.max_tokens or self.reserved_seqs == self.runner.max_seqs:
            return []  # it catches up first (`fill`), and drafts in a later step
        self.reserved_tokens += ahead
        self.reserved_seqs += 1
        return [0] * min(self.k, max_drafts)  # placeholders: `fill` computes them once they have pages

    def worth_waiting(self, seq: Sequence) -> bool:
        return True  # a draft follows the last token: without it there are no drafts

    def warmup(self) -> None:
        self.runner.warmup()

    def fill(self, step: ScheduledStep) -> None:
        """Every sequence of the step that may draft has pages for its tokens (it decodes this step) and, with
        drafts, for them. The draft's cache reads the rows it lacks (a sequence of n tokens has n - shift): a
        catch-up step takes each drafting sequence's rows but its last `tail` ones (reserved by `propose`: they
        fit), then the others' by what the budget leaves; a draft step takes the drafting sequences' last rows (at
        least one) and drafts."""
        ups, draws, held = [], [], {}
        budget, shift = self.runner.max_tokens, self.shift
        pairs = [(i, seq) for i, seq in enumerate(step.seqs) if seq.seq_id in self.eligible]
        for i, seq in sorted(pairs, key=lambda p: not step.drafts[p[0]]):  # drafting sequences first
            rows, wanted = seq.num_tokens - shift, len(step.drafts[i])
            start = min(self.held_rows(seq), rows)
            tail = min(max(start, rows - self.runner.tail), rows - 1) if wanted else rows
            end = min(tail, start + budget) if len(ups) < self.runner.max_seqs else start
            if end > start:
                ups.append((seq.token_ids[start + shift:end + shift], start, seq.block_table, 0))
                budget -= end - start
            held[seq.seq_id] = max(end, start)
            if wanted:
                assert end >= tail, "propose reserves a drafting sequence's catch-up"
                draws.append((i, seq, (seq.token_ids[tail + shift:], tail, seq.block_table, wanted)))
        if ups:
            self.runner.catch_up(ups)
        if draws:
            drafts = self.runner.draft([row for _, _, row in draws])
            for r, (i, seq, _) in enumerate(draws):
                step.drafts[i][:] = drafts[r, :len(step.drafts[i])].tolist()
                held[seq.seq_id] = rows = seq.num_tokens - shift
                self.drafted[seq.seq_id] = (rows, len(step.drafts[i]))
        for seq_id, end in held.items():
            self.held[seq_id] = (end, self.eligible[seq_id].num_preemptions)

    def observe(self, step: ScheduledStep, rejected: list[int]) -> None:
        for seq, lost in zip(step.seqs, rejected, strict=True):
            if (entry := self.drafted.pop(seq.seq_id, None)) is not None:
                rows, m = entry
                self.held[seq.seq_id] = (self.rows_after(rows, m, lost), seq.num_preemptions)
