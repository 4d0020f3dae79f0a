"""A minimal driver of the model's paged path for parity tests: pages handed out in order, one jitted
forward per distinct shape, logits for every token if asked. The engine's ModelRunner is the real one."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.attention_metadata import AttentionMetadata
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.sharding import kv_cache_sharding
from pallas_kernels.kv_cache import allocate_kv_cache


@functools.partial(jax.jit, donate_argnums=(4,))
def _forward(graphdef, state, ids, positions, caches, meta, logit_rows):
    model = nnx.merge(graphdef, state)
    hidden, caches = model.forward_paged(ids, positions, caches, meta)
    return model.logits(hidden[logit_rows]), caches


class PagedRunner:
    def __init__(self, model: LlamaForCausalLM, *, num_pages: int, page_size: int = 16, mesh=None, kv_dtype=None):
        cfg = model.config
        self.graphdef, self.state = nnx.split(model)
        self.page_size = page_size
        self.num_pages = num_pages
        self.caches = allocate_kv_cache(cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim,
                                        kv_dtype or model.dtype, kv_cache_sharding(mesh) if mesh is not None else None)
        self.free_pages = list(range(num_pages))
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def _grow(self, seq: int, new_len: int) -> None:
        table = self.tables.setdefault(seq, [])
        while len(table) * self.page_size < new_len:
            if not self.free_pages:
                raise RuntimeError("KV cache is full")
            table.append(self.free_pages.pop(0))

    def release(self, seq: int) -> None:
        self.free_pages.extend(self.tables.pop(seq, []))
        self.lengths.pop(seq, None)

    def step(self, chunks: dict[int, list[int]], all_logits: bool = False) -> dict[int, np.ndarray]:
        """Feeds each sequence's next tokens; returns logits [n, V] per sequence (n = its chunk length when
        all_logits, else 1: the last token's)."""
        seqs = list(chunks)
        query_lens, context_lens, ids, positions = [], [], [], []
        for s in seqs:
            start = self.lengths.get(s, 0)
            n = len(chunks[s])
            self._grow(s, start + n)
            self.lengths[s] = start + n
            query_lens.append(n)
            context_lens.append(start + n)
            ids += chunks[s]
            positions += range(start, start + n)
        meta = AttentionMetadata.build(query_lens=query_lens, context_lens=context_lens,
                                       block_tables=[self.tables[s] for s in seqs], page_size=self.page_size,
                                       max_pages_per_seq=self.num_pages)  # fixed width: no recompiles
        ends = np.cumsum(query_lens)
        rows = np.arange(len(ids)) if all_logits else ends - 1
        logits, self.caches = _forward(self.graphdef, self.state, jnp.asarray(ids, jnp.int32),
                                       jnp.asarray(positions, jnp.int32), self.caches, meta, jnp.asarray(rows))
        logits = np.asarray(logits)
        if not all_logits:
            return {s: logits[i:i + 1] for i, s in enumerate(seqs)}
        return {s: logits[e - n:e] for s, n, e in zip(seqs, query_lens, ends, strict=True)}


def greedy_generate(runner: PagedRunner, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy decoding of a batch of prompts: one prefill step, then one decode step per token."""
    outputs: list[list[int]] = [[] for _ in prompts]
    chunks = dict(enumerate(prompts))
    for _ in range(max_new_tokens):
        for i, row in runner.step(chunks).items():
            outputs[i].append(int(np.argmax(row[-1])))
        chunks = {i: [out[-1]] for i, out in enumerate(outputs)}
    return outputs
