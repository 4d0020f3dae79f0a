"""KV-cache pages: a free list, reference counts, and automatic prefix caching.

Every full page of a sequence gets a chained SHA-256 hash (the previous page's hash and this page's token ids;
the first page's chain starts from the request's `cache_salt` and its LoRA adapter), so a hash names a whole
prefix. A new sequence reuses the cached pages of its longest cached prefix of full pages instead of recomputing
them. Freed pages
keep their contents and hash and go to the back of the free list (least recently used first out): they are
reused as cache hits until someone needs the page for new content.

One tenant must never read another's KV: the hash is cryptographic (Python's `hash()` of a tuple can be
collided on purpose, the pattern behind vLLM's GHSA-rm76-4mrf-v9r8), and a hit is also checked against what
the page really holds: its token ids, its salt (first page), and the exact parent page and that page's
generation (bumped each time a page is refilled). By induction from the first page, a verified chain holds
exactly this sequence's prefix, whatever the hash does.

A page holding image tokens (all the same image-pad id) is told apart by the content hashes of the images it
holds, mixed into its hash and its key: the same image hits, two different images never share a page.

Pages a step is about to fill are promised (`promise`) while that step is scheduled: a request admitted later in
the same step shares them as hits (vLLM's behaviour too: n > 1 siblings, or clients sending one system prompt at
once, compute it once). That is sound because every attention kernel writes the whole step's K/V into the cache
before any query reads it (`jaxllm.kernels.attention_kernel`), and a scheduled step always runs; the writer
registers the pages as usual once the step is done (`cache_full_pages`).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict
from collections.abc import Iterator

from jaxllm.engine.sequence import Sequence

_ROOT = hashlib.sha256(b"jaxllm prefix cache v1").digest()


def root_hash(cache_salt: str | tuple[str | None, str] | None) -> bytes:
    """The chain's start for a request's `prefix_salt`: a tenant's salt, or (salt, adapter) of a LoRA request."""
    if cache_salt is None:
        return _ROOT
    if isinstance(cache_salt, tuple):
        return hashlib.sha256(_ROOT + b"lora:" + json.dumps(list(cache_salt)).encode()).digest()
    return hashlib.sha256(_ROOT + b"salt:" + cache_salt.encode()).digest()


def page_hash(prev: bytes, tokens: list[int], images: bytes = b"") -> bytes:
    """prev: the previous page's hash (or root_hash); tokens: one full page of token ids; images: the content
    hashes of the images with tokens in the page."""
    h = hashlib.sha256(prev + array("I", tokens).tobytes())
    if images:
        h.update(b"images:" + images)
    return h.digest()


