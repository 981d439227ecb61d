"""draftctl's controllers inside transformers' generate(): the same output, the controller in
charge of each round's draft length, clear refusals."""

import itertools
import json

import pytest
import torch

from draftctl import hf
from draftctl.controllers import make_controller
from draftctl.decode import generate
from draftctl.decode.cached_lm import PassShape
from draftctl.distill import feature
from draftctl.distill.model import from_target as draft_from_target
from draftctl.errors import DraftctlError
from draftctl.models import encode_prompt, load_model
from draftctl.prompts import load_prompts
from tests.conftest import make_decoder, tiny_llama, tiny_pair

PROMPT = torch.tensor([[5, 6, 7, 8, 9]])


@pytest.fixture(scope="module")
def pair():
    target, draft = tiny_pair(vocab_size=97, noise=0.3)
    for model in (target, draft):
        model.generation_config.pad_token_id = 0
    return target, draft


class Recording:
    """Wraps a controller and keeps what it was told after each round."""

    def __init__(self, spec: str):
        self.inner = make_controller(spec)
        self.rounds: list[tuple[int, int]] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def observe(self, records, n_accepted):
        self.rounds.append((len(records), n_accepted))
        self.inner.observe(records, n_accepted)


@pytest.mark.parametrize("spec", ["none", "static:3", "svip:0.5", "heuristic"])
def test_greedy_output_equals_generate_without_an_assistant(pair, spec):
    target, draft = pair
    plain = target.generate(PROMPT, max_new_tokens=30, do_sample=False)
    out = hf.generate(target, PROMPT, draft, controller=spec, max_new_tokens=30,
                      do_sample=False)
    assert torch.equal(out, plain)


def test_the_controller_sets_every_rounds_draft_length(pair):
    target, draft = pair
    static = Recording("static:3")
    out = hf.generate(target, PROMPT, draft, controller=static, max_new_tokens=30,
                      do_sample=False)
    drafted = [d for d, _ in static.rounds]
    assert drafted[:-1] and set(drafted[:-1]) == {3}  # the last round may be cut by max length
    assert sum(a for _, a in static.rounds) + len(static.rounds) == out.shape[1] - PROMPT.shape[1]
    none = Recording("none")
    hf.generate(target, PROMPT, draft, controller=none, max_new_tokens=10, do_sample=False)
    assert none.rounds == [(0, 0)] * 10  # no draft: one plain step a round
    entropy = Recording("svip:0.9")  # stops once the draft is not confident
    hf.generate(target, PROMPT, draft, controller=entropy, max_new_tokens=30, do_sample=False)
    assert len({d for d, _ in entropy.rounds}) > 1


def test_rounds_without_features_draft_alike_and_skip_the_distribution(pair):
    """``features=False`` (timed runs, ``generate()`` without traces): a controller that reads
    no features drafts the same rounds from records that only count; one that reads features
    still gets them."""
    target, draft = pair
    runs = {features: hf.run(target, PROMPT, draft, controller="heuristic", max_new_tokens=30,
                             do_sample=False, features=features) for features in (True, False)}
    assert torch.equal(runs[True].output, runs[False].output)
    assert [len(r.draft_tokens) for r in runs[True].rounds] == \
        [len(r.draft_tokens) for r in runs[False].rounds]
    assert len({len(r.draft_tokens) for r in runs[False].rounds}) > 1  # the heuristic adapts
    assert any(f.entropy > 0 for r in runs[True].rounds for f in r.features)
    assert all(f.entropy == 0 and f.draft_pos > 0 for r in runs[False].rounds for f in r.features)
    svip = hf.run(target, PROMPT, draft, controller="svip:0.9", max_new_tokens=30,
                  do_sample=False, features=False)
    assert all(f.entropy > 0 for r in svip.rounds for f in r.features)


def test_sampling_with_a_seed_runs_and_repeats(pair):
    target, draft = pair
    outs = []
    for _ in range(2):
        torch.manual_seed(3)
        outs.append(hf.generate(target, PROMPT, draft, controller="svip", max_new_tokens=20,
                                do_sample=True, temperature=1.0))
    assert torch.equal(outs[0], outs[1]) and outs[0].shape[1] > PROMPT.shape[1]
    assert 0 <= int(outs[0].min()) and int(outs[0].max()) < 97


