"""Context lookup: the match rule, drafting with it alone and mixed into a draft model
(greedy identity, sampling distribution, dense traces equal live drafts), and its specs."""

import numpy as np
import pytest
import torch

from draftctl.controllers import make_controller
from draftctl.decode import generate
from draftctl.decode.cached_lm import CachedLM
from draftctl.decode.features import SequenceState, draft_stats
from draftctl.decode.verify import SamplingConfig
from draftctl.drafters import parse_drafter
from draftctl.drafters.base import looked_up
from draftctl.drafters.context import LookupConfig, Match, find_match
from draftctl.drafters.feature import FeatureDrafter
from draftctl.drafters.lookup import LookupDrafter
from draftctl.drafters.model import ModelDrafter
from draftctl.errors import DraftctlError
from tests.conftest import make_decoder, tiny_pair
from tests.test_drafters import feature_draft
from tests.test_sampling import SAMPLING, exact_distribution, fits, sample_counts

# a prompt that repeats itself, so that lookup finds matches of every length
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [1, 2, 1, 2, 1], [40, 2, 2, 17, 88, 3, 60]]
SPECS = ["static:1", "static:4", "heuristic", "svip:0.5", "pmin:0.3", "confidence"]


def match(tokens, **config):
    return find_match(np.array(tokens), LookupConfig(**config))


def test_the_longest_earlier_suffix_decides_and_the_majority_of_its_continuations():
    # suffix [3, 4] occurred twice, followed by 5 then 6 (a tie: the latest wins); [4] alone
    # also after 9, followed by 7, but the longer match decides
    found = match([3, 4, 5, 9, 4, 7, 3, 4, 6, 3, 4])
    assert (found.token, found.length, found.occurrences) == (6, 2, 2)
    assert found.share(5) == 0.5 and found.share(7) == 0 and found.stats(6) == [2.0, 2.0, 0.5]
    found = match([3, 4, 5, 9, 4, 5, 3, 4, 6, 8, 4])  # [8, 4] is new: the one-token suffix [4]
    assert (found.token, found.length) == (5, 1)  # 5 follows [4] twice, 6 once
    assert match([1, 2, 1, 2, 1, 2], max_ngram=3).length == 3
    assert match([9, 8, 7, 6]) is None  # the last token never occurred before
    assert match([7]) is None
    assert match([3, 4, 5, 9, 4], min_ngram=2) is None  # only a one-token match


def test_a_tie_goes_to_the_latest_continuation():
    assert match([4, 1, 4, 2, 4]).token == 2
    assert match([4, 2, 4, 1, 4]).token == 1


def test_every_lookup_drafter_is_lossless_in_greedy_decoding():
    target, draft = tiny_pair(vocab_size=97)
    plain = make_decoder(target, None, max_new_tokens=30)
    greedy = plain.config.sampling
    lookup = LookupConfig()
    drafters = {
        "lookup": LookupDrafter(97, lookup),
        "model+lookup": ModelDrafter(CachedLM(draft, 97), greedy, lookup=lookup),
        "feature+lookup": FeatureDrafter(feature_draft(target), 97, greedy, lookup=lookup),
        "model+lookup,alone=2": ModelDrafter(CachedLM(draft, 97), greedy,
                                             lookup=LookupConfig(alone=2)),
        "feature+lookup,alone=2": FeatureDrafter(feature_draft(target), 97, greedy,
                                                 lookup=LookupConfig(alone=2)),
    }
    for name, drafter in drafters.items():
        decoder = make_decoder(target, drafter, max_new_tokens=30)
        found = 0
        for prompt in PROMPTS:
            expected = generate(plain, prompt, make_controller("none")).output_ids
            for spec in SPECS:
                result = generate(decoder, prompt, make_controller(spec))
                assert result.output_ids == expected, (name, spec)
                found += sum(f.suffix_len > 0 for r in result.rounds for f in r.features)
        assert found > 0, name


def test_a_looked_up_token_is_described_by_the_shares_of_its_continuations():
    """A looked-up draft token has q = 1 on it and its raw distribution is the shares of the
    tokens that followed the match; its statistics, read from those few tokens, equal the
    statistics of the whole-vocabulary row."""
    classes = torch.randint(0, 4, (97,), dtype=torch.int8)
    for following, token in [([7, 3, 7, 9, 7], 7), ([42], 42), ([5, 60, 5, 60], 60)]:
        match = Match(token, 2, np.array(following))
        picked = looked_up(match, 97, torch.device("cpu"), classes)
        assert picked.tokens.tolist() == [token]
        assert picked.q.shape == (1, 97) and picked.q[0, token] == 1 and picked.q.sum() == 1
        counts = np.bincount(following, minlength=97) / len(following)
        assert torch.allclose(picked.raw[0], torch.tensor(counts, dtype=torch.float32))
        whole = draft_stats(picked.raw, picked.tokens, picked.tokens, classes,
                            torch.tensor([match.stats(token)]))
        assert torch.allclose(picked.stats, whole, atol=1e-7)
        assert picked.stats[0, -3:].tolist() == pytest.approx([2, len(following), counts[token]])


