import copy
import math

import pytest
import torch

from draftctl.controllers import REGISTRY, make_controller
from draftctl.decode import DecodeInputError, generate
from draftctl.decode.cached_lm import PassShape
from draftctl.decode.features import FeatureRecord, SequenceState, make_record
from tests.conftest import make_decoder, tiny_llama, tiny_pair

ALL_SPECS = ["none", "static:1", "static:3", "static:8", "heuristic", "confidence:0.5",
             "confidence-roc", "pmin:0.6", "svip:0.5", "adaedl", "oracle"]
PROMPTS = [[5, 6, 7, 8, 9], [1], [40, 2, 2, 17, 88, 3, 60, 61, 62, 63, 64, 12]]


def test_every_registered_controller_is_exercised():
    assert {spec.split(":")[0] for spec in ALL_SPECS} == set(REGISTRY)


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_greedy_speculative_output_equals_target_only_output(tiny_models, spec):
    target, draft = tiny_models
    decoder = make_decoder(target, draft, max_new_tokens=40)
    for prompt in PROMPTS:
        reference = generate(decoder, prompt, make_controller("none"))
        controller = make_controller(spec)
        if spec == "oracle":
            controller.set_reference(reference.output_ids)
        result = generate(decoder, prompt, controller)
        assert result.output_ids == reference.output_ids
        assert len(result.output_ids) == 40
        if spec == "oracle":  # drafts only what the target accepts
            assert all(r.n_accepted == r.drafted for r in result.rounds)
            assert sum(r.drafted for r in result.rounds) > 0


