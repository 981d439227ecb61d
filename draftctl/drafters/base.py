"""The drafter protocol: what the round loop asks of any source of draft tokens.

A drafter proposes a draft for the sequence so far (a chain, or a tree of candidates with
each token's parent) with the feature record of every token, asking the controller as it goes,
and hears the verification result: how long the sequence now is, and, when it asks for them,
the target's hidden states at the newly verified positions. The loop never asks which drafter
it holds; it verifies a chain in one pass and a tree under a tree attention mask.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from draftctl.controllers.base import Action, Controller
from draftctl.decode.features import STATS, FeatureRecord, SequenceState, make_record


def ask_controller(controller: Controller, stat: torch.Tensor, depth: int,
                   previous: FeatureRecord | None, state: SequenceState,
                   token: torch.Tensor) -> tuple[Action, FeatureRecord, float]:
    """The controller's verdict on the drafted ``token`` at ``depth`` (1-based) of a chain:
    (action, the token's feature record, seconds the decision took). stat: (1, STATS), its
    ``draft_stats`` row; previous: the record of the token before it in the round."""
    record = make_record(stat[0].tolist(), depth, previous, state)
    if controller.reads_tokens:
        controller.see_token(int(token))
    start = time.perf_counter()
    action = controller.decide(record)
    return action, record, time.perf_counter() - start


@dataclass
class Draft:
    """One round's proposal.

    tokens: (k,) long on the device. parents: None for a chain; for a tree, each token's
    parent index (-1: under the root), parents before children. raw_probs: (k, V)
    temperature-1 softmax (features, beta in greedy mode), None for drafts without a
    distribution (trees). q_draft: (k, V) processed distribution the tokens were sampled from,
    or None in greedy mode. stats: (k, STATS) ``draft_stats`` rows, or None when ``records``
    are given. records: the feature records, if built during drafting.
    """

    tokens: torch.Tensor
    raw_probs: torch.Tensor | None
    q_draft: torch.Tensor | None
    stats: torch.Tensor | None
    records: list[FeatureRecord] | None
    parents: list[int] | None = None
    forwards: int = 0
    discarded: int = 0
    controller_s: float = 0.0
    controller_calls: int = 0

    @classmethod
    def empty(cls, vocab_size: int, device: torch.device) -> Draft:
        return cls(torch.empty(0, dtype=torch.long, device=device),
                   torch.empty(0, vocab_size, device=device), None,
                   torch.empty(0, STATS, device=device), [])

    @property
    def is_tree(self) -> bool:
        return self.parents is not None


class Drafter(Protocol):
    """A source of draft tokens (the draft model, a feature-level draft, REST retrieval)."""

    #: Drafts are trees (verified under a tree mask, greedy only) rather than chains.
    tree: bool
    #: Indices of the target's hidden states ``accepted`` wants (``output_hidden_states``
    #: order: 0 is the embedding output), or () when it needs none.
    hidden_layers: tuple[int, ...]
    #: (V,) int8 class of every token id (``decode.features.token_classes``), or None: the
    #: records' token class is then unknown. The decoder sets it from the target's tokenizer.
    token_classes: torch.Tensor | None

    def reset(self) -> None:
        """Start a new sequence."""

    def propose(self, seq: torch.Tensor, budget: int, controller: Controller,
                state: SequenceState, generator: torch.Generator) -> Draft:
        """Draft at most ``budget`` tokens (tree: depth) after ``seq`` (1-D long)."""

    def accepted(self, length: int, hidden: torch.Tensor | None = None) -> None:
        """The target has now seen the first ``length`` tokens of the sequence (the round's
        correction or bonus token follows them, not yet seen); ``hidden`` (n, layers, H): its
        states at the ``n`` positions it has just seen, ``length - n .. length - 1``, when the
        drafter asks for ``hidden_layers``. Also called after the prompt's prefill."""

    def continuations(self, seq: torch.Tensor, n_prompt: int, k: int,
                      hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Chain drafters, for dense traces: the greedy ``k``-token draft ``propose`` would
        make after every prefix ``seq[:n_prompt + t]``, batched over t; ``hidden``: the
        target's states at every position but the last, for drafters that read them. Returns
        tokens (T, k) and ``draft_stats`` rows (T, k, STATS)."""

    @property
    def forwards(self) -> int:
        """Draft model calls so far (0 for drafters without a model)."""
