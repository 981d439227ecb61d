"""REST drafts behind the drafter protocol: a trie of datastore continuations per round.

The round's budget caps the trie's depth; a controller that reads features then prunes it
node by node (``draftctl.retrieval.features.prune``), each node described by the trie's own
distribution and the retrieval features. The lookup and the pruning count as draft time.
"""

from __future__ import annotations

import time

import torch

from draftctl.controllers.base import Controller
from draftctl.decode.features import SequenceState
from draftctl.drafters.base import Draft, Stateless
from draftctl.retrieval.features import prune, trie_records
from draftctl.retrieval.retriever import Retriever


class RetrievalDrafter(Stateless):
    """Proposes the trie ``retriever`` finds for the context; greedy only."""

    tree = True

    def __init__(self, retriever: Retriever, token_classes: torch.Tensor | None = None):
        self.retriever = retriever
        self.token_classes = token_classes

    def propose(self, seq: torch.Tensor, budget: int, controller: Controller,
                state: SequenceState, generator: torch.Generator) -> Draft:
        trie = self.retriever.lookup(seq.tolist(), max_depth=budget)
        start = time.perf_counter()
        records = trie_records(trie, state, self.token_classes)
        calls = 0
        if controller.reads_features and len(trie):
            keep, calls = prune(records, trie.parents.tolist(), controller)
            trie = trie.select(keep)
            records = [r for r, kept in zip(records, keep) if kept]
        return Draft(torch.as_tensor(trie.tokens, dtype=torch.long, device=seq.device), None,
                     None, None, records, parents=trie.parents.tolist(),
                     controller_s=time.perf_counter() - start, controller_calls=calls)
