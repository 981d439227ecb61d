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

from dataclasses import dataclass

import torch

SCHEMA_VERSION = 2
TOP_K = 10

# Retrieval (REST) drafts only; 0 for model drafts.
RETRIEVAL_FEATURES = ("suffix_len", "occurrences", "node_share", "token_share")

FEATURE_NAMES: tuple[str, ...] = (
    "draft_pos",
    "seq_pos",
    "entropy",
    *(f"top_prob_{i}" for i in range(1, TOP_K + 1)),
    "margin",
    "cum_top1",
    "prev_accepted",
    "prev_drafted",
    "accept_rate",
    *RETRIEVAL_FEATURES,
)


@dataclass(frozen=True, slots=True)
class FeatureRecord:
    """Features of one drafted token, known before the target sees it.

    draft_pos: 1-based position of the token in the current draft.
    seq_pos: number of tokens before it in the sequence (prompt included).
    entropy: full-vocabulary entropy in nats of the draft distribution at this step.
    top_probs: the ``TOP_K`` largest draft probabilities, descending (zero-padded).
    cum_top1: product of the top-1 probabilities of this and earlier tokens of the round.
    prev_accepted, prev_drafted: the previous round's accepted and drafted counts (0 at first).
    accept_rate: running acceptance rate of the sequence, Laplace-smoothed:
        ``(accepted + 1) / (drafted + 2)`` over earlier rounds (0.5 before any draft).

    Retrieval drafts (a trie of datastore continuations, ``draft_pos`` = node depth) have no
    draft model: their distribution is the trie's, ``q(child) = count(child) /
    count(parent)``, and the distribution features describe the children of the node's
    parent (see ``draftctl.retrieval.features``). They also fill:
    suffix_len: length of the context suffix found in the datastore.
    occurrences: how many continuations of it were counted.
    node_share: ``count(node) / occurrences``, the share of continuations through the node.
    token_share: ``count(node) / count(parent)``, the trie's q of the node's token.
    """

    draft_pos: int
    seq_pos: int
    entropy: float
    top_probs: tuple[float, ...]
    cum_top1: float
    prev_accepted: int
    prev_drafted: int
    accept_rate: float
    suffix_len: int = 0
    occurrences: int = 0
    node_share: float = 0.0
    token_share: float = 0.0

    @classmethod
    def from_vector(cls, values) -> FeatureRecord:
        """Inverse of ``to_vector`` (e.g. a trace row's feature columns, in order)."""
        v = [float(x) for x in values]
        n = len(FEATURE_NAMES) - len(RETRIEVAL_FEATURES)
        return cls(int(v[0]), int(v[1]), v[2], tuple(v[3:3 + TOP_K]), v[n - 4], int(v[n - 3]),
                   int(v[n - 2]), v[n - 1], int(v[n]), int(v[n + 1]), v[n + 2], v[n + 3])

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
                self.margin, self.cum_top1, float(self.prev_accepted),
                float(self.prev_drafted), self.accept_rate, float(self.suffix_len),
                float(self.occurrences), self.node_share, self.token_share]

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

    @property
    def accept_rate(self) -> float:
        return (self.total_accepted + 1) / (self.total_drafted + 2)

    def after_round(self, seq_len: int, drafted: int, accepted: int) -> SequenceState:
        return SequenceState(seq_len, accepted, drafted, self.total_accepted + accepted,
                             self.total_drafted + drafted)


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


def make_record(stats: list[float], draft_pos: int, cum_top1: float,
                state: SequenceState) -> FeatureRecord:
    """Build the record of the ``draft_pos``-th token of a round from its host-side stats.

    stats: one row of ``distribution_stats`` as a list; cum_top1: product of the top-1
    probabilities of the earlier tokens of the round (1.0 for the first).
    """
    return FeatureRecord(
        draft_pos=draft_pos,
        seq_pos=state.seq_len + draft_pos - 1,
        entropy=stats[0],
        top_probs=tuple(stats[1:]),
        cum_top1=cum_top1 * stats[1],
        prev_accepted=state.prev_accepted,
        prev_drafted=state.prev_drafted,
        accept_rate=state.accept_rate,
    )


def records_from_stats(stats_rows: list[list[float]], state: SequenceState) -> list[FeatureRecord]:
    """Records for a whole round from its stacked host-side stats (one transfer per round)."""
    records, cum = [], 1.0
    for i, row in enumerate(stats_rows):
        rec = make_record(row, i + 1, cum, state)
        records.append(rec)
        cum = rec.cum_top1
    return records

