"""Context lookup: what the sequence itself says comes next (``drafters.lookup`` drafts
with it).

A match is the longest suffix of the context, of at most ``max_ngram`` tokens, that occurred
earlier; among its earlier occurrences the most frequent next token wins (ties: the latest).
Its length, its number of occurrences and the share of them that the drafted token follows
fill the record's ``suffix_len``, ``occurrences``, ``node_share`` and ``token_share``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from draftctl.errors import DraftctlError


@dataclass(frozen=True)
class LookupConfig:
    max_ngram: int = 6  # the longest context suffix matched
    min_ngram: int = 1  # shorter matches are ignored
    # the looked-up token's weight in the mixture with a draft model, for a one-token match
    # and for longer ones (chosen on dev prompts, see ``drafters.lookup``)
    weight_unigram: float = 0.2
    weight: float = 0.5
    # > 0: a round whose first token matches at least this many tokens is drafted by lookup
    # alone, without a draft model step (free), while anything matches
    alone: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise DraftctlError(f"lookup needs 1 <= min_ngram <= max_ngram, got "
                                f"min_ngram={self.min_ngram}, max_ngram={self.max_ngram}")
        if self.alone < 0:
            raise DraftctlError(f"lookup alone must be >= 0 (0: never), got {self.alone}")
        for name in ("weight_unigram", "weight"):
            if not 0 <= getattr(self, name) <= 1:
                raise DraftctlError(f"lookup {name} must be in [0, 1], got "
                                    f"{getattr(self, name)}")

    def weight_of(self, length: int) -> float:
        return self.weight_unigram if length == 1 else self.weight


@dataclass(frozen=True)
class Match:
    """The looked-up next token. length: tokens of the context suffix matched; following:
    the token after each earlier occurrence of that suffix, oldest first."""

    token: int
    length: int
    following: np.ndarray

    @property
    def occurrences(self) -> int:
        return len(self.following)

    def share(self, token: int) -> float:
        """Share of the occurrences that ``token`` follows."""
        return float((self.following == token).mean())

    def stats(self, token: int) -> list[float]:
        """The ``LOOKUP_STATS`` columns of a drafted ``token``: suffix_len, occurrences and
        its share."""
        return [float(self.length), float(self.occurrences), self.share(token)]


def find_match(context: np.ndarray, config: LookupConfig) -> Match | None:
    """The longest earlier occurrence(s) of the suffix of ``context`` (1-D int array) and the
    token that most often follows them, or None."""
    last = len(context) - 1
    if last < 1:
        return None
    ends = np.flatnonzero(context[:last] == context[last])  # each occurrence's last position
    length = 1
    while len(ends) and length < config.max_ngram:
        longer = ends[(ends >= length)]
        longer = longer[context[longer - length] == context[last - length]]
        if not len(longer):
            break
        ends, length = longer, length + 1
    if not len(ends) or length < config.min_ngram:
        return None
    following = context[ends + 1]
    values, counts = np.unique(following, return_counts=True)
    winners = values[counts == counts.max()]
    token = next(int(t) for t in following[::-1] if t in winners)
    return Match(token, length, following)


class Context:
    """The sequence a drafter looks up in: the verified tokens plus the round's drafts."""

    def __init__(self, tokens: list[int], config: LookupConfig):
        self.tokens = tokens
        self.config = config

    def push(self, token: int) -> None:
        self.tokens.append(token)

    def match(self) -> Match | None:
        return find_match(np.asarray(self.tokens), self.config)
