"""Drafting from the context: prompt lookup, alone or mixed into a draft model.

Language models copy. A summary repeats its article, an answer its question, a translation
the names of its source, code its own identifiers. Prompt lookup decoding (Spec-Bench's PLD)
drafts the token that followed the longest earlier occurrence of the context's suffix
(``drafters.context``); SAM-Decoding (arXiv 2411.10666) pairs such retrieval with a draft
model. draftctl offers both, as drafter specs:

- ``lookup``: a chain of looked-up tokens and no model, so drafting is free; the round ends
  where nothing earlier continues the context. Its draft distribution is deterministic (the
  looked-up token), so sampling accepts it with probability ``p(token)``; the records describe
  the continuations' shares.
- ``model+lookup``: the draft model's distribution mixed with the looked-up token,
  ``q' = (1 - w) q + w 1[token]``, where ``w`` depends on the match length (``LookupConfig``).
  ``q'`` is the distribution the draft token is drawn from (its argmax when greedy), so the
  verification rule and its losslessness are those of any draft.

Both take options after commas: ``model+lookup,max_ngram=4,weight=0.6``.

The default weights were chosen on dev prompts (Spec-Bench's and draftctl's dev splits, 4 per
task group, the built-in target and its feature draft, 2026-12-02). There a one-token match
named the target's next greedy token 0.26 of the time and a longer one 0.74 (found at 25% and
54% of the output positions); the first draft token agreed with the target 0.34 of the time
for the draft alone, 0.47 for lookup alone, and 0.57 mixed with weights 0.2 (one-token
matches) and 0.5 (longer): 0.55 with 0 and 0.5, 0.54 with 0.5 and 0.5.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from draftctl.controllers.base import Controller
from draftctl.decode.features import SequenceState
from draftctl.drafters.base import Draft, Picked, Stateless, draft_chain, looked_up
from draftctl.drafters.context import LookupConfig, Match
from draftctl.errors import DraftctlError

LOOKUP = "lookup"  # the drafter spec of lookup alone
MODEL_LOOKUP = "model+lookup"  # the draft model mixed with lookup


class LookupDrafter(Stateless):
    """Proposes the chain of tokens that context lookup finds, with no draft model."""

    tree = False

    def __init__(self, vocab_size: int, config: LookupConfig | None = None,
                 token_classes: torch.Tensor | None = None):
        self.vocab_size = vocab_size
        self.config = config or LookupConfig()
        self.token_classes = token_classes

    def propose(self, seq: torch.Tensor, budget: int, controller: Controller,
                state: SequenceState, generator: torch.Generator) -> Draft:
        def pick_next(previous: torch.Tensor | None, match: Match | None) -> Picked | None:
            return None if match is None else looked_up(match, self.vocab_size, seq.device,
                                                        self.token_classes)

        return draft_chain(pick_next, seq, budget, controller, state, self.config,
                           self.vocab_size)

    def continuations(self, seq: torch.Tensor, n_prompt: int, k: int,
                      hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        raise DraftctlError("dense traces need a draft that proposes after every prefix; "
                            "collect lookup drafts with --mode probe or policy")


def parse_lookup(spec: str) -> LookupConfig:
    """``lookup[,key=value,...]`` or ``model+lookup[,key=value,...]`` (keys: the
    ``LookupConfig`` fields) -> its config."""
    name, *options = spec.split(",")
    if name not in (LOOKUP, MODEL_LOOKUP):
        raise DraftctlError(f"not a lookup drafter spec: {spec!r}")
    types = {f.name: f.type for f in fields(LookupConfig)}
    settings = {}
    for option in options:
        key, _, value = option.partition("=")
        try:
            settings[key] = (int if types[key] == "int" else float)(value)
        except (KeyError, ValueError):
            raise DraftctlError(f"drafter spec {spec!r}: {option!r} is not key=number with a "
                                f"key among {', '.join(types)}") from None
    return LookupConfig(**settings)


def lookup_kind(spec: str | None) -> str | None:
    """``lookup`` or ``model+lookup`` for a lookup drafter spec (options after commas), else
    None."""
    kind = spec.split(",")[0] if spec is not None else None
    return kind if kind in (LOOKUP, MODEL_LOOKUP) else None


def is_lookup(spec: str | None) -> bool:
    return lookup_kind(spec) is not None
