"""Greedy decoding with retrieval (REST) drafts: a trie of candidates verified in one target
pass under a tree attention mask.

Each round: look up the context in the datastore (``Retriever``), feed the last token and every
trie node to the target at once, each node attending to the cached sequence, the last token
and its own ancestors, at position ``len(seq) - 1 + depth``. Walking from the root, a node is
accepted while its token is the target's argmax after its parent; the argmax after the last
accepted node is the bonus token. Only the accepted path's keys and values stay in the cache.
The output is token-identical to plain greedy decoding. Sampling is refused: a lossless
multi-candidate rule for trie drafts is not implemented.

Controllers: the round's budget (``max_draft``) caps the trie's depth; a controller that reads
features then prunes the trie node by node (``draftctl.retrieval.features.prune``), each node
described by the trie's own distribution and the retrieval features.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from draftctl.controllers.base import Controller
from draftctl.controllers.rules import ReferenceOracle
from draftctl.decode.cached_lm import CachedLM, PassShape
from draftctl.decode.features import SequenceState
from draftctl.decode.loop import DecodeConfig, RoundRecord, SpeculativeDecoder
from draftctl.errors import DecodeInputError
from draftctl.models import LoadedModel
from draftctl.retrieval.features import accepted_mask, prune, trie_records, tried_chain
from draftctl.retrieval.retriever import Candidates, Retriever


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


class RetrievalDecoder:
    """Batch-size-1 greedy decoder whose drafts come from a ``Retriever``.

    Every controller but the oracle applies: its budget caps the trie depth (``static:K``)
    and, if it reads features, it prunes the trie node by node.
    """

    drafter = None

    def __init__(self, target: torch.nn.Module, retriever: Retriever, *, vocab_size: int,
                 eos_ids: Sequence[int], context_length: int, config: DecodeConfig | None = None):
        self.config = config or DecodeConfig()
        if not self.config.sampling.greedy:
            raise DecodeInputError(
                "retrieval drafting verifies a trie of candidates, and draftctl has no lossless "
                "multi-candidate sampling rule for it: use greedy decoding (temperature 0)")
        self.target = CachedLM(target, vocab_size, PassShape())  # see the module docstring
        self.retriever = retriever
        self.vocab_size = vocab_size
        self.eos_ids = frozenset(eos_ids)
        self.context_length = context_length
        self.device = next(target.parameters()).device

    @classmethod
    def from_loaded(cls, target: LoadedModel, retriever: Retriever,
                    config: DecodeConfig | None = None) -> RetrievalDecoder:
        return cls(target.model, retriever, vocab_size=len(target.tokenizer),
                   eos_ids=target.eos_token_ids, context_length=target.context_length,
                   config=config)

    check_prompt = SpeculativeDecoder.check_prompt

    def rounds(self, prompt_ids: Sequence[int], controller: Controller,
               seed: int | None = None) -> Iterator[RoundRecord]:
        if isinstance(controller, ReferenceOracle):
            raise DecodeInputError("the oracle follows a model draft's chain; it does not "
                                   "apply to retrieval drafts")
        self.check_prompt(prompt_ids)
        cfg = self.config
        seq = list(prompt_ids)
        self.target.reset()
        controller.reset()
        if len(seq) > 1:
            self.target.prefill(torch.tensor(seq[:-1], device=self.device))
        produced, index = 0, 0
        state = SequenceState(len(seq))
        while produced < cfg.max_new_tokens and len(seq) < self.context_length:
            budget = min(controller.max_draft(), cfg.max_draft,
                         cfg.max_new_tokens - produced - 1, self.context_length - len(seq) - 1)
            trie = self.retriever.lookup(seq, max_depth=budget) if budget > 0 \
                else Candidates.empty()
            start = time.perf_counter()
            records = trie_records(trie, state)
            calls = 0
            if controller.reads_features and len(trie):
                keep, calls = prune(records, trie.parents.tolist(), controller)
                trie = trie.select(keep)
                records = [r for r, kept in zip(records, keep) if kept]
            controller_s = time.perf_counter() - start
            start = time.perf_counter()
            path, argmax = self._verify(seq, trie)
            verify_s = time.perf_counter() - start
            parents = trie.parents.tolist()
            new = [int(t) for t in trie.tokens[path]] + [argmax[path[-1] + 1 if path else 0]]
            eos_at = next((i for i, t in enumerate(new) if t in self.eos_ids), None)
            if eos_at is not None:
                new = new[: eos_at + 1]
            on_path = set(path)
            yield RoundRecord(
                index=index, draft_tokens=trie.tokens.tolist(), features=records,
                n_accepted=len(path),
                accept_prob=[float(k in on_path) for k in range(len(trie))], beta=[],
                target_argmax=[argmax[p + 1] for p in parents], new_tokens=new, discarded=0,
                draft_forwards=0, draft_time_s=trie.lookup_s, verify_time_s=verify_s,
                controller_time_s=controller_s, controller_calls=calls, tree_parents=parents)
            controller.observe([records[k] for k in tried_chain(path, parents)], len(path))
            seq += new
            produced += len(new)
            index += 1
            state = state.after_round(len(seq), len(trie), len(path))
            if eos_at is not None:
                return

    def _verify(self, seq: list[int], trie: Candidates) -> tuple[list[int], list[int]]:
        """One target pass over the last token and the trie; keeps the accepted path's cache
        entries. Returns the accepted node indices and the target's argmax after the root
        (index 0) and after each node (index k + 1)."""
        cached = len(seq) - 1
        last = torch.tensor([seq[-1]], device=self.device)
        if len(trie) == 0:
            return [], [int(self.target.forward(last, last_only=True)[0].argmax())]
        tokens = torch.cat([last, torch.as_tensor(trie.tokens, device=self.device)])
        positions = cached + torch.as_tensor(np.r_[0, trie.depths], device=self.device)
        allowed = torch.cat([torch.ones(len(tokens), cached, dtype=torch.bool),
                             tree_pattern(trie.parents)], dim=1).to(self.device)
        argmax = self.target.forward_masked(tokens, positions, allowed).argmax(dim=-1).tolist()
        path = accepted_path(trie.tokens, trie.parents, argmax)
        self.target.keep(cached, [0] + [k + 1 for k in path])
        return path, argmax
