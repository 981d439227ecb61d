"""The feature record: what a controller knows about one drafted token.

One definition serves the decoder (which fills it), the controllers (which read it), the
collector (which writes it as a Parquet row) and the trainer (which reads the rows). Change
the fields and you must bump ``SCHEMA_VERSION``; ``FEATURE_NAMES`` fixes the vector order
that ONNX controllers take as input.

Distribution features come from the draft's softmax of its raw logits at temperature 1,
whatever the decoding mode: in greedy mode the processed distribution is one-hot and would
carry no signal (SVIP's reference code computes its entropy the same way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from draftctl.errors import DraftctlError

SCHEMA_VERSION = 3
TOP_K = 10

# Retrieval (REST) drafts only; 0 for model drafts.
RETRIEVAL_FEATURES = ("suffix_len", "occurrences", "node_share", "token_share")
# The drafted token's class (``token_classes``), one indicator each; all 0 when unknown.
TOKEN_CLASSES = ("word_start", "word_piece", "digit", "punct", "space")
TOKEN_CLASS_FEATURES = tuple(f"tok_{name}" for name in TOKEN_CLASSES)

FEATURE_NAMES: tuple[str, ...] = (
    "draft_pos",
    "seq_pos",
    "entropy",
    *(f"top_prob_{i}" for i in range(1, TOP_K + 1)),
    "margin",
    "cum_top1",
    "cum_logq",
    "target_entropy",
    "prev_accepted",
    "prev_drafted",
    "accept_rate",
    *TOKEN_CLASS_FEATURES,
    *RETRIEVAL_FEATURES,
)

# Feature groups, for ablations (drop one group at a time) and documentation.
FEATURE_GROUPS: dict[str, tuple[str, ...]] = {
    "position": ("draft_pos", "seq_pos"),
    "draft_distribution": ("entropy", *(f"top_prob_{i}" for i in range(1, TOP_K + 1)),
                           "margin"),
    "draft_path": ("cum_top1", "cum_logq"),
    "target": ("target_entropy",),
    "history": ("prev_accepted", "prev_drafted", "accept_rate"),
    "token_class": TOKEN_CLASS_FEATURES,
    "retrieval": RETRIEVAL_FEATURES,
}
assert sum(map(len, FEATURE_GROUPS.values())) == len(FEATURE_NAMES)

class SchemaMismatchError(DraftctlError):
    """Features recorded (traces) or expected (a model) under another schema version."""


def check_trace_schema(info: dict, folder) -> None:
    """Refuse traces whose ``run.json`` records another feature schema than this draftctl's."""
    version = info.get("feature_schema_version")
    if version != SCHEMA_VERSION:
        raise SchemaMismatchError(f"traces in {folder} were recorded with feature schema "
                                  f"v{version}; this draftctl reads v{SCHEMA_VERSION}: collect "
                                  "them again")


# A drafted token's statistics row (``draft_stats``): its distribution's entropy and top
# probabilities, the token's own probability, its class (-1: unknown), and what a context
# lookup found for it (``draftctl.drafters.lookup``: suffix_len, occurrences and the token's
# share of them; 0 without lookup).
LOOKUP_STATS = 3
STATS = 1 + TOP_K + 2 + LOOKUP_STATS
_LOG_FLOOR = -30.0  # log q of a token the draft gave (almost) no mass: retrieval leftovers