def test_bad_versions_vocabularies_and_controllers_are_refused(pair):
    target, draft = pair
    with pytest.raises(hf.HFEngineError, match="supports transformers >=5.24,<6, found 4.46.0"):
        hf.check_transformers("4.46.0")
    other = tiny_llama(vocab_size=50, seed=4)
    with pytest.raises(hf.HFEngineError, match="vocabulary has 50 tokens and the target's 97"):
        hf.generate(target, PROMPT, other, controller="static:2", max_new_tokens=4)
    with pytest.raises(hf.HFEngineError, match="needs the reference output"):
        hf.generate(target, PROMPT, draft, controller="oracle", max_new_tokens=4)


def test_generate_runs_on_packed_views_of_both_models(pair):
    """The packed views (``draftctl.decode.kernels.packed_view``) are models generate()
    drives like the originals: greedy output of a controller equals the view's plain
    generate(), and transformers' own schedule runs with a packed assistant."""
    from draftctl.decode import kernels

    target, draft = pair
    if kernels.packable(target):
        pytest.skip(kernels.packable(target))
    fast_target, fast_draft = kernels.packed_view(target), kernels.packed_view(draft)
    plain = fast_target.generate(PROMPT, max_new_tokens=30, do_sample=False)
    for spec in ("static:3", "hf:constant:2"):
        result = hf.run(fast_target, PROMPT, fast_draft, controller=spec, max_new_tokens=30,
                        do_sample=False)
        assert torch.equal(result.output, plain), spec
        assert sum(r.drafted for r in result.rounds) > 0


def test_a_draftctl_draft_is_the_assistant_as_loaded(pair):
    """A distilled draft (the target's first layer, a reduced head) goes in as its ``nn.Module``:
    the output stays the target's, and its drafts are accepted (its weights are the ones
    loaded, not re-initialised by the wrapper)."""
    target, _ = pair
    draft = draft_from_target(target, 2, torch.arange(0, 97, 2))  # the target on half a head
    with torch.no_grad():
        draft.head.weight.copy_(target.lm_head.weight[::2])
    static = Recording("static:3")
    out = hf.generate(target, PROMPT, draft, controller=static, max_new_tokens=30,
                      do_sample=False)
    assert torch.equal(out, target.generate(PROMPT, max_new_tokens=30, do_sample=False))
    ours = generate(make_decoder(target, draft, max_new_tokens=30), PROMPT[0].tolist(),
                    make_controller("static:3"))
    assert sum(a for _, a in static.rounds) > 0  # its drafts match the target's tokens
    assert static.rounds[:-1] == [(r.drafted, r.n_accepted) for r in ours.rounds][:-1]


def test_a_feature_draft_drafts_inside_generate_from_the_targets_states(pair):
    """A feature-level draft reads the target's hidden states inside generate(): greedy
    output equals plain generate(), its rounds equal draftctl's decoder's with the same draft
    (after the first, which drafts nothing so that the prefill gives the prompt's states),
    sampling with a seed repeats, and transformers' own schedules are refused for it."""
    from draftctl.drafters.feature import FeatureDrafter

    target, _ = pair
    draft = feature.from_target(target, torch.arange(97), (1, 2))
    plain = target.generate(PROMPT, max_new_tokens=30, do_sample=False)
    result = hf.run(target, PROMPT, draft, controller="static:3", max_new_tokens=30,
                    do_sample=False)
    assert torch.equal(result.output, plain)
    assert result.rounds[0].drafted == 0 and sum(r.n_accepted for r in result.rounds) > 0
    drafter = FeatureDrafter(draft, 97, make_decoder(target, None).config.sampling)
    ours = list(make_decoder(target, drafter, max_new_tokens=30, pass_shape=PassShape()).rounds(
        PROMPT[0].tolist(), make_controller("static:3")))  # unpadded passes, as generate()'s
    # generate()'s first round is the prefill's plain step: it makes the token draftctl's
    # first round makes after its draft; from the second round on both run the same rounds
    theirs = [(r.draft_tokens, r.n_accepted) for r in result.rounds[1:-1]]
    assert theirs == [(r.draft_tokens, r.n_accepted) for r in ours[1:len(theirs) + 1]]
    outs = []
    for _ in range(2):
        torch.manual_seed(5)
        outs.append(hf.generate(target, PROMPT, draft, controller="svip", max_new_tokens=20,
                                do_sample=True, temperature=1.0))
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(hf.HFEngineError, match="a feature draft drafts with a draftctl "
                                               "controller"):
        hf.run(target, PROMPT, draft, controller="hf:constant:3", max_new_tokens=4)