def test_target_only_output_equals_a_naive_argmax_loop(tiny_models):
    target, _ = tiny_models
    prompt = [5, 6, 7]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(12):
            ids = torch.cat([ids, target(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    result = generate(make_decoder(target, None, max_new_tokens=12), prompt,
                      make_controller("none"))
    assert result.output_ids == ids[0, 3:].tolist()


def test_speculation_saves_target_forwards_when_the_draft_agrees(tiny_models):
    target, _ = tiny_models
    decoder = make_decoder(target, target, max_new_tokens=32,  # draft == target: all accepted
                           pass_shape=PassShape(fixed=8))
    result = generate(decoder, [5, 6, 7], make_controller("static:4"))
    assert all(r.n_accepted == r.drafted for r in result.rounds)
    assert result.target_forwards < 10  # 1 prefill + ceil(32 / 5) rounds, not 33
    assert result.summary()["tau"] > 4.5


def test_round_records_are_consistent(tiny_models):
    target, draft = tiny_models
    decoder = make_decoder(target, draft, max_new_tokens=30)
    rounds = list(decoder.rounds([5, 6, 7, 8], make_controller("static:4")))
    seq_len = 4
    for r in rounds:
        assert len(r.features) == len(r.accept_prob) == len(r.beta) == r.drafted
        assert r.new_tokens[: r.n_accepted] == r.draft_tokens[: r.n_accepted]
        assert [f.draft_pos for f in r.features] == list(range(1, r.drafted + 1))
        assert [f.seq_pos for f in r.features] == list(range(seq_len, seq_len + r.drafted))
        # greedy: accept_prob is the per-token match; the accepted prefix is all ones
        assert all(p == 1.0 for p in r.accept_prob[: r.n_accepted])
        if r.n_accepted < r.drafted:
            assert r.accept_prob[r.n_accepted] == 0.0
        assert all(0.0 <= b <= 1.0 + 1e-6 for b in r.beta)
        seq_len += len(r.new_tokens)
    assert rounds[1].features[0].prev_drafted == rounds[0].drafted
    assert rounds[1].features[0].prev_accepted == rounds[0].n_accepted


def test_max_draft_caps_every_controller(tiny_models):
    target, _ = tiny_models
    decoder = make_decoder(target, target, max_new_tokens=30, max_draft=3)
    result = generate(decoder, [5, 6, 7], make_controller("svip:100"))
    assert max(r.drafted for r in result.rounds) == 3


def test_pmin_drops_the_low_confidence_token(tiny_models):
    target, draft = tiny_models
    decoder = make_decoder(target, draft, max_new_tokens=30)
    result = generate(decoder, [5, 6, 7], make_controller("pmin:0.9"))
    dropped = [r for r in result.rounds if r.discarded]
    assert dropped, "expected p-min to drop at least one token at threshold 0.9"
    for r in result.rounds:
        assert all(f.top1_prob >= 0.9 for f in r.features)  # dropped tokens are never verified


def test_generation_stops_at_eos(tiny_models):
    target, draft = tiny_models
    free = generate(make_decoder(target, draft, max_new_tokens=30), [5, 6, 7],
                    make_controller("static:4"))
    eos = free.output_ids[10]
    first = free.output_ids.index(eos)
    result = generate(make_decoder(target, draft, eos_ids=[eos], max_new_tokens=30), [5, 6, 7],
                      make_controller("static:4"))
    assert result.output_ids == free.output_ids[: first + 1]
    assert result.stop_reason == "eos"


def test_generation_stops_at_the_context_length():
    target, draft = tiny_pair(context=20)
    decoder = make_decoder(target, draft, max_new_tokens=100)
    result = generate(decoder, list(range(1, 15)), make_controller("static:4"))
    assert len(result.output_ids) == 6 and result.stop_reason == "context"


@pytest.mark.parametrize("prompt, message", [
    ([], "empty"),
    (list(range(1, 300)), "context is 256 tokens"),
    ([5, 500], "outside the vocabulary"),
])
def test_bad_prompts_are_refused(tiny_models, prompt, message):
    decoder = make_decoder(*tiny_models)
    with pytest.raises(DecodeInputError, match=message):
        generate(decoder, prompt, make_controller("static:2"))


@pytest.mark.parametrize("settings, message", [
    ({"max_new_tokens": 0}, "max_new_tokens must be > 0"),
    ({"max_new_tokens": -3}, "max_new_tokens must be > 0"),
    ({"max_draft": -1}, "max_draft must be >= 0"),
])
def test_bad_settings_are_refused(tiny_models, settings, message):
    with pytest.raises(DecodeInputError, match=message):
        make_decoder(*tiny_models, **settings)


def test_drafting_controller_without_draft_model_is_refused(tiny_models):
    decoder = make_decoder(tiny_models[0], None)
    with pytest.raises(DecodeInputError, match="no draft model"):
        generate(decoder, [1, 2], make_controller("static:2"))


def _layer_keys(lm):
    return [layer.keys[0, :, : len(lm)] for layer in lm.cache.layers]


def test_rollback_keeps_exactly_the_accepted_prefix():
    target, draft = tiny_pair(noise=0.5)
    decoder = make_decoder(target, draft, max_new_tokens=60)
    prompt = [5, 6, 7, 8]
    seq = list(prompt)
    checked = 0
    for r in decoder.rounds(prompt, make_controller("static:4")):
        seq += r.new_tokens
        if r.n_accepted == r.drafted or checked >= 3:
            continue
        checked += 1
        # Both caches hold the sequence minus its last token (the correction token).
        assert len(decoder.target) == len(seq) - 1
        assert len(decoder.drafter.lm) == len(seq) - 1
        for lm, model in ((decoder.target, target), (decoder.drafter.lm, draft)):
            fresh = make_decoder(model, None).target
            fresh.forward(torch.tensor(seq[:-1]))
            for kept, expected in zip(_layer_keys(lm), _layer_keys(fresh)):
                assert torch.allclose(kept, expected, atol=1e-5)
        # The next target logits from the rolled-back cache equal a fresh full forward.
        with torch.no_grad():
            full = target(torch.tensor([seq])).logits[0, -1]
        probe = copy.copy(decoder.target)  # shares the model, gets its own cache copy
        probe.cache = copy.deepcopy(decoder.target.cache)
        assert torch.allclose(probe.forward(torch.tensor(seq[-1:]))[-1], full, atol=1e-4)
    assert checked == 3


def test_logits_past_the_vocabulary_never_become_tokens():
    """Models may pad their output layer past the tokenizer; those ids are never emitted."""
    target = tiny_llama(vocab_size=64)
    with torch.no_grad():
        target.lm_head.weight[50:] = target.lm_head.weight[:50].abs().sum(0) * 10
    unpadded = make_decoder(target, None, max_new_tokens=20)
    assert max(generate(unpadded, [1, 2, 3], make_controller("none")).output_ids) >= 50
    padded = make_decoder(target, target, max_new_tokens=20, vocab_size=50)
    for spec in ("none", "static:3"):
        assert max(generate(padded, [1, 2, 3], make_controller(spec)).output_ids) < 50


def test_records_carry_the_targets_entropy_and_the_drafts_path_probability(tiny_models):
    """Schema v3: ``target_entropy`` is the entropy of the target's distribution over the
    round's first input token (the prompt's last token, then each round's correction or bonus
    token); ``cum_logq`` sums the log draft probabilities of the round's tokens, which is
    ``log cum_top1`` when drafting greedily and not when sampling."""
    target, draft = tiny_models
    prompt = [5, 6, 7, 8]
    decoder = make_decoder(target, draft, max_new_tokens=24)
    rounds = list(decoder.rounds(prompt, make_controller("static:3")))
    seq = prompt + [t for r in rounds for t in r.new_tokens]
    with torch.no_grad():
        logits = target(torch.tensor([seq])).logits[0].float()
    entropies = torch.special.entr(torch.softmax(logits, -1)).sum(-1)
    start = len(prompt)
    for r in rounds[:-1]:  # the last round may have no room to draft
        # the round starts after seq[:start]; its last token was chosen at position start - 2
        assert r.features[0].target_entropy == pytest.approx(float(entropies[start - 2]),
                                                             abs=1e-4)
        assert len({f.target_entropy for f in r.features}) == 1
        for f in r.features:
            assert f.cum_logq == pytest.approx(math.log(f.cum_top1), abs=1e-5)
        start += len(r.new_tokens)
    sampled = make_decoder(target, draft, max_new_tokens=24, temperature=1.0)
    rounds = list(sampled.rounds(prompt, make_controller("static:3"), seed=1))
    gaps = [f.cum_logq - math.log(f.cum_top1) for r in rounds for f in r.features]
    assert all(g <= 1e-6 for g in gaps) and min(gaps) < -1e-3  # sampled tokens: not the top


def test_token_class_features_come_from_the_tokenizer():
    """Each drafted token's class indicator follows its decoded text: a word after a space, a
    word piece, digits, punctuation, whitespace; special tokens have none."""
    from draftctl.decode.features import TOKEN_CLASS_FEATURES, classify_token, token_classes
    from tests.test_models import word_tokenizer

    assert [classify_token(t) for t in (" the", "ing", " 42", "3", ",", " (", "\n", "  ", "")] \
        == [0, 1, 2, 2, 3, 3, 4, 4, -1]
    tokenizer = word_tokenizer()
    classes = token_classes(tokenizer)
    assert classes.shape == (len(tokenizer),) and classes.dtype == torch.int8
    for special in tokenizer.all_special_ids:
        assert classes[special] == -1
    words = [i for i in range(len(tokenizer)) if tokenizer.convert_ids_to_tokens(i).startswith("w")]
    assert words and {int(classes[i]) for i in words} <= {0, 1}
    record = make_record([0.5, *[0.1] * 10, 0.2, 3.0, 0, 0, 0], 1, None, SequenceState(4))
    assert dict(zip(TOKEN_CLASS_FEATURES, record.to_vector()[-9:-4])) == {
        "tok_word_start": 0.0, "tok_word_piece": 0.0, "tok_digit": 0.0, "tok_punct": 1.0,
        "tok_space": 0.0}
    assert FeatureRecord.from_vector(record.to_vector()) == record