@dataclass(frozen=True, slots=True)
class FeatureRecord:
    """Features of one drafted token, known before the target sees it.

    draft_pos: 1-based position of the token in the current draft.
    seq_pos: number of tokens before it in the sequence (prompt included).
    entropy: full-vocabulary entropy in nats of the draft distribution at this step.
    top_probs: the ``TOP_K`` largest draft probabilities, descending (zero-padded).
    cum_top1: product of the top-1 probabilities of this and earlier tokens of the round.
    cum_logq: sum of the log draft probabilities of this and earlier drafted tokens of the
        round (their path's log-probability; ``log cum_top1`` when drafting greedily).
    target_entropy: entropy (nats, temperature 1) of the target's distribution at the last
        position it verified, the one that chose the round's first input token (0 for tree
        drafts, whose verification keeps only argmaxes).
    prev_accepted, prev_drafted: the previous round's accepted and drafted counts (0 at first).
    accept_rate: running acceptance rate of the sequence, Laplace-smoothed:
        ``(accepted + 1) / (drafted + 2)`` over earlier rounds (0.5 before any draft).
    token_class: the drafted token's class, an index into ``TOKEN_CLASSES`` (``token_classes``
        of the tokenizer), -1 when unknown; it enters the vector as ``tok_*`` indicators.

    Retrieval drafts (a trie of datastore continuations, ``draft_pos`` = node depth) have no
    draft model: their distribution is the trie's, ``q(child) = count(child) /
    count(parent)``, and the distribution features describe the children of the node's
    parent (see ``draftctl.retrieval.features``). They also fill:
    suffix_len: length of the context suffix found in the datastore.
    occurrences: how many continuations of it were counted.
    node_share: ``count(node) / occurrences``, the share of continuations through the node.
    token_share: ``count(node) / count(parent)``, the trie's q of the node's token.
    Drafts with context lookup (``draftctl.drafters.lookup``) fill the same four from the
    sequence itself: the suffix matched, its earlier occurrences, and the share of them that
    the drafted token follows (both shares; 0 where nothing matched).
    """

    draft_pos: int
    seq_pos: int
    entropy: float
    top_probs: tuple[float, ...]
    cum_top1: float
    prev_accepted: int
    prev_drafted: int
    accept_rate: float
    cum_logq: float = 0.0
    target_entropy: float = 0.0
    token_class: int = -1
    suffix_len: int = 0
    occurrences: int = 0
    node_share: float = 0.0
    token_share: float = 0.0

    @classmethod
    def from_vector(cls, values) -> FeatureRecord:
        """Inverse of ``to_vector`` (e.g. a trace row's feature columns, in order)."""
        row = dict(zip(FEATURE_NAMES, (float(x) for x in values)))
        classes = [row[name] for name in TOKEN_CLASS_FEATURES]
        return cls(
            draft_pos=int(row["draft_pos"]), seq_pos=int(row["seq_pos"]), entropy=row["entropy"],
            top_probs=tuple(row[f"top_prob_{i}"] for i in range(1, TOP_K + 1)),
            cum_top1=row["cum_top1"], prev_accepted=int(row["prev_accepted"]),
            prev_drafted=int(row["prev_drafted"]), accept_rate=row["accept_rate"],
            cum_logq=row["cum_logq"], target_entropy=row["target_entropy"],
            token_class=classes.index(1.0) if 1.0 in classes else -1,
            suffix_len=int(row["suffix_len"]), occurrences=int(row["occurrences"]),
            node_share=row["node_share"], token_share=row["token_share"])

    @property
    def top1_prob(self) -> float:
        return self.top_probs[0]

    @property
    def margin(self) -> float:
        """Top-1 minus top-2 probability."""
        return self.top_probs[0] - self.top_probs[1]

    def to_vector(self) -> list[float]:
        """Values in ``FEATURE_NAMES`` order."""
        return [float(self.draft_pos), float(self.seq_pos), self.entropy, *self.top_probs,
                self.margin, self.cum_top1, self.cum_logq, self.target_entropy,
                float(self.prev_accepted), float(self.prev_drafted), self.accept_rate,
                *(float(self.token_class == k) for k in range(len(TOKEN_CLASSES))),
                float(self.suffix_len), float(self.occurrences), self.node_share,
                self.token_share]

    def as_row(self) -> dict[str, float]:
        """A flat mapping ``FEATURE_NAMES -> value``, the collector's row layout."""
        return dict(zip(FEATURE_NAMES, self.to_vector()))


@dataclass(frozen=True, slots=True)
class SequenceState:
    """What the decoder knows about the sequence when a round starts."""

    seq_len: int
    prev_accepted: int = 0
    prev_drafted: int = 0
    total_accepted: int = 0
    total_drafted: int = 0
    target_entropy: float = 0.0

    @property
    def accept_rate(self) -> float:
        return (self.total_accepted + 1) / (self.total_drafted + 2)

    def after_round(self, seq_len: int, drafted: int, accepted: int,
                    target_entropy: float = 0.0) -> SequenceState:
        return SequenceState(seq_len, accepted, drafted, self.total_accepted + accepted,
                             self.total_drafted + drafted, target_entropy)