def test_a_feature_draft_gives_candidate_logits_only_where_verification_reads_them(
        pair, monkeypatch):
    """Greedy verification compares tokens, so a feature draft's rounds hand generate() no
    candidate logits (the logarithm over the vocabulary is skipped) and the output still
    equals plain generate(); sampling, and greedy decoding with transformers' assistant
    ensemble, get log q of every drafted token over the vocabulary."""
    target, _ = pair
    draft = feature.from_target(target, torch.arange(97), (1, 2))
    handed = []
    own = hf.FeatureCandidateGenerator.get_candidates

    def spy(self, input_ids, **kwargs):
        ids, logits = own(self, input_ids, **kwargs)
        if ids.shape[1] > input_ids.shape[1]:  # a round that drafted
            handed.append((ids.shape[1] - input_ids.shape[1], logits))
        return ids, logits

    monkeypatch.setattr(hf.FeatureCandidateGenerator, "get_candidates", spy)
    plain = target.generate(PROMPT, max_new_tokens=20, do_sample=False)
    for kwargs, wanted in [({"do_sample": False}, False),
                           ({"do_sample": True, "temperature": 1.0}, True),
                           ({"do_sample": False, "assistant_ensemble_weight": 0.5}, True)]:
        handed.clear()
        result = hf.run(target, PROMPT, draft, controller="static:3", max_new_tokens=20,
                        **kwargs)
        assert handed
        if not wanted:
            assert all(logits is None for _, logits in handed)
            assert torch.equal(result.output, plain)
        else:
            assert all(logits is not None and logits.shape == (1, n, 97)
                       for n, logits in handed)


def test_a_feature_draft_mixed_with_context_lookup_drafts_inside_generate(pair):
    """``lookup="model+lookup,..."`` mixes the feature draft's q with context lookup inside
    generate(), as draftctl's decoder does: greedy output equals plain generate() and the
    rounds equal the decoder's with the same drafter; lookup with any other assistant, or any
    other lookup spec, is refused by name."""
    from draftctl.drafters.context import LookupConfig
    from draftctl.drafters.feature import FeatureDrafter

    target, draft_lm = pair
    draft = feature.from_target(target, torch.arange(97), (1, 2))
    prompt = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]])  # it repeats: lookup matches
    plain = target.generate(prompt, max_new_tokens=30, do_sample=False)
    result = hf.run(target, prompt, draft, controller="static:3", max_new_tokens=30,
                    do_sample=False, lookup="model+lookup,alone=2")
    assert torch.equal(result.output, plain)
    assert any(f.suffix_len > 0 for r in result.rounds for f in r.features)
    drafter = FeatureDrafter(draft, 97, make_decoder(target, None).config.sampling,
                             lookup=LookupConfig(alone=2))
    ours = list(make_decoder(target, drafter, max_new_tokens=30, pass_shape=PassShape()).rounds(
        prompt[0].tolist(), make_controller("static:3")))
    theirs = [(r.draft_tokens, r.n_accepted) for r in result.rounds[1:-1]]
    assert theirs == [(r.draft_tokens, r.n_accepted) for r in ours[1:len(theirs) + 1]]
    torch.manual_seed(3)
    sampled = hf.generate(target, prompt, draft, controller="svip", max_new_tokens=12,
                          do_sample=True, temperature=1.0, lookup="model+lookup")
    assert prompt.shape[1] < sampled.shape[1] <= prompt.shape[1] + 12
    assert torch.equal(sampled[0, :prompt.shape[1]], prompt[0]) and int(sampled.max()) < 97
    with pytest.raises(hf.HFEngineError, match="mixes context lookup into a feature draft's "
                                               "drafts; the assistant is a"):
        hf.run(target, prompt, draft_lm, controller="static:3", max_new_tokens=4,
               lookup="model+lookup")
    with pytest.raises(hf.HFEngineError, match="lookup='lookup': inside generate"):
        hf.run(target, prompt, draft, controller="static:3", max_new_tokens=4, lookup="lookup")


