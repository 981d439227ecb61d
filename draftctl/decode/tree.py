"""Greedy verification of tree drafts (REST tries): every candidate in one target pass under a
tree attention mask.

The last token and every trie node go to the target at once, each node attending to the
cached sequence, the last token and its own ancestors, at position ``len(seq) - 1 + depth``.
Walking from the root, a node is accepted while its token is the target's argmax after its
parent; the argmax after the last accepted node is the bonus token. Only the accepted path's
keys and values stay in the cache. Sampling is refused (``SpeculativeDecoder``): a lossless
multi-candidate rule for trie drafts is not implemented.

Exactness: the greedy rule is plain decoding's, but the tree pass is not bit-exact with it. A
node's ancestors sit at scattered cache slots among masked siblings, so attention sums their
keys in another order than a chain would, and a fixed pass shape cannot fix that (nor would
chunking a 65-node trie into passes of M rows pay). Tree passes therefore run unpadded, in one
pass of nodes + 1 rows. In float32 the logits differ in the last bits (outputs almost always
equal plain decoding's); in bfloat16 a near tie can flip a greedy choice. ``bench`` counts
these outputs apart from the bit-exact chain drafters' (``tree_mismatches``).
"""

from __future__ import annotations

import numpy as np
import torch

from draftctl.decode.cached_lm import CachedLM, PassShape
from draftctl.retrieval.features import accepted_mask


def tree_pattern(parents: np.ndarray) -> torch.Tensor:
    """(n + 1, n + 1) bool: row i may attend to column j. Index 0 is the root (the last
    sequence token), node k is index k + 1; parents are given before children."""
    n = len(parents)
    allowed = torch.eye(n + 1, dtype=torch.bool)
    allowed[:, 0] = True
    for k, parent in enumerate(parents.tolist()):
        allowed[k + 1] |= allowed[parent + 1]
    return allowed


def accepted_path(tokens: np.ndarray, parents: np.ndarray, argmax: list[int]) -> list[int]:
    """Greedy walk: node indices accepted from the root, given the target's argmax at the
    root (``argmax[0]``) and after each node (``argmax[k + 1]``). Parents come before their
    children, so the accepted nodes in index order are the path."""
    parents = parents.tolist()
    match = [t == argmax[p + 1] for t, p in zip(tokens.tolist(), parents)]
    return np.flatnonzero(accepted_mask(parents, match)).tolist()


@torch.inference_mode()
def verify_tree(target: CachedLM, seq: torch.Tensor, tokens: torch.Tensor,
                parents: list[int]) -> tuple[list[int], list[int]]:
    """One target pass over the last token of ``seq`` and every node of a trie (``tokens``,
    ``parents``), unpadded (see the module docstring); keeps the accepted path's cache
    entries. Returns the accepted node indices and the target's argmax after the root
    (index 0) and after each node (index k + 1)."""
    cached = len(seq) - 1
    device = seq.device
    parent_array = np.asarray(parents, dtype=np.int64)
    depths = np.zeros(len(parents), dtype=np.int64)
    for k, parent in enumerate(parents):
        depths[k] = 1 + (depths[parent] if parent >= 0 else 0)
    fed = torch.cat([seq[-1:], tokens])
    positions = cached + torch.as_tensor(np.r_[0, depths], device=device)
    allowed = torch.cat([torch.ones(len(fed), cached, dtype=torch.bool),
                         tree_pattern(parent_array)], dim=1).to(device)
    logits = target.forward_masked(fed, positions, allowed, shape=PassShape())
    argmax = logits.argmax(dim=-1).tolist()
    path = accepted_path(tokens.cpu().numpy(), parent_array, argmax)
    target.keep(cached, [0] + [k + 1 for k in path])
    return path, argmax
