"""The drafter protocol: what the round loop asks of any source of draft tokens.

A drafter proposes a draft for the sequence so far (a chain, or a tree of candidates with
each token's parent) with the feature record of every token, asking the controller as it goes,
and hears the verification result: how long the sequence now is, and, when it asks for them,
the target's hidden states at the newly verified positions. The loop never asks which drafter
it holds; it verifies a chain in one pass and a tree under a tree attention mask.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from draftctl.controllers.base import Action, Controller
from draftctl.decode.features import (
    LOOKUP_STATS,
    STATS,
    FeatureRecord,
    SequenceState,
    draft_stats,
    make_record,
)
from draftctl.decode.verify import SamplingConfig
from draftctl.drafters.context import Context, LookupConfig, Match
from draftctl.errors import DraftctlError


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


@dataclass
class Picked:
    """Draft tokens chosen from a model's logits, one row each.

    tokens: (n,) vocabulary ids. raw: (n, V) the temperature-1 draft distribution (features,
    beta). q: (n, V) the processed distribution the tokens were drawn from: None when a model
    drafts greedily, one-hot for a looked-up token (``looked_up``). stats: (n, STATS) their
    ``draft_stats`` rows.
    """

    tokens: torch.Tensor
    raw: torch.Tensor
    q: torch.Tensor | None
    stats: torch.Tensor


class TokenPicker:
    """How a model drafter turns logits into draft tokens: the argmax, or a sample of the
    processed distribution, over the vocabulary or a head of ``head_ids`` columns (q is 0 off
    the head); with ``lookup``, the distribution is first mixed with the looked-up token
    (``drafters.lookup``)."""

    def __init__(self, vocab_size: int, sampling: SamplingConfig,
                 head_ids: torch.Tensor | None = None, lookup: LookupConfig | None = None):
        self.vocab_size = vocab_size
        self.sampling = sampling
        self.head_ids = head_ids
        self.lookup = lookup

    def full(self, probs: torch.Tensor) -> torch.Tensor:
        """(n, W) head probabilities -> (n, V), 0 off the head (as they are)."""
        if self.head_ids is None:
            return probs
        full = probs.new_zeros((probs.shape[0], self.vocab_size))
        full[:, self.head_ids] = probs
        return full

    def pick(self, logits: torch.Tensor, generator: torch.Generator | None,
             classes: torch.Tensor | None, matches: Sequence[Match | None] = (),
             greedy: bool | None = None) -> Picked:
        """Tokens for (n, W) logits; ``matches``: each row's lookup (None: nothing found), or
        () without lookup; ``greedy`` overrides the sampling config (dense traces)."""
        greedy = self.sampling.greedy if greedy is None else greedy
        probs = torch.softmax(logits.float(), dim=-1)
        q = None if greedy else self.sampling.probs(logits)
        if not any(m is not None for m in matches):
            index = logits.argmax(dim=-1) if greedy else \
                torch.multinomial(q, 1, generator=generator)[:, 0]
            tokens = index if self.head_ids is None else self.head_ids[index]
            return Picked(tokens, self.full(probs), None if q is None else self.full(q),
                          draft_stats(probs, index, tokens, classes))
        # q' = (1 - w) q + w 1[looked-up token], row by row (w = 0 where nothing matched)
        weight = torch.tensor([[self.lookup.weight_of(m.length) if m else 0.0]
                               for m in matches], device=logits.device)
        found = torch.tensor([[m.token if m else 0] for m in matches], device=logits.device)
        raw = (1 - weight) * self.full(probs)
        raw.scatter_add_(1, found, weight)
        if q is not None:
            q = (1 - weight) * self.full(q)
            q.scatter_add_(1, found, weight)
        tokens = raw.argmax(dim=-1) if greedy else \
            torch.multinomial(q, 1, generator=generator)[:, 0]
        chosen = tokens.tolist()
        lookup = torch.tensor([m.stats(t) if m else [0.0] * LOOKUP_STATS
                               for m, t in zip(matches, chosen)], device=logits.device)
        return Picked(tokens, raw, q, draft_stats(raw, tokens, tokens, classes, lookup))


def looked_up(match: Match, vocab_size: int, device: torch.device,
              classes: torch.Tensor | None) -> Picked:
    """The looked-up token as a draft token of its own: q = 1 there; its record describes the
    shares of the continuations (its statistics are read from the few tokens that follow,
    the rest of the vocabulary having share 0)."""
    values, counts = np.unique(match.following, return_counts=True)
    ids = torch.as_tensor(values, device=device)
    share = torch.as_tensor(counts / counts.sum(), dtype=torch.float32, device=device)[None]
    shares = torch.zeros((1, vocab_size), device=device)
    shares[0, ids] = share[0]
    token = torch.tensor([match.token], device=device)
    q = torch.zeros_like(shares)
    q[0, match.token] = 1.0
    column = torch.tensor([int(np.searchsorted(values, match.token))], device=device)
    lookup = torch.tensor([match.stats(match.token)], device=device)
    return Picked(token, shares, q, draft_stats(share, column, token, classes, lookup))


def draft_chain(pick_next: Callable[[torch.Tensor | None, Match | None], Picked | None],
                seq: torch.Tensor, budget: int, controller: Controller, state: SequenceState,
                lookup: LookupConfig | None, vocab_size: int,
                classes: torch.Tensor | None = None) -> Draft:
    """A chain of at most ``budget`` draft tokens after ``seq``, asking the controller after
    each. ``pick_next(previous, match)``: the next draft token after the draft's ``previous``
    token ((1,) long; None for the round's first), given what a context ``lookup`` found
    there (None without lookup or when nothing matched); None ends the chain. A round whose
    first match is at least ``lookup.alone`` tokens long is drafted by lookup alone
    (``looked_up``, tokens of ``classes``), without calling ``pick_next``."""
    context = Context(seq.tolist(), lookup) if lookup is not None else None
    tokens, raw, q_rows, stats, records = [], [], [], [], []
    controller_s, calls, discarded = 0.0, 0, 0
    token, alone = None, False
    for i in range(budget):
        match = context.match() if context is not None else None
        if i == 0:
            alone = bool(lookup and lookup.alone and match and match.length >= lookup.alone)
        if alone:
            picked = looked_up(match, vocab_size, seq.device, classes) if match else None
        else:
            picked = pick_next(token, match)
        if picked is None:
            break
        token = picked.tokens
        action = Action.CONTINUE
        if controller.reads_features:
            action, record, seconds = ask_controller(
                controller, picked.stats, i + 1, records[-1] if records else None, state, token)
            controller_s += seconds
            calls += 1
            if action is Action.DISCARD:
                discarded = 1
                break
            records.append(record)
        tokens.append(token)
        raw.append(picked.raw)
        stats.append(picked.stats)
        if picked.q is not None:
            q_rows.append(picked.q)
        if action is Action.STOP:
            break
        if context is not None:
            context.push(int(token))
    if tokens:
        draft = Draft(torch.cat(tokens), torch.cat(raw), torch.cat(q_rows) if q_rows else None,
                      torch.cat(stats), records if controller.reads_features else None)
    else:
        draft = Draft.empty(vocab_size, seq.device)
    draft.discarded, draft.controller_s, draft.controller_calls = discarded, controller_s, calls
    return draft


def branch_matches(picker: TokenPicker, seq: list[int], n_prompt: int,
                   drafted: list[list[int]]) -> list[Match | None]:
    """Dense traces: the lookup of every branch, branch t continuing ``seq[:n_prompt + t]``
    with its own ``drafted[t]`` tokens; () without lookup."""
    if picker.lookup is None:
        return ()
    if picker.lookup.alone:
        raise DraftctlError("dense traces follow the draft model's chain; lookup alone "
                            "(alone=N) ends where the context stops matching: collect with "
                            "--mode probe or policy")
    return [Context(seq[:n_prompt + t] + drafts, picker.lookup).match()
            for t, drafts in enumerate(drafted)]


class Stateless:
    """For drafters without a model: nothing to reset, no target states to read."""

    hidden_layers: tuple[int, ...] = ()
    forwards = 0

    def reset(self) -> None:
        pass

    def accepted(self, length: int, hidden: torch.Tensor | None = None) -> None:
        pass


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
