"""The vision encoder's outputs, kept by image content hash so that an image is encoded once: when its request's
prefill is cut into chunks (the chunks after the first read the cached rows), when the request is preempted and
recomputed, and when another request sends the same image. Least recently used entries go first once the
capacity (in image tokens) is reached. Host memory: the step's inputs are assembled on the host."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class EncoderCache:
    def __init__(self, capacity_tokens: int):
        if capacity_tokens < 1:
            raise ValueError("the encoder cache needs a capacity of at least one token")
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[bytes, np.ndarray] = OrderedDict()  # hash -> [levels, tokens, E], LRU first
        self.num_tokens = 0
        self.hits = 0  # images found here when a step needed them
        self.encoded = 0  # images the encoder ran on

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.num_tokens = 0

    def get(self, key: bytes) -> np.ndarray | None:
        rows = self._entries.get(key)
        if rows is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return rows

    def put(self, key: bytes, rows: np.ndarray) -> None:
        self.encoded += 1
        if key in self._entries:
            self.num_tokens -= self._entries.pop(key).shape[-2]
        self._entries[key] = rows
        self.num_tokens += rows.shape[-2]
        while self.num_tokens > self.capacity_tokens and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self.num_tokens -= old.shape[-2]