def test_the_mixture_drafts_the_looked_up_token_and_records_the_match():
    """With weight 0.5 a match of two or more tokens always wins the argmax; a one-token
    match at weight 0 never changes the model's own choice."""
    _, draft = tiny_pair(vocab_size=97)
    seq = torch.tensor([11, 12, 13, 50, 11, 12])  # [11, 12] was followed by 13
    state = SequenceState(len(seq))
    mixed = ModelDrafter(CachedLM(draft, 97), SamplingConfig(),
                         lookup=LookupConfig(weight=0.5, weight_unigram=0.0))
    proposal = mixed.propose(seq, 1, make_controller("static:1"), state, torch.Generator())
    assert proposal.tokens.tolist() == [13]
    assert proposal.stats[0, -3:].tolist() == [2.0, 1.0, 1.0]  # suffix_len, occurrences, share
    assert proposal.raw_probs[0, 13] >= 0.5 and proposal.raw_probs[0].sum() == pytest.approx(1)
    alone = ModelDrafter(CachedLM(draft, 97), SamplingConfig())
    seq = torch.tensor([11, 40, 50, 11])  # only a one-token match: 40
    plain = alone.propose(seq, 1, make_controller("static:1"), state, torch.Generator())
    mixed.reset()
    assert plain.tokens.tolist() != [40]
    assert mixed.propose(seq, 1, make_controller("static:1"), state,
                         torch.Generator()).tokens.tolist() == plain.tokens.tolist()


def test_a_round_that_starts_on_a_long_match_is_drafted_by_lookup_alone():
    """With alone=2 a round whose first token matches two or more tokens calls no draft model
    and drafts while the context matches; any other round is the mixture's."""
    target, draft = tiny_pair(vocab_size=97)
    plain = make_decoder(target, None, max_new_tokens=40)
    drafter = ModelDrafter(CachedLM(draft, 97), plain.config.sampling,
                           lookup=LookupConfig(alone=2))
    decoder = make_decoder(target, drafter, max_new_tokens=40)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    kinds = set()
    for record in decoder.rounds(prompt, make_controller("static:4")):
        first = record.features[0] if record.features else None
        if first is not None and first.suffix_len >= 2:
            assert record.draft_forwards == 0 and all(f.suffix_len for f in record.features)
            kinds.add("alone")
        elif first is not None:
            assert record.draft_forwards > 0
            kinds.add("model")
    assert kinds == {"alone", "model"}
    with pytest.raises(DraftctlError, match="dense traces follow the draft model"):
        drafter.continuations(torch.tensor(prompt), 4, 2)


def test_lookup_alone_drafts_while_the_context_continues():
    drafter = LookupDrafter(97)
    seq = torch.tensor([7, 8, 9, 10, 7, 8])
    proposal = drafter.propose(seq, 8, make_controller("static:8"), SequenceState(6),
                               torch.Generator())
    # 9, 10, then [..., 10, 7, 8] repeats: 9, 10, 7, 8, ... up to the budget
    assert proposal.tokens.tolist() == [9, 10, 7, 8, 9, 10, 7, 8]
    nothing = drafter.propose(torch.tensor([1, 2, 3]), 8, make_controller("static:8"),
                              SequenceState(3), torch.Generator())
    assert len(nothing.tokens) == 0


@pytest.mark.parametrize("kind", ["lookup", "model+lookup"])
def test_lookup_sampling_matches_the_target_distribution(kind):
    target, draft = tiny_pair(vocab_size=6, noise=0.8, layers=2, hidden=16)
    sampling = make_decoder(target, None, **SAMPLING).config.sampling
    drafter = LookupDrafter(6) if kind == "lookup" else \
        ModelDrafter(CachedLM(draft, 6), sampling, lookup=LookupConfig())
    decoder = make_decoder(target, drafter, max_new_tokens=3, **SAMPLING)
    exact = exact_distribution(target, decoder.config.sampling, decoder.config.pass_shape)
    assert fits(sample_counts(decoder, make_controller("static:2"), 6000), exact, 6000)


def test_dense_continuations_with_lookup_equal_live_drafts(tiny_models):
    _, draft = tiny_models
    drafter = ModelDrafter(CachedLM(draft, 97), SamplingConfig(), lookup=LookupConfig())
    seq = torch.tensor([4, 9, 33, 4, 9, 71, 5, 4, 9, 33, 2, 71, 5])
    n_prompt, k = 4, 4
    tokens, stats = drafter.continuations(seq, n_prompt, k)
    assert stats[..., -3].sum() > 0  # lookup found matches
    for t in range(len(seq) - n_prompt):
        c = n_prompt + t
        drafter.reset()
        live = drafter.propose(seq[:c], k, make_controller(f"static:{k}"), SequenceState(c),
                               torch.Generator())
        assert live.tokens.tolist() == tokens[t].tolist(), t
        assert torch.allclose(live.stats, stats[t], atol=1e-5), t


def test_drafter_specs_parse_or_are_refused_by_name():
    spec = parse_drafter("model+lookup,max_ngram=4,weight=0.7")
    assert spec.uses_model and spec.lookup == LookupConfig(max_ngram=4, weight=0.7)
    assert not parse_drafter("lookup").uses_model and parse_drafter(None).kind == "model"
    assert parse_drafter("rest:somewhere").tree
    assert spec.dense and not parse_drafter("model+lookup,alone=2").dense
    for bad, words in [("lookahead", "unknown drafter"), ("lookup,size=3", "size=3"),
                       ("lookup,min_ngram=x", "min_ngram=x"),
                       ("lookup,min_ngram=3,max_ngram=2", "min_ngram <= max_ngram"),
                       ("model+lookup,weight=2", "weight must be in"),
                       ("model+lookup,alone=-1", "alone must be >= 0")]:
        with pytest.raises(DraftctlError, match=words):
            parse_drafter(bad)
