import math

import numpy as np
import pytest

from draftctl.controllers import (
    UNBOUNDED,
    Action,
    ControllerSpecError,
    expand_specs,
    make_controller,
)
from draftctl.controllers.rules import roc_threshold
from draftctl.decode.features import FeatureRecord
from draftctl.errors import DraftctlError


def rec(top1: float = 0.9, entropy: float = 0.1, top2: float = 0.05, pos: int = 1) -> FeatureRecord:
    return FeatureRecord(draft_pos=pos, seq_pos=10 + pos, entropy=entropy,
                         top_probs=(top1, top2) + (0.0,) * 8, cum_top1=top1, prev_accepted=0,
                         prev_drafted=0, accept_rate=0.5)


def run_round(controller, records, n_accepted=None):
    """Feed records until the controller stops; return (kept, action that ended it)."""
    kept = []
    for r in records[: controller.max_draft()]:
        action = controller.decide(r) if controller.reads_features else Action.CONTINUE
        if action is Action.DISCARD:
            return kept, action
        kept.append(r)
        if action is Action.STOP:
            return kept, action
    return kept, None


def test_static_drafts_k_and_reads_nothing():
    c = make_controller("static:3")
    assert c.max_draft() == 3 and not c.reads_features
    assert make_controller("static").max_draft() == 4
    assert make_controller("none").max_draft() == 0


def test_heuristic_schedule():
    c = make_controller("heuristic")
    assert c.max_draft() == 5
    c.observe([rec()] * 5, 5)
    assert c.max_draft() == 7
    c.observe([rec()] * 7, 2)
    assert c.max_draft() == 6
    for _ in range(10):
        c.observe([rec()] * c.max_draft(), 0)
    assert c.max_draft() == 1
    c.reset()
    assert c.max_draft() == 5


def test_confidence_stops_after_the_low_confidence_token():
    c = make_controller("confidence:0.5")
    records = [rec(0.9), rec(0.6), rec(0.4), rec(0.95)]
    kept, action = run_round(c, records)
    assert kept == records[:3] and action is Action.STOP  # the 0.4 token is still verified
    assert make_controller("confidence").threshold == 0.4


def test_pmin_drops_the_low_confidence_token():
    c = make_controller("pmin")
    assert c.threshold == 0.75 and c.max_draft() == 16
    records = [rec(0.9), rec(0.8), rec(0.7), rec(0.95)]
    kept, action = run_round(c, records)
    assert kept == records[:2] and action is Action.DISCARD


def test_svip_stops_at_the_first_token_over_the_entropy_bound():
    c = make_controller("svip")
    assert c.threshold == 0.3 and c.max_draft() == 40
    # sqrt(0.15 H) > 0.3  <=>  H > 0.6
    records = [rec(entropy=0.1), rec(entropy=0.59), rec(entropy=0.61), rec(entropy=0.0)]
    kept, action = run_round(c, records)
    assert kept == records[:3] and action is Action.STOP
    t = make_controller("svip:0.5")  # H > 0.5^2 / 0.15 = 1.667
    assert t.decide(rec(entropy=1.6)) is Action.CONTINUE
    assert t.decide(rec(entropy=1.7)) is Action.STOP


def test_adaedl_threshold_adapts_to_acceptance():
    c = make_controller("adaedl:lam=0.5,gamma=0.2,step=0.1")
    # 1 - sqrt(0.2 H) < 0.5  <=>  H > 1.25
    assert c.decide(rec(entropy=1.2)) is Action.CONTINUE
    assert c.decide(rec(entropy=1.3)) is Action.STOP
    c.observe([rec()] * 4, 4)  # full accept: lambda drops, drafts run longer
    assert math.isclose(c.lam, 0.4)
    assert c.decide(rec(entropy=1.3)) is Action.CONTINUE
    c.observe([rec()] * 4, 1)
    c.observe([rec()] * 4, 1)
    assert math.isclose(c.lam, 0.6)
    c.reset()
    assert c.lam == 0.5


def test_confidence_roc_refits_the_threshold():
    c = make_controller("confidence-roc")
    assert c.threshold == 0.4
    # Accepted tokens have top-1 >= 0.7, rejected ones <= 0.5: the refit lands in between.
    c.observe([rec(0.9), rec(0.8), rec(0.3)], 2)
    assert c.threshold == 0.4  # only 3 pairs so far
    c.observe([rec(0.95), rec(0.7), rec(0.5), rec(0.99)], 2)  # the 0.99 token was never reached
    c.observe([rec(0.85), rec(0.45)], 1)
    assert c._labels == [1, 1, 0, 1, 1, 0, 1, 0]
    assert c.threshold == 0.7