def test_transformers_prompt_lookup_runs_without_an_assistant(pair):
    """``hf:lookup:N`` is transformers' own prompt lookup decoding: no assistant model is
    used, greedy output equals plain generate(), rounds draft at most N tokens and are
    recorded; sampled rounds record min(1, p/q) = p(token) for the point-mass draft."""
    target, _ = pair
    prompt = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]])
    plain = target.generate(prompt, max_new_tokens=30, do_sample=False)
    result = hf.run(target, prompt, None, controller="hf:lookup:3", max_new_tokens=30,
                    do_sample=False)
    assert torch.equal(result.output, plain)
    assert result.rounds and max(r.drafted for r in result.rounds) <= 3
    assert sum(r.drafted for r in result.rounds) > 0
    torch.manual_seed(2)
    sampled = hf.run(target, prompt, None, controller="hf:lookup:3", max_new_tokens=12,
                     do_sample=True, temperature=1.0)
    probs = [p for r in sampled.rounds for p in r.accept_prob]
    assert probs and all(0 <= p <= 1 for p in probs) and len(set(probs)) > 1
    with pytest.raises(hf.HFEngineError, match="unknown transformers schedule 'hf:lookup:0'"):
        hf.run(target, prompt, None, controller="hf:lookup:0", max_new_tokens=4)


def test_the_shipped_draft_runs_in_generate_on_the_real_model(smollm2):
    """Greedy output equals plain generate() on three prompts for three controllers, with the
    shipped draft loaded as draftctl loads it."""
    draft = load_model("smollm2-135m-draft", "cpu", "float32", target=smollm2)
    accepted = drafted = 0
    for prompt in load_prompts(split="test", limit=3):
        ids = torch.tensor([encode_prompt(smollm2.tokenizer, prompt.text)])
        plain = smollm2.model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
        for spec in ("static:3", "svip:0.3", "heuristic"):
            recording = Recording(spec)
            out = hf.generate(smollm2.model, ids, draft.model, controller=recording,
                              max_new_tokens=12, do_sample=False, pad_token_id=0)
            assert torch.equal(out, plain), (prompt.question_id, spec)
            accepted += sum(a for _, a in recording.rounds)
            drafted += sum(d for d, _ in recording.rounds)
    assert 0.1 < accepted / drafted < 1.0


def test_traces_from_generate_replay_with_their_round_counts(pair, tmp_path):
    """``trace_to`` writes collect's round rows and run.json: replay and train's loader read
    them, and replaying the recorded static:K gives the rounds and tokens generate() made
    (in its rounds that drafted: a last round left no room to draft has no rows)."""
    from draftctl.collect.traces import read_traces
    from draftctl.train.data import load_examples
    from draftctl.train.replay import replay

    target, draft = pair
    made = rounds = reached = 0
    for prompt in ([5, 6, 7, 8, 9], [11, 3, 40, 2], [60, 61, 62]):
        ids = torch.tensor([prompt])
        result = hf.run(target, ids, draft, controller="static:3", max_new_tokens=24,
                        do_sample=False)
        out = hf.generate(target, ids, draft, controller="static:3", max_new_tokens=24,
                          do_sample=False, trace_to=tmp_path, trace_category="writing")
        assert torch.equal(out, result.output)
        drafting = [r for r in result.rounds if r.drafted]  # a round without drafts has no rows
        made += sum(len(r.new_tokens) for r in drafting)
        rounds += len(drafting)
        reached += sum(min(r.drafted, r.n_accepted + 1) for r in result.rounds)
        assert sum(len(r.new_tokens) for r in result.rounds) == out.shape[1] - ids.shape[1]
        assert all(len(r.beta) == r.drafted for r in result.rounds)
        untimed = hf.run(target, ids, draft, controller="static:3", max_new_tokens=24,
                         do_sample=False, beta=False)  # what bench times: no beta
        assert [r.n_accepted for r in untimed.rounds] == [r.n_accepted for r in result.rounds]
        assert all(r.beta == [] for r in untimed.rounds)
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["mode"] == "rounds" and info["policy"] == "static:3"
    assert info["decoding"]["temperature"] == 0.0 and len(info["cost"]["t_verify_s"]) == 4
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == [
        "q0.parquet", "q1.parquet", "q2.parquet"]
    [static] = replay(tmp_path, ["static:3"])
    assert static["rounds"] == rounds and static["tokens"] == made
    beta = read_traces(tmp_path).column("beta").to_pylist()
    assert all(0 <= b <= 1 for b in beta)  # traces keep beta
    examples = load_examples(tmp_path)  # one example per reached draft token
    assert len(examples.y) == reached and 0 < examples.y.mean() < 1
    with pytest.raises(DraftctlError, match="differs in policy"):
        hf.generate(target, PROMPT, draft, controller="svip", max_new_tokens=8,
                    do_sample=False, trace_to=tmp_path)
    with pytest.raises(hf.HFEngineError, match="already holds trace 1"):
        hf.generate(target, PROMPT, draft, controller="static:3", max_new_tokens=8,
                    do_sample=False, trace_to=tmp_path, trace_id=1)


