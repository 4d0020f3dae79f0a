"""The engine's side of speculation: before the scheduler runs, each decoding sequence gets its drafts from the
method (`Drafter.propose`); once the step is scheduled, the method makes them final (`Drafter.fill`: a draft
model computes them there); after the step, the counters and the method learn what the target accepted
(`Drafter.observe`). With `draft_budget="step_cost"` (opt-in) a step verifies only the drafts that make the most
expected tokens a second by the steps' measured times (`draft_budget`): on a host whose steps grow with their rows,
a batch's unlikely drafts cost more than they save. Steps of a batch too large to gain from drafts
(`disable_by_batch_size`, by default read from the target's step times at warm-up: `batch_limit`) run none.

A sequence gets no drafts where the target's samples at later positions would not be those of plain steps: its
penalties read a history the drafts are not in, a grammar's mask follows each token, and min_tokens' bans end
with a count. Such a sequence decodes one token a step beside the drafted ones."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from jaxllm.speculative import batch_limit
from jaxllm.speculative.draft_budget import FRESH_RATE, DraftBudget, KeepRate
from jaxllm.speculative.methods import ProposerContext, make_proposer
from jaxllm.speculative.verify import SpecDecodeStats

# A sequence's drafted steps in a row that kept every draft before its next is guessed on: a failed guess costs a
# step's device time, a held one saves the host's work around a step (docs/performance.md), and a quote that
# ends, or an edit in it, fails a guess
GUESS_AFTER = 2

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from jaxllm.engine.model_runner import ModelRunner
    from jaxllm.engine.scheduler import ScheduledStep
    from jaxllm.engine.sequence import Sequence
    from jaxllm.speculative.config import SpeculativeConfig


class Drafter:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, context: ProposerContext | None = None):
        """context: what the engine lends the method (a draft model, the cache's geometry, the step shapes)."""
        self.config, self.max_model_len = config, max_model_len
        self.context = context or ProposerContext(max_model_len)
        self.proposer = make_proposer(config, self.context)
        self.stats = SpecDecodeStats()
        # The most drafts each sequence gets next (by seq_id; k when absent): after a step that kept all of its
        # drafts, k again; after one that kept a of them, 2a (at least 1). A draft costs a row of the step whether
        # kept or not, and a sequence whose drafts fail (its output stopped quoting) should try few of them.
        self.caps: dict[int, int] = {}
        # Drafted steps in a row that kept every draft, by seq_id (`guess`)
        self.streaks: dict[int, int] = {}
        # What was kept of each sequence's drafts and of all of them (`draft_budget`'s rates); the budget itself
        # once the steps are timed (`calibrate`)
        self.keep_rates: dict[int, KeepRate] = {}
        self.pooled = KeepRate()
        self.budget: DraftBudget | None = None
        # No drafts in a step of this many running sequences or more (None: any): the config's number, or with
        # "auto" what `limit_batches` reads from the step times (none until then)
        limit = config.disable_by_batch_size
        self.batch_limit: int | None = None if limit == "auto" else limit

    def calibrate(self, bucket_seconds: dict[tuple[int, int], float], bucket_for, overlap: bool = True) -> None:
        """The target's step times by bucket (timed at warm-up), for `draft_budget="step_cost"`; overlap: the
        engine runs undrafted steps ahead (`DraftBudget`)."""
        if self.config.draft_budget == "step_cost" and bucket_seconds:
            self.budget = DraftBudget(bucket_seconds, bucket_for, overlap)

    def limit_batches(self, runner: ModelRunner, max_num_seqs: int) -> None:
        """`disable_by_batch_size="auto"`: `batch_limit` from the target's steps, timed now (`batch_limit`)."""
        if self.config.disable_by_batch_size != "auto":
            return
        k, c = self.config.num_speculative_tokens, self.context
        measured = batch_limit.measure(runner, k, max_num_seqs, self.max_model_len, c.page_size, c.num_pages)
        self.batch_limit = batch_limit.resolve(k, measured)
        logger.info("speculation: drafts in steps of %s; plain / drafted step ms by batch size: %s",
                    "any batch size" if self.batch_limit is None else
                    f"fewer than {self.batch_limit} sequences (disable_by_batch_size auto)",
                    ", ".join(f"{s}: {a * 1e3:.1f} / {b * 1e3:.1f}" for s, a, b in measured))

    def step_took(self, bucket: tuple[int, int], seconds: float, host_seconds: float, drafted: bool) -> None:
        """A step of `bucket` ran in `seconds` from dispatch to result (none other in flight), and the host worked
        `host_seconds` more around it: the budget's estimates follow (the host's time, of drafted steps)."""
        if self.budget is not None:
            self.budget.observe(bucket, seconds, host_seconds if drafted else None)

    def propose(self, running: list[Sequence]) -> None:
        """Sets each running sequence's drafts for the next step (none where it does not decode, or may not)."""
        limit = self.batch_limit
        off = limit is not None and len(running) >= limit
        self.caps = {seq.seq_id: cap for seq in running if (cap := self.caps.get(seq.seq_id)) is not None}
        self.streaks = {seq.seq_id: n for seq in running if (n := self.streaks.get(seq.seq_id))}
        if self.budget is not None:
            self.keep_rates = {seq.seq_id: r for seq in running if (r := self.keep_rates.get(seq.seq_id)) is not None}
        self.proposer.begin(running)
        for seq in running:
            room = 0 if off or not self._may_draft(seq) else self._room(seq)
            seq.drafts = self.proposer.propose(seq, room) if room > 0 else []
        if self.budget is not None and any(seq.drafts for seq in running):
            decoding = [seq for seq in running if seq.num_computed_tokens + 1 == seq.num_tokens and not seq.finished]
            for seq, n in zip(decoding, self._trim(decoding, [len(seq.drafts) for seq in decoding]), strict=True):
                seq.drafts = seq.drafts[:n]

    def fill(self, step: ScheduledStep) -> None:
        """The scheduled step's drafts made final (a draft model computes them now that they have pages)."""
        self.proposer.fill(step)

    def guess(self, step: ScheduledStep) -> list[tuple[list[int], list[int]]] | None:
        """For `step`, drafted and in flight: per sequence, the tokens it gains if the target keeps every draft and
        adds the token the method guesses next, and the drafts `propose` would then give it: the step after,
        dispatched before `step` is read back (async scheduling), runs exactly as it would have had it waited
        whenever the guess holds (`jaxllm.engine.llm_engine`). None where a guess is not worth a step (one that
        fails costs a step's device time; one that holds saves the host's work between steps): some sequence did
        not draft, or did not keep every draft of its last `GUESS_AFTER` drafted steps, or has no guess or no
        room after it; the method cannot guess (it runs a model); the draft budget chooses drafts by timing steps
        one at a time."""
        limit = self.batch_limit
        if self.budget is not None or not step.seqs or not all(step.drafts) or \
                (limit is not None and len(step.seqs) >= limit):
            return None
        out = []
        for seq, drafted in zip(step.seqs, step.drafts, strict=True):
            if self.streaks.get(seq.seq_id, 0) < GUESS_AFTER or not self._may_draft(seq):
                return None
            nxt = self.proposer.propose_after(seq, drafted, 1)
            if not nxt:
                return None
            gained = drafted + nxt
            room = self._room(seq, len(gained))
            drafts = self.proposer.propose_after(seq, gained, room) if room > 0 else None
            if not drafts:
                return None
            out.append((gained, drafts))
        return out

    def worth_waiting(self, seqs: list[Sequence]) -> bool:
        """Whether the next step of `seqs` should wait for this one's tokens, to draft from them, rather than be
        dispatched ahead without drafts (async scheduling): some sequence is quoting, i.e. the method, given its
        tokens but the last, would have proposed its last token (so drafts after the next token will likely be
        kept too; a draft model always drafts from the last token). Otherwise running ahead saves more than drafts
        that would mostly be rejected."""
        limit = self.batch_limit
        if limit is not None and len(seqs) >= limit:
            return False
        # (the room past the caps: a cap that fell to 1 rises again only through a drafted step that keeps all)
        if self.budget is None:
            return any(self._may_draft(seq) and self._room(seq, capped=False) > 1 and self.proposer.worth_waiting(seq)
                       for seq in seqs)
        rooms = [self._room(seq, capped=False) if self._may_draft(seq) and self.proposer.worth_waiting(seq) else 0
                 for seq in seqs]
        # nor when the budget would drop the drafts the quoting sequences could get
        return any(room > 1 for room in rooms) and any(self._trim(seqs, rooms))

    def _trim(self, seqs: list[Sequence], lengths: list[int]) -> list[int]:
        prior = self.pooled.estimate(FRESH_RATE)
        return self.budget.trim(lengths, [self.keep_rates.get(seq.seq_id, KeepRate()).estimate(prior) for seq in seqs])

    def observe(self, step: ScheduledStep, rejected: list[int]) -> None:
        self.proposer.observe(step, rejected)
        k = self.config.num_speculative_tokens
        for seq, drafted, lost in zip(step.seqs, step.drafts, rejected, strict=True):
            if drafted:
                kept = len(drafted) - lost
                self.stats.observe(len(drafted), kept)
                if self.budget is not None:
                    self.keep_rates.setdefault(seq.seq_id, KeepRate()).observe(len(drafted), kept)
                    self.pooled.observe(len(drafted), kept)
                self.caps[seq.seq_id] = k if lost == 0 else max(1, 2 * kept)
                self.streaks[seq.seq_id] = self.streaks.get(seq.seq_id, 0) + 1 if lost == 0 else 0

    @staticmethod
    def _may_draft(seq: Sequence) -> bool:
        p = seq.params
        return (seq.num_computed_tokens + 1 == seq.num_tokens and not seq.finished and seq.pooled is None
                and seq.matcher is None and not p.uses_penalties and seq.num_output_tokens >= p.min_tokens)

    def _room(self, seq: Sequence, gained: int = 0, capped: bool = True) -> int:
        """Drafts that can still be used: each kept one is an output token, and the target adds one of its own
        (gained: tokens the sequence is taken to have beyond its host state, whose drafts were all kept; capped:
        within the sequence's cap, `caps`)."""
        p = seq.params
        k = self.config.num_speculative_tokens
        room = self.caps.get(seq.seq_id, k) if capped and not gained else k
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - seq.num_output_tokens - gained - 1)
        return min(room, self.max_model_len - seq.num_tokens - gained - 1)