def _page_images(seq: Sequence, index: int, page_size: int) -> bytes:
    mm = seq.request.mm
    if mm is None:
        return b""
    return b"".join(im.hash for im in mm.images_in(index * page_size, (index + 1) * page_size))


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))  # LRU order
        self.hash_of_page: dict[int, bytes] = {}
        self.page_of_hash: dict[bytes, int] = {}
        # What a cached page holds, checked on every hit: (parent page, its generation, salt, token ids).
        self.key_of_page: dict[int, tuple] = {}
        self.generation = [0] * num_pages  # bumped whenever a page is handed out for new content
        self.prefix_hits = 0  # prompt tokens served from the cache
        # Pages the step being scheduled fills (`promise`): hash -> page, and each page's hash and key.
        self.promised: dict[bytes, int] = {}
        self.promised_hash: dict[int, bytes] = {}
        self.promised_key: dict[int, tuple] = {}

    @property
    def num_free_pages(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_pages

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached page (vLLM's `reset_prefix_cache`): later prompts recompute their prefixes. Only
        with no page in use (False, and nothing forgotten, otherwise: a running sequence's pages stay cached)."""
        if len(self.free) != self.num_pages:
            return False
        self.hash_of_page.clear()
        self.page_of_hash.clear()
        self.key_of_page.clear()
        return True

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # -- prefix cache
    def _page_hash(self, prev: bytes, tokens: list[int], images: bytes = b"") -> bytes:
        return page_hash(prev, tokens, images)

    def _page_key(self, parent: int | None, salt: str | None, tokens: list[int], images: bytes = b"") -> tuple:
        if parent is None:
            return None, None, salt, tuple(tokens), images
        return parent, self.generation[parent], None, tuple(tokens), images

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Pages holding the longest cached prefix of full pages, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        salt = seq.request.prefix_salt
        pages: list[int] = []
        prev = root_hash(salt)
        max_pages = (seq.num_tokens - 1) // self.page_size
        for i in range(max_pages):
            tokens = seq.token_ids[i * self.page_size:(i + 1) * self.page_size]
            images = _page_images(seq, i, self.page_size)
            h = self._page_hash(prev, tokens, images)
            page = self.page_of_hash.get(h)
            known = self.key_of_page
            if page is None:
                page, known = self.promised.get(h), self.promised_key
            if page is None or known.get(page) != self._page_key(pages[-1] if pages else None, salt, tokens, images):
                break  # a miss, or a hash collision: the page holds something else
            pages.append(page)
            prev = h
        return pages

    def allocate_prefix(self, seq: Sequence, pages: list[int]) -> None:
        for page in pages:
            self._take(page)
        seq.block_table = list(pages)
        seq.page_hashes = [self.hash_of_page.get(p) or self.promised_hash[p] for p in pages]
        self.prefix_hits += len(pages) * self.page_size

    def _unhashed_full_pages(self, seq: Sequence, full: int) -> Iterator[tuple[int, bytes, tuple]]:
        """(index, hash, key) of seq's pages from its first without a hash to page `full` (exclusive), chained
        from its last hashed page."""
        salt = seq.request.prefix_salt
        prev = seq.page_hashes[-1] if seq.page_hashes else root_hash(salt)
        for i in range(len(seq.page_hashes), full):
            tokens = seq.token_ids[i * self.page_size:(i + 1) * self.page_size]
            images = _page_images(seq, i, self.page_size)
            prev = self._page_hash(prev, tokens, images)
            yield i, prev, self._page_key(seq.block_table[i - 1] if i else None, salt, tokens, images)

    def promise(self, seq: Sequence, num_tokens: int) -> None:
        """seq's pages that become full of its known tokens once the step being scheduled computes them up to
        `num_tokens` (its block table holds them): until `forget_promises`, `cached_prefix` serves them too."""
        if not self.enable_prefix_caching:
            return
        for i, h, key in self._unhashed_full_pages(seq, min(num_tokens, seq.num_tokens) // self.page_size):
            page = seq.block_table[i]
            if h not in self.page_of_hash and h not in self.promised and page not in self.hash_of_page:
                self.promised[h] = page
                self.promised_hash[page] = h
                self.promised_key[page] = key

    def forget_promises(self) -> None:
        """The step is scheduled: its pages are registered by `cache_full_pages` once computed."""
        self.promised.clear()
        self.promised_hash.clear()
        self.promised_key.clear()

    def _take(self, page: int) -> None:
        if self.ref_counts[page] == 0:
            del self.free[page]
        self.ref_counts[page] += 1

    # -- growth and release
    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.pages_needed(num_tokens) - len(seq.block_table) <= len(self.free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Makes seq's block table hold num_tokens tokens (the caller checked can_grow)."""
        for _ in range(self.pages_needed(num_tokens) - len(seq.block_table)):
            page, _ = self.free.popitem(last=False)
            old = self.hash_of_page.pop(page, None)
            if old is not None and self.page_of_hash.get(old) == page:
                del self.page_of_hash[old]
            self.key_of_page.pop(page, None)
            self.generation[page] += 1
            self.ref_counts[page] = 1
            seq.block_table.append(page)

    def cache_full_pages(self, seq: Sequence) -> None:
        """Registers the hashes of seq's pages that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        # (accepted drafts are computed before the sequence's tokens hold them: their pages wait for the next step)
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.page_size
        for i, h, key in list(self._unhashed_full_pages(seq, full)):
            seq.page_hashes.append(h)
            page = seq.block_table[i]
            if h not in self.page_of_hash and page not in self.hash_of_page:
                self.page_of_hash[h] = page
                self.hash_of_page[page] = h
                self.key_of_page[page] = key

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keeps only the pages `num_tokens` tokens need (tokens past them were rejected: speculation) and
        forgets the prefix-cache entries of seq's pages that are no longer full of those tokens, so a page
        whose KV is about to be rewritten is never served by its old hash. Pages past the prefix are seq's own
        (a shared page is a full prompt page, and a rollback never reaches into the prompt's cached part)."""
        full = num_tokens // self.page_size
        for i in range(full, len(seq.page_hashes)):
            page, h = seq.block_table[i], seq.page_hashes[i]
            if self.hash_of_page.get(page) == h:
                del self.hash_of_page[page]
                self.key_of_page.pop(page, None)
                if self.page_of_hash.get(h) == page:
                    del self.page_of_hash[h]
        del seq.page_hashes[full:]
        keep = self.pages_needed(num_tokens)
        for page in reversed(seq.block_table[keep:]):
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                self.free[page] = None
        del seq.block_table[keep:]

    def release(self, seq: Sequence) -> None:
        # Later pages first: the end of a prefix is the least likely to be reused, so it goes out first.
        for page in reversed(seq.block_table):
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                self.free[page] = None
        seq.block_table = []
        seq.page_hashes = []
