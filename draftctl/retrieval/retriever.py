"""REST lookup: the longest suffix of the context found in the datastore, the continuations
of its occurrences, and a trie of the most frequent ones (methods.md section 4)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from draftctl.errors import DraftctlError
from draftctl.retrieval.datastore import SEPARATOR, Datastore


@dataclass(frozen=True)
class RetrievalConfig:
    max_match: int = 16  # longest context suffix tried
    min_match: int = 2  # shortest
    max_occurrences: int = 5000  # occurrences whose continuations enter the trie
    max_depth: int = 10  # continuation length
    max_nodes: int = 64  # trie nodes kept (the most frequent prefixes)

    def __post_init__(self) -> None:
        if not 1 <= self.min_match <= self.max_match:
            raise DraftctlError(f"need 1 <= min_match <= max_match, got {self.min_match} and "
                                f"{self.max_match}")
        for name in ("max_occurrences", "max_depth", "max_nodes"):
            if getattr(self, name) < 1:
                raise DraftctlError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class Candidates:
    """A trie of draft continuations, parents before children.

    tokens, parents (index into these arrays, -1 under the root), depths (1-based) and counts
    (occurrences sharing the prefix), one entry per node; match_len: length of the context
    suffix found; occurrences: how many continuations were counted; lookup_s: time taken.
    """

    tokens: np.ndarray
    parents: np.ndarray
    depths: np.ndarray
    counts: np.ndarray
    match_len: int = 0
    occurrences: int = 0
    lookup_s: float = 0.0

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def empty(cls) -> Candidates:
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z, z, z)

    def select(self, keep: np.ndarray) -> Candidates:
        """The nodes where ``keep`` is true (a kept node's parent must be kept too)."""
        index = np.flatnonzero(keep)
        position = np.full(len(self) + 1, -1)
        position[index] = np.arange(len(index))
        parents = self.parents[index]
        if (parents >= 0).any() and (position[parents[parents >= 0]] < 0).any():
            raise ValueError("select() would keep a node without its parent")
        return Candidates(self.tokens[index], position[parents], self.depths[index],
                          self.counts[index], self.match_len, self.occurrences, self.lookup_s)


def build_trie(rows: np.ndarray, max_nodes: int) -> Candidates:
    """The ``max_nodes`` most frequent prefixes of ``rows`` (n, depth) as a trie; -1 pads
    rows that end early. Ties go to the shallower node, so every kept node's parent is kept
    and comes first."""
    if rows.size == 0:
        return Candidates.empty()
    ordered = rows[np.lexsort(rows.T[::-1])]
    n, depth = ordered.shape
    differs = np.logical_or.accumulate(ordered[1:] != ordered[:-1], axis=1)
    tokens, parents, depths, counts = [], [], [], []
    previous_starts, previous_ids, offset = None, None, 0
    for d in range(depth):
        new = np.ones(n, dtype=bool)
        new[1:] = differs[:, d]
        starts = np.flatnonzero(new)
        ids = offset + np.arange(len(starts))
        if previous_starts is None:
            parent = np.full(len(starts), -1)
        else:
            parent = previous_ids[np.searchsorted(previous_starts, starts, side="right") - 1]
        tokens.append(ordered[starts, d])
        parents.append(parent)
        depths.append(np.full(len(starts), d + 1))
        counts.append(np.diff(np.r_[starts, n]))
        previous_starts, previous_ids, offset = starts, ids, offset + len(starts)
    tokens, parents = np.concatenate(tokens), np.concatenate(parents)
    depths, counts = np.concatenate(depths), np.concatenate(counts)
    valid = np.flatnonzero(tokens >= 0)  # a -1 node ends its row; nothing hangs below it
    keep = valid[np.lexsort((depths[valid], -counts[valid]))[:max_nodes]]
    position = np.full(len(tokens), -1)
    position[keep] = np.arange(len(keep))
    kept_parents = np.where(parents[keep] >= 0, position[np.maximum(parents[keep], 0)], -1)
    return Candidates(tokens[keep], kept_parents, depths[keep], counts[keep])


class Retriever:
    """Draft candidates for a context from a datastore."""

    def __init__(self, datastore: Datastore, config: RetrievalConfig | None = None):
        self.datastore = datastore
        self.config = config or RetrievalConfig()

    def lookup(self, context: Sequence[int], max_depth: int | None = None) -> Candidates:
        """The trie for the longest context suffix (``max_match`` down to ``min_match``
        tokens) that occurs in the datastore; empty when none does."""
        start = time.perf_counter()
        cfg, data = self.config, self.datastore
        depth = min(cfg.max_depth, max_depth if max_depth is not None else cfg.max_depth)
        tail = np.asarray(context[-cfg.max_match:], dtype=np.int64)
        found = None
        if depth > 0:
            for length in range(min(cfg.max_match, len(tail)), cfg.min_match - 1, -1):
                lo, hi = data.find(tail[-length:])
                if hi > lo:
                    found = (length, lo, min(hi, lo + cfg.max_occurrences))
                    break
        if found is None:
            empty = Candidates.empty()
            empty.lookup_s = time.perf_counter() - start
            return empty
        length, lo, hi = found
        begin = np.asarray(data.suffix_array[lo:hi], dtype=np.int64) + length
        index = begin[:, None] + np.arange(depth)
        rows = data.tokens[np.minimum(index, len(data) - 1)].astype(np.int64)
        ended = (index >= len(data)) | (rows == SEPARATOR)
        rows[np.logical_or.accumulate(ended, axis=1)] = -1
        trie = build_trie(rows, cfg.max_nodes)
        trie.match_len, trie.occurrences = length, hi - lo
        trie.lookup_s = time.perf_counter() - start
        return trie
