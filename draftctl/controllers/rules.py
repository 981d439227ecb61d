"""Zero-shot draft-length policies (methods.md section 2)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from draftctl.controllers.base import Action, Controller
from draftctl.errors import DraftctlError

if TYPE_CHECKING:  # the decoder imports controllers; annotations only
    from draftctl.decode.features import FeatureRecord


class ControllerStateError(DraftctlError):
    """A controller used where it lacks what it needs."""


class NoDraft(Controller):
    """``none``: never draft; every round is one plain autoregressive target step."""

    reads_features = False

    def max_draft(self) -> int:
        return 0


class Static(Controller):
    """``static:K``: draft exactly K tokens per round."""

    reads_features = False

    def __init__(self, k: int = 4):
        self.k = k

    def max_draft(self) -> int:
        return self.k


class Heuristic(Controller):
    """``heuristic``: HF transformers' schedule. ``k += 2`` after a round whose every draft
    token was accepted, else ``k = max(1, k - 1)``; starts at ``k0`` for each sequence (HF's
    ``heuristic_transient``; plain ``heuristic`` in HF also carries k across calls)."""

    reads_features = False

    def __init__(self, k0: int = 5):
        self.k0 = k0
        self.reset()

    def reset(self) -> None:
        self.k = self.k0

    def max_draft(self) -> int:
        return self.k

    def observe(self, records: Sequence[FeatureRecord], n_accepted: int) -> None:
        self.k = self.k + 2 if n_accepted == len(records) else max(1, self.k - 1)


class Confidence(Controller):
    """``confidence:T``: stop after a token whose draft top-1 probability is below T; that
    token is still verified (HF ``assistant_confidence_threshold``)."""

    def __init__(self, threshold: float = 0.4):
        self.threshold = threshold

    def decide(self, record: FeatureRecord) -> Action:
        return Action.STOP if record.top1_prob < self.threshold else Action.CONTINUE


def roc_threshold(scores: np.ndarray, labels: np.ndarray, fn_weight: float = 3.0) -> float:
    """The score threshold on the ROC curve minimising ``FPR + fn_weight * FNR``.

    Predict "accepted" when ``score >= threshold``. Candidate thresholds are the distinct
    scores (descending) plus +inf, as in scikit-learn's ``roc_curve``; the first minimum wins.
    """
    order = np.argsort(-scores, kind="stable")
    scores, labels = scores[order], labels[order]
    last_of_run = np.r_[np.flatnonzero(np.diff(scores)), scores.size - 1]
    tps = np.cumsum(labels)[last_of_run]
    fps = (last_of_run + 1) - tps
    tpr = np.r_[0.0, tps / labels.sum()]
    fpr = np.r_[0.0, fps / (labels.size - labels.sum())]
    thresholds = np.r_[np.inf, scores[last_of_run]]
    return float(thresholds[np.argmin(fpr + fn_weight * (1 - tpr))])


class ConfidenceROC(Confidence):
    """``confidence-roc``: HF's online refit of the confidence threshold.

    After each round, the (top-1 probability, accepted) pairs seen so far are extended with
    the accepted tokens (label 1) and the first rejected one (label 0; later tokens were
    never reached); once there are more than 5 pairs with both labels, the threshold moves
    to the ROC point minimising ``FPR + 3 FNR``.
    """

    def __init__(self, threshold: float = 0.4, fn_weight: float = 3.0):
        super().__init__(threshold)
        self.initial_threshold = threshold
        self.fn_weight = fn_weight
        self.reset()

    def reset(self) -> None:
        self.threshold = self.initial_threshold
        self._scores: list[float] = []
        self._labels: list[int] = []

    def observe(self, records: Sequence[FeatureRecord], n_accepted: int) -> None:
        reached = records[: n_accepted + 1]
        self._scores.extend(r.top1_prob for r in reached)
        self._labels.extend([1] * n_accepted + [0] * (len(reached) - n_accepted))
        if len(self._labels) > 5 and 0 < sum(self._labels) < len(self._labels):
            self.threshold = roc_threshold(np.asarray(self._scores), np.asarray(self._labels),
                                           self.fn_weight)


class PMin(Controller):
    """``pmin:T``: llama.cpp ``--draft-p-min``: stop *before* appending a token whose draft
    top-1 probability is below T (the token is dropped, never verified); at most n_max."""

    def __init__(self, threshold: float = 0.75, n_max: int = 16):
        self.threshold = threshold
        self.n_max = n_max

    def max_draft(self) -> int:
        return self.n_max

    def decide(self, record: FeatureRecord) -> Action:
        return Action.DISCARD if record.top1_prob < self.threshold else Action.CONTINUE


class SVIP(Controller):
    """``svip:T``: stop after the token for which ``sqrt(h * H) > T``, H the full-vocabulary
    entropy (nats) of the draft's temperature-1 softmax, h = 0.15; at most 40 tokens.

    SVIP (arXiv 2411.18462) bounds acceptance below by ``1 - sqrt(h H)`` (Pinsker, with the
    unknown target term replaced by a constant times the draft entropy).
    """

    def __init__(self, threshold: float = 0.3, h: float = 0.15, n_max: int = 40):
        self.threshold = threshold
        self.h = h
        self.n_max = n_max

    def max_draft(self) -> int:
        return self.n_max

    def decide(self, record: FeatureRecord) -> Action:
        return Action.STOP if math.sqrt(self.h * record.entropy) > self.threshold else Action.CONTINUE


class AdaEDL(Controller):
    """``adaedl``: stop after the token whose entropy bound ``1 - sqrt(gamma * H)`` falls below
    ``lambda`` (AdaEDL, arXiv 2410.18351, gamma = 0.2).

    ``lambda`` adapts to observed acceptance: after a fully accepted round it drops by ``step``
    (drafting longer would have paid), after a rejection it rises by ``step``, within
    [0.05, 0.95]. The paper adapts lambda from the acceptance rate too; its exact schedule
    was not available offline, so this additive rule is draftctl's own.
    """

    def __init__(self, lam: float = 0.5, gamma: float = 0.2, step: float = 0.02,
                 n_max: int = 40):
        self.initial_lam = lam
        self.gamma = gamma
        self.step = step
        self.n_max = n_max
        self.reset()

    def reset(self) -> None:
        self.lam = self.initial_lam

    def max_draft(self) -> int:
        return self.n_max

    def decide(self, record: FeatureRecord) -> Action:
        bound = 1 - math.sqrt(self.gamma * record.entropy)
        return Action.STOP if bound < self.lam else Action.CONTINUE

    def observe(self, records: Sequence[FeatureRecord], n_accepted: int) -> None:
        if not records:
            return
        delta = -self.step if n_accepted == len(records) else self.step
        self.lam = min(0.95, max(0.05, self.lam + delta))


class ReferenceOracle(Controller):
    """``oracle``: the real-run upper bound of any length policy, for greedy decoding.

    It knows the target's greedy output (from a plain run of the same prompt, given with
    ``set_reference``) and keeps drafting while the draft's tokens equal it; the first token
    that differs is dropped unverified, so no verified token is ever wasted. Only the draft
    steps that found the mismatch are spent. ``draftctl bench`` sets the reference itself.
    """

    reads_tokens = True

    def __init__(self):
        self.reference: list[int] | None = None
        self.reset()

    def set_reference(self, output_ids: Sequence[int]) -> None:
        self.reference = list(output_ids)

    def reset(self) -> None:
        self.done = 0  # output tokens produced so far in this sequence
        self.index = 0  # draft tokens kept so far in this round
        self.token = -1

    def max_draft(self) -> int:
        if self.reference is None:
            raise ControllerStateError(
                "the oracle needs the target's greedy output: use it in draftctl bench or "
                "replay, which give it that output")
        return max(0, len(self.reference) - self.done - 1)

    def see_token(self, token: int) -> None:
        self.token = token

    def decide(self, record: FeatureRecord) -> Action:
        where = self.done + self.index
        if self.reference is not None and where < len(self.reference) \
                and self.reference[where] == self.token:
            self.index += 1
            return Action.CONTINUE
        return Action.DISCARD

    def observe(self, records: Sequence[FeatureRecord], n_accepted: int) -> None:
        self.done += n_accepted + 1
        self.index = 0