def test_transformers_own_schedules_are_recorded_unchanged(pair):
    """transformers' own schedules run as transformers runs them: the constant one drafts its
    K every round (bar the last), the heuristic one changes K by its rule, and the assistant's
    settings are restored after the call."""
    target, draft = pair
    plain = target.generate(PROMPT, max_new_tokens=30, do_sample=False)
    settings = draft.generation_config.to_dict()
    constant = hf.run(target, PROMPT, draft, controller="hf:constant:4", max_new_tokens=30,
                      do_sample=False)
    assert torch.equal(constant.output, plain) and constant.wall_s > 0
    assert {r.drafted for r in constant.rounds[:-1]} == {4}
    heuristic = hf.run(target, PROMPT, draft, controller="hf:heuristic:5", max_new_tokens=30,
                       do_sample=False)
    assert torch.equal(heuristic.output, plain)
    rounds = heuristic.rounds
    assert rounds[0].drafted == 5
    for r, following in itertools.pairwise(rounds[:-1]):  # the last may be cut short
        full = r.n_accepted == r.drafted
        assert following.drafted == (r.drafted + 2 if full else max(1, r.drafted - 1))
    assert draft.generation_config.to_dict() == settings
    with pytest.raises(hf.HFEngineError, match="unknown transformers schedule 'hf:often'"):
        hf.run(target, PROMPT, draft, controller="hf:often", max_new_tokens=4)


def test_generate_takes_draftctl_as_its_custom_generate(pair):
    """``model.generate(custom_generate=hf.CUSTOM_GENERATE, ...)`` runs the controlled
    assisted generation: the same output as ``hf.generate``, the controller's draft lengths."""
    target, draft = pair
    static = Recording("static:3")
    out = target.generate(PROMPT, custom_generate=hf.CUSTOM_GENERATE, trust_remote_code=True,
                          assistant_model=draft, controller=static, max_new_tokens=20,
                          do_sample=False)
    assert torch.equal(out, hf.generate(target, PROMPT, draft, controller="static:3",
                                        max_new_tokens=20, do_sample=False))
    assert {d for d, _ in static.rounds[:-1]} == {3}
    with pytest.raises(hf.HFEngineError, match="pass assistant_model"):
        target.generate(PROMPT, custom_generate=hf.CUSTOM_GENERATE, trust_remote_code=True,
                        controller="svip", max_new_tokens=4)


def test_records_in_generate_match_the_decoders_records(pair):
    """The controller sees the same v3 record inside generate() as in draftctl's decoder: the
    same distribution and path features for the same drafted tokens, the target's entropy
    from the second round on (generate() hands over no prefill logits: 0 in the first), and
    the token classes when generate() is given the tokenizer."""
    from draftctl.decode.features import token_classes
    from tests.test_models import word_tokenizer

    target, draft = pair
    result = hf.run(target, PROMPT, draft, controller="static:3", max_new_tokens=16,
                    do_sample=False)
    decoder = make_decoder(target, draft, max_new_tokens=16)
    ours = list(decoder.rounds(PROMPT[0].tolist(), make_controller("static:3")))
    assert [r.draft_tokens for r in result.rounds] == [r.draft_tokens for r in ours]
    compared = 0
    for index, (theirs, mine) in enumerate(zip(result.rounds, ours)):
        assert len(theirs.features) == len(mine.features) == theirs.drafted
        for a, b in zip(theirs.features, mine.features):
            assert a.entropy == pytest.approx(b.entropy, abs=1e-4)
            assert a.cum_logq == pytest.approx(b.cum_logq, abs=1e-4)
            assert a.target_entropy == (pytest.approx(b.target_entropy, abs=1e-4) if index
                                        else 0.0)
            compared += 1
    assert compared >= 9
    words = word_tokenizer()
    classes = token_classes(words)
    named = hf.run(target, PROMPT, draft, controller="static:3", max_new_tokens=16,
                   do_sample=False, tokenizer=words).rounds
    assert all(f.token_class == int(classes[t]) for r in named
               for f, t in zip(r.features, r.draft_tokens))
    assert {f.token_class for r in named for f in r.features} != {-1}
    assert all(f.token_class == -1 for r in result.rounds for f in r.features)
