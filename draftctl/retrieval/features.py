"""Controllers on retrieval drafts: a feature record per trie node, and pruning by controller.

A trie has no draft model, but its counts give a deterministic draft distribution: below a
node (or the root), ``q(child) = count(child) / count(node)``, the rest of the mass being
continuations that end there or were cut from the trie. A node's record carries that
distribution at its parent (entropy, top probabilities, ``cum_top1`` along its path) and the
retrieval features of ``FeatureRecord``, so every controller reads a trie node as it reads a
drafted token, and a learned controller can be fitted on retrieval traces.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from draftctl.controllers.base import Action, Controller
from draftctl.decode.features import TOP_K, FeatureRecord, SequenceState
from draftctl.retrieval.retriever import Candidates


def _children_stats(shares: np.ndarray) -> tuple[float, tuple[float, ...]]:
    """Entropy (nats, the leftover mass as one outcome) and top-``TOP_K`` of a node's
    children distribution."""
    q = np.sort(shares)[::-1]
    probs = np.r_[q, max(0.0, 1.0 - float(q.sum()))]
    probs = probs[probs > 0]
    entropy = float(-(probs * np.log(probs)).sum())
    top = np.zeros(TOP_K)
    top[:min(TOP_K, len(q))] = q[:TOP_K]
    return entropy, tuple(float(x) for x in top)


def trie_records(trie: Candidates, state: SequenceState,
                 token_classes=None) -> list[FeatureRecord]:
    """One record per node of ``trie``, in its order (parents before children); the tokens'
    classes from ``token_classes`` (V,), or unknown."""
    if len(trie) == 0:
        return []
    counts = trie.counts.astype(np.float64)
    parents = trie.parents
    total = float(max(trie.occurrences, int(counts[parents < 0].sum()), 1))
    parent_count = np.where(parents >= 0, counts[np.maximum(parents, 0)], total)
    token_share = counts / parent_count
    children: dict[int, list[int]] = {}
    for k, parent in enumerate(parents.tolist()):
        children.setdefault(parent, []).append(k)
    stats = {parent: _children_stats(token_share[kids]) for parent, kids in children.items()}
    classes = token_classes[np.asarray(trie.tokens)].tolist() if token_classes is not None \
        else [-1] * len(parents)
    records: list[FeatureRecord] = []
    for k, parent in enumerate(parents.tolist()):
        entropy, top = stats[parent]
        above = records[parent] if parent >= 0 else None
        cum = (above.cum_top1 if above else 1.0) * top[0]
        log_q = (above.cum_logq if above else 0.0) + float(np.log(token_share[k]))
        depth = int(trie.depths[k])
        records.append(FeatureRecord(
            draft_pos=depth, seq_pos=state.seq_len + depth - 1, entropy=entropy,
            top_probs=top, cum_top1=cum, prev_accepted=state.prev_accepted,
            prev_drafted=state.prev_drafted, accept_rate=state.accept_rate, cum_logq=log_q,
            target_entropy=state.target_entropy, token_class=int(classes[k]),
            suffix_len=trie.match_len, occurrences=trie.occurrences,
            node_share=float(counts[k] / total), token_share=float(token_share[k])))
    return records


def depth_first(parents: Sequence[int]) -> list[int]:
    """Node indices in depth-first preorder (siblings in index order): each node comes after
    its parent, and a subtree is finished before its next sibling starts."""
    children: list[list[int]] = [[] for _ in parents]
    roots = []
    for k, parent in enumerate(parents):
        (children[parent] if parent >= 0 else roots).append(k)
    order, stack = [], roots[::-1]
    while stack:
        k = stack.pop()
        order.append(k)
        stack.extend(reversed(children[k]))
    return order


def prune(records: Sequence[FeatureRecord], parents: Sequence[int], controller: Controller,
          eligible: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """Ask ``controller`` about each node, depth first (so a controller that multiplies
    scores along a branch sees each branch as a chain). ``DISCARD`` drops the node and its
    subtree, ``STOP`` keeps the node but not its children, ``CONTINUE`` keeps it; nodes below
    a dropped or stopped node are not asked, nor are nodes outside ``eligible`` (e.g. below a
    depth cap), which are dropped. Returns (keep mask, decide calls)."""
    n = len(records)
    keep = np.zeros(n, dtype=bool)
    grows = np.zeros(n, dtype=bool)  # may have children
    calls = 0
    for k in depth_first(parents):
        parent = parents[k]
        if (parent >= 0 and not grows[parent]) or (eligible is not None and not eligible[k]):
            continue
        calls += 1
        action = controller.decide(records[k])
        if action is Action.DISCARD:
            continue
        keep[k] = True
        grows[k] = action is Action.CONTINUE
    return keep, calls


def accepted_mask(parents: Sequence[int], match: Sequence[bool],
                  keep: np.ndarray | None = None) -> np.ndarray:
    """The accepted path as a mask: nodes (among ``keep``) whose token is the target's argmax
    after their parent (``match``) and whose parent is accepted or the root."""
    accepted = np.zeros(len(parents), dtype=bool)
    for k, parent in enumerate(parents):
        accepted[k] = ((keep is None or keep[k]) and match[k]
                       and (parent < 0 or accepted[parent]))
    return accepted


def tried_chain(path: Sequence[int], parents: Sequence[int],
                kept: np.ndarray | None = None) -> list[int]:
    """The accepted path plus, if the walk stopped at a node with (kept) children, its first
    child (the most frequent continuation, which the target rejected): what a chain
    controller's ``observe`` hears, as if that chain had been drafted."""
    below = path[-1] if path else -1
    rejected = next((k for k, p in enumerate(parents)
                     if p == below and (kept is None or kept[k])), None)
    return list(path) + ([rejected] if rejected is not None else [])