def distribution_stats(probs: torch.Tensor) -> torch.Tensor:
    """Entropy and top-``TOP_K`` probabilities of a distribution.

    probs: (..., V) float32, the draft's softmax of its raw logits. Returns (..., 1 + TOP_K)
    on the same device: ``[entropy_nats, p_1, ..., p_TOP_K]``, zero-padded when V < TOP_K.
    No host sync.
    """
    entropy = torch.special.entr(probs).sum(-1, keepdim=True)
    top = probs.topk(min(TOP_K, probs.shape[-1]), dim=-1).values
    if top.shape[-1] < TOP_K:
        top = torch.nn.functional.pad(top, (0, TOP_K - top.shape[-1]))
    return torch.cat([entropy, top], dim=-1)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of ``softmax(logits)`` at temperature 1: (..., V) -> (...)."""
    return torch.special.entr(torch.softmax(logits.float(), dim=-1)).sum(-1)


def draft_stats(probs: torch.Tensor, picked: torch.Tensor, tokens: torch.Tensor,
                classes: torch.Tensor | None, lookup: torch.Tensor | None = None) -> torch.Tensor:
    """A drafted token's statistics row: ``distribution_stats(probs)``, the token's own
    probability, its class and its lookup columns. probs: (n, W) (the vocabulary, or a draft's
    head); picked: (n,) the tokens' columns in ``probs``; tokens: (n,) their vocabulary ids,
    for ``classes`` (V,) (None: unknown, -1); lookup: (n, LOOKUP_STATS) or None (zeros).
    Returns (n, STATS) on the device of ``probs``."""
    own = probs.gather(-1, picked.view(-1, 1))
    kind = classes[tokens.view(-1)].to(probs.dtype).view(-1, 1) if classes is not None else \
        torch.full_like(own, -1.0)
    if lookup is None:
        lookup = probs.new_zeros((own.shape[0], LOOKUP_STATS))
    return torch.cat([distribution_stats(probs), own, kind, lookup.to(probs.dtype)], dim=-1)


def make_record(stats: list[float], draft_pos: int, previous: FeatureRecord | None,
                state: SequenceState) -> FeatureRecord:
    """Build the record of the ``draft_pos``-th token of a round from its host-side stats.

    stats: one ``draft_stats`` row as a list; previous: the record of the round's token before
    it (None for the first), whose path features this one extends.
    """
    top, own = stats[1:1 + TOP_K], stats[1 + TOP_K]
    suffix_len, occurrences, share = stats[3 + TOP_K:3 + TOP_K + LOOKUP_STATS]
    log_q = max(_LOG_FLOOR, math.log(own)) if own > 0 else _LOG_FLOOR
    return FeatureRecord(
        draft_pos=draft_pos,
        seq_pos=state.seq_len + draft_pos - 1,
        entropy=stats[0],
        top_probs=tuple(top),
        cum_top1=(previous.cum_top1 if previous else 1.0) * top[0],
        cum_logq=(previous.cum_logq if previous else 0.0) + log_q,
        target_entropy=state.target_entropy,
        prev_accepted=state.prev_accepted,
        prev_drafted=state.prev_drafted,
        accept_rate=state.accept_rate,
        token_class=int(stats[2 + TOP_K]),
        suffix_len=int(suffix_len),
        occurrences=int(occurrences),
        node_share=share,
        token_share=share,
    )


def records_from_stats(stats_rows: list[list[float]], state: SequenceState) -> list[FeatureRecord]:
    """Records for a whole round from its stacked host-side stats (one transfer per round)."""
    records: list[FeatureRecord] = []
    for i, row in enumerate(stats_rows):
        records.append(make_record(row, i + 1, records[-1] if records else None, state))
    return records


def classify_token(text: str) -> int:
    """The ``TOKEN_CLASSES`` index of a token's decoded text (-1: empty)."""
    if not text:
        return -1
    body = text.lstrip(" ")
    if not body.strip():
        return TOKEN_CLASSES.index("space")
    if body.isalpha():
        return TOKEN_CLASSES.index("word_start" if body != text else "word_piece")
    if any(c.isdigit() for c in body) and not any(c.isalpha() for c in body):
        return TOKEN_CLASSES.index("digit")
    if any(c.isalpha() for c in body):  # letters mixed with symbols: a word-like piece
        return TOKEN_CLASSES.index("word_start" if body != text else "word_piece")
    return TOKEN_CLASSES.index("punct")


_CLASSES: dict[tuple[str, int], torch.Tensor] = {}


def token_classes(tokenizer) -> torch.Tensor:
    """(V,) int8: every token id's class (``classify_token`` of its decoded text; special
    tokens -1). Computed once per tokenizer and process."""
    key = (getattr(tokenizer, "name_or_path", ""), len(tokenizer))
    if key not in _CLASSES:
        ids = list(range(len(tokenizer)))
        texts = tokenizer.batch_decode([[i] for i in ids], clean_up_tokenization_spaces=False)
        special = set(tokenizer.all_special_ids)
        _CLASSES[key] = torch.tensor([-1 if i in special else classify_token(t)
                                      for i, t in zip(ids, texts)], dtype=torch.int8)
    return _CLASSES[key]