def test_roc_threshold_matches_a_brute_force_search():
    rng = np.random.default_rng(0)
    for _ in range(50):
        scores = rng.choice(np.linspace(0, 1, 11), size=30)
        labels = (rng.random(30) < scores).astype(int)
        if labels.min() == labels.max():
            continue
        best, best_cost = None, math.inf
        for t in [math.inf, *sorted(set(scores), reverse=True)]:
            pred = scores >= t
            fpr = (pred & (labels == 0)).sum() / (labels == 0).sum()
            fnr = (~pred & (labels == 1)).sum() / (labels == 1).sum()
            if fpr + 3 * fnr < best_cost - 1e-12:
                best, best_cost = t, fpr + 3 * fnr
        assert roc_threshold(scores, labels) == best


def test_unbounded_default_and_spec_kept():
    c = make_controller("confidence:0.3")
    assert c.max_draft() == UNBOUNDED and c.spec == "confidence:0.3"


@pytest.mark.parametrize("spec, message", [
    ("bogus", "unknown controller 'bogus'"),
    ("static:0", "k must be >= 1, got 0"),
    ("static:two", "k must be an integer, got 'two'"),
    ("static:2.5", "k must be an integer"),
    ("confidence:1.5", r"threshold must be in \(0, 1\]"),
    ("pmin:-0.1", r"threshold must be in \[0, 1\]"),
    ("svip:0", "threshold must be > 0"),
    ("svip:nan", "threshold must be > 0"),
    ("none:3", "takes no value"),
    ("adaedl:speed=2", "unknown parameter 'speed'"),
    ("adaedl:lam=0.4,0.2", "only the first value may omit its name"),
])
def test_bad_specs_are_refused_with_the_reason(spec, message):
    with pytest.raises(ControllerSpecError, match=message):
        make_controller(spec)


def test_ranges_expand_and_other_specs_stay_as_written():
    assert expand_specs("static:1-3,svip:0.4,n_max=2-3,heuristic") == [
        "static:1", "static:2", "static:3", "svip:0.4,n_max=2", "svip:0.4,n_max=3", "heuristic"]
    assert expand_specs(["confidence:0.30", "static:2-2"]) == ["confidence:0.30", "static:2"]


@pytest.mark.parametrize("spec, message", [
    ("static:4-2", "range 4-2 is empty"),
    ("static:0-2", "k must be >= 1, got 0"),
    ("bogus:1-2", "unknown controller 'bogus'"),
])
def test_bad_ranges_are_refused(spec, message):
    with pytest.raises(ControllerSpecError, match=message):
        expand_specs(spec)


def test_oracle_keeps_exactly_the_reference_tokens():
    oracle = make_controller("oracle")
    with pytest.raises(DraftctlError, match="needs the target's greedy output"):
        oracle.max_draft()
    oracle.set_reference([5, 6, 7, 8, 9])
    oracle.reset()
    assert oracle.max_draft() == 4
    decisions = []
    for token in (5, 6, 1):
        oracle.see_token(token)
        decisions.append(oracle.decide(rec()))
    assert decisions == [Action.CONTINUE, Action.CONTINUE, Action.DISCARD]
    oracle.observe([rec(), rec()], 2)  # tokens 5, 6 accepted, 7 appended as the correction
    oracle.see_token(8)
    assert oracle.decide(rec()) is Action.CONTINUE
    assert oracle.max_draft() == 1


@pytest.mark.parametrize("stop, step_costs, lengths", [
    ("token", (), [5, 5]), ("path", (), [3, 3]),
    ("cost", (0.1, 0.1, 0.1, 2.0), [4, 4]), ("cost", (1.5, 0.1), [1, 1]),
    ("cost", (0.1,), [5, 5])])
def test_score_threshold_stop_rules(stop, step_costs, lengths):
    """A constant score of 0.8 against 0.6: never below it token by token, but the product
    0.8 ** 3 = 0.512 is below it at the third token; each round starts a new product. The
    cost rule scales 0.6 by the cost of one more draft at each length: a flat curve (0.06)
    drafts past the product's 0.512 until a steep step (1.2) at the fourth token, a steep
    first step (0.9) stops at once, and the last cost holds past the list's end."""
    from draftctl.controllers.learned import ScoreThreshold

    c = ScoreThreshold(lambda x: 0.8, ["entropy"], threshold=0.6, n_max=5, stop=stop,
                       step_costs=step_costs)
    got = [len(run_round(c, [rec(pos=i) for i in range(1, 6)])[0]) for _ in range(2)]
    assert got == lengths


def test_unknown_stop_rule_is_refused():
    from draftctl.controllers.learned import ScoreThreshold

    with pytest.raises(DraftctlError, match="unknown stop rule 'sum'"):
        ScoreThreshold(lambda x: 0.8, ["entropy"], threshold=0.6, stop="sum")
    with pytest.raises(DraftctlError, match="cost stop rule needs the step costs"):
        ScoreThreshold(lambda x: 0.8, ["entropy"], threshold=0.6, stop="cost")
