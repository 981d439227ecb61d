"""The drafter protocol: the draft model, the feature-level draft and REST through one loop,
each lossless; the feature draft end to end (distill --kind feature, load, decode)."""

import json

import numpy as np
import pytest
import torch

from draftctl.controllers import make_controller
from draftctl.decode import generate
from draftctl.decode.cached_lm import PassShape
from draftctl.decode.features import TOP_K
from draftctl.decode.verify import SamplingConfig
from draftctl.distill import feature
from draftctl.distill.run import DistillConfig, run_distill
from draftctl.drafters.feature import FeatureDrafter
from draftctl.drafters.retrieval import RetrievalDrafter
from draftctl.errors import DraftctlError
from draftctl.models import load_model
from draftctl.retrieval.datastore import SEPARATOR
from draftctl.retrieval.retriever import RetrievalConfig, Retriever
from tests.conftest import make_decoder, tiny_pair
from tests.test_models import save_model
from tests.test_retrieval import store
from tests.test_sampling import SAMPLING, exact_distribution, fits, sample_counts

PROMPTS = [[5, 6, 7, 8, 9], [1], [40, 2, 2, 17, 88, 3, 60, 61, 62]]
SPECS = ["static:1", "static:3", "static:7", "heuristic", "svip:0.5", "pmin:0.3", "confidence"]


def feature_draft(target, layers=(1, 2), seed=0):
    torch.manual_seed(seed)
    head = torch.arange(target.config.vocab_size)
    return feature.from_target(target, head, layers).eval()


def test_one_loop_serves_every_drafter_losslessly(tmp_path):
    target, draft = tiny_pair(vocab_size=97)
    plain = make_decoder(target, None, max_new_tokens=30)
    outputs = [generate(plain, p, make_controller("none")).output_ids for p in PROMPTS]
    corpus = [t for p, out in zip(PROMPTS, outputs) for t in (*p, *out, SEPARATOR)]
    corpus += list(np.random.default_rng(0).integers(0, 97, 500))
    drafters = {
        "model": draft,
        "feature": FeatureDrafter(feature_draft(target), 97, plain.config.sampling),
        "rest": RetrievalDrafter(Retriever(store(tmp_path, corpus), RetrievalConfig(max_nodes=8))),
    }
    for name, drafter in drafters.items():
        decoder = make_decoder(target, drafter, max_new_tokens=30)
        drafted = 0
        for prompt, expected in zip(PROMPTS, outputs):
            for spec in SPECS:
                result = generate(decoder, prompt, make_controller(spec))
                assert result.output_ids == expected, (name, spec)
                drafted += sum(r.drafted for r in result.rounds)
        assert drafted > 0, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_feature_drafter_reads_the_target_states_it_is_handed(dtype):
    """Greedy identity in both dtypes, and the draft's cache keeps exactly the entries made
    from the target's own states."""
    target, _ = tiny_pair(vocab_size=97)
    target = target.to(dtype)
    drafter = FeatureDrafter(feature_draft(target).to(dtype), 97,
                             make_decoder(target, None).config.sampling)
    decoder = make_decoder(target, drafter, max_new_tokens=40, pass_shape=PassShape(fixed=4))
    prompt = [5, 6, 7, 8, 9, 10]
    expected = generate(decoder, prompt, make_controller("none")).output_ids
    seq = list(prompt)
    for record in decoder.rounds(prompt, make_controller("static:3")):
        seq += record.new_tokens
        # the target has seen all but the newest token; the draft holds entries 1 .. seen - 1
        # made from the target's states, and the states of the newest seen position wait
        assert len(decoder.target) == len(seq) - 1
        assert drafter.entries + len(drafter.pending) == len(seq) - 1
        assert drafter.entries <= len(seq) - 2
    assert seq[len(prompt):] == expected


def test_feature_sampling_matches_the_target_distribution():
    target, _ = tiny_pair(vocab_size=6, noise=0.8, layers=2, hidden=16)
    drafter = FeatureDrafter(feature_draft(target, seed=3), 6,
                             make_decoder(target, None, **SAMPLING).config.sampling)
    decoder = make_decoder(target, drafter, max_new_tokens=3, **SAMPLING)
    exact = exact_distribution(target, decoder.config.sampling, decoder.config.pass_shape)
    assert fits(sample_counts(decoder, make_controller("static:2"), 6000), exact, 6000)


def test_distill_feature_draft_end_to_end(tmp_path):
    teacher = save_model(tmp_path / "teacher")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(
        json.dumps({"question_id": i, "category": "qa",
                    "turns": [" ".join(f"w{(i * 7 + j) % 90}" for j in range(3 + i % 4))]})
        for i in range(24)))
    config = DistillConfig(target=teacher, out=str(tmp_path / "draft"), prompts=str(prompts),
                           split="all", holdout_every=6, eval_limit=3, samples_per_prompt=1,
                           max_new_tokens=10, gen_batch=4, eval_max_new_tokens=10,
                           kind="feature", feature_layers=[1, 2], head_coverage=0.9,
                           head_sizes=[20, 40, 60], teacher_top_k=4, steps=4,
                           batch_sequences=2, eval_every=2, checkpoint_every=2, warmup_steps=1,
                           lr=3e-3, dtype="float32")
    manifest = run_distill(config)
    assert manifest["architecture"]["kind"] == "feature"
    assert manifest["architecture"]["feature_layers"] == [1, 2]
    assert {"agreement", "agreement_step2"} <= set(manifest["eval_float32"])
    assert manifest["architecture"]["head_size"] in (20, 40, 60)
    assert manifest["data"]["eval_prompts"] == 3
    target = load_model(teacher, "cpu")
    draft = load_model(config.out, "cpu", target=target)
    assert isinstance(draft.model, feature.FeatureDraftLM)
    decoder = make_decoder(target.model, FeatureDrafter(draft.model, 97,
                                                        make_decoder(target.model, None)
                                                        .config.sampling), max_new_tokens=12)
    ids = target.tokenizer("w3 w4 w5")["input_ids"]
    reference = generate(decoder, ids, make_controller("none")).output_ids
    for spec in ("static:3", "svip:0.5"):
        assert generate(decoder, ids, make_controller(spec)).output_ids == reference
    with pytest.raises(DraftctlError, match="needs|feature_layers"):
        run_distill(DistillConfig(**{**config.__dict__, "feature_layers": [],
                                     "out": str(tmp_path / "bad")}))


def test_a_loaded_draft_drafts_on_its_packed_view_on_a_cpu(tiny_models):
    """``model_drafter`` runs a CPU draft, a feature draft or a causal LM, on its packed view
    (``kernels.packed_view``: the draft's own parameters, logits equal to rounding), and the
    decode stays lossless; a draft the view cannot take (float16) drafts as it is."""
    from draftctl.decode import kernels
    from draftctl.drafters import model_drafter
    from draftctl.models import LoadedModel

    target, draft = tiny_models
    if kernels.packable(draft):
        pytest.skip(kernels.packable(draft))
    plain = make_decoder(target, None, max_new_tokens=20)
    sampling = plain.config.sampling
    features = feature_draft(target)
    loaded = {name: LoadedModel(name, model, None, torch.device("cpu"), torch.float32)
              for name, model in (("feature", features), ("model", draft))}
    drafters = {name: model_drafter(m, 97, sampling) for name, m in loaded.items()}
    assert drafters["feature"].model is kernels.packed_view(features)
    assert drafters["model"].lm.model is kernels.packed_view(draft)
    assert drafters["feature"].model.head.weight is features.head.weight
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.inference_mode():
        torch.testing.assert_close(drafters["model"].lm.model(ids).logits, draft(ids).logits)
    for name, drafter in drafters.items():
        decoder = make_decoder(target, drafter, max_new_tokens=20)
        for prompt in PROMPTS:
            reference = generate(plain, prompt, make_controller("none")).output_ids
            result = generate(decoder, prompt, make_controller("static:3"))
            assert result.output_ids == reference, name
            assert sum(r.drafted for r in result.rounds) > 0, name
    half = LoadedModel("half", tiny_pair(vocab_size=97)[1].to(torch.float16), None,
                       torch.device("cpu"), torch.float16)
    assert not isinstance(model_drafter(half, 97, sampling).lm.model.lm_head,
                          kernels.PackedLinear)


def test_dense_continuations_of_a_feature_draft_equal_its_live_drafts(tiny_models):
    """Dense traces of a feature draft: the batched continuation after every prefix equals
    what the drafter proposes there in a live round (tokens and statistics)."""
    from draftctl.decode.cached_lm import CachedLM
    from draftctl.decode.features import SequenceState

    target, _ = tiny_models
    drafter = FeatureDrafter(feature_draft(target, seed=2), 97, SamplingConfig())
    seq = torch.tensor([4, 9, 33, 2, 71, 5, 60, 18, 40, 11, 3, 27])
    n_prompt, k = 4, 5
    lm = CachedLM(target, 97)
    _, hidden = lm.prefill_hidden(seq[:-1], drafter.hidden_layers, keep=1)
    tokens, stats = drafter.continuations(seq, n_prompt, k, hidden)
    assert tokens.shape == (len(seq) - n_prompt, k)
    for t in range(len(seq) - n_prompt):
        c = n_prompt + t
        drafter.reset()
        drafter.accepted(c - 1, hidden[:c - 1])
        draft = drafter.propose(seq[:c], k, make_controller(f"static:{k}"), SequenceState(c),
                                torch.Generator())
        assert draft.tokens.tolist() == tokens[t].tolist(), t
        assert torch.allclose(draft.stats, stats[t], atol=1e-5), t


def test_unrolled_training_sees_what_the_drafter_sees(tiny_models):
    """The training-time test: step j of the unrolled draft, at the position of a round's
    j-th token, computes the logits the live drafter computes for that token when the round's
    earlier drafts are the sequence's tokens (here: the drafter's own greedy drafts)."""
    from draftctl.decode.cached_lm import CachedLM
    from draftctl.decode.features import SequenceState

    target, _ = tiny_models
    draft = feature_draft(target, seed=5)
    drafter = FeatureDrafter(draft, 97, SamplingConfig())
    context, k = torch.tensor([4, 9, 33, 2, 71, 5, 60]), 4
    lm = CachedLM(target, 97)
    _, hidden = lm.prefill_hidden(context[:-1], drafter.hidden_layers)
    drafter.accepted(len(context) - 1, hidden)
    proposed = drafter.propose(context, k, make_controller(f"static:{k}"),
                               SequenceState(len(context)), torch.Generator())
    seq = torch.cat([context, proposed.tokens, torch.tensor([1])])
    lm.reset()
    _, states = lm.prefill_hidden(seq, drafter.hidden_layers)
    ids, feats = feature._batch([(seq, states)])
    with torch.no_grad():
        per_step = feature.unrolled(draft, ids, feats, k)
    c = len(context)
    for j in range(1, k + 1):  # the j-th token sits after position c - 2 + j: column c - 3 + j
        logits = draft.head_logits(per_step[j - 1][0, c - 3 + j])
        assert int(draft.head_ids[logits.argmax()]) == int(proposed.tokens[j - 1]), j
        live = proposed.raw_probs[j - 1][draft.head_ids]
        assert torch.allclose(torch.softmax(logits, -1), live, atol=1e-5), j


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_distilled_draft_drafts_the_same_over_its_head_only(tiny_models, temperature):
    """The model drafter of a distilled draft computes over the head's columns only; its
    drafts, distributions and statistics equal those from the full-vocabulary logits (when
    sampling, its first token's distribution: a sample drawn over K columns is not the one
    drawn over V from the same generator, only from the same distribution)."""
    from draftctl.decode.cached_lm import CachedLM
    from draftctl.decode.features import SequenceState
    from draftctl.distill.model import from_target
    from draftctl.drafters.model import ModelDrafter

    target, _ = tiny_models
    draft = from_target(target, 1, torch.arange(3, 97, 2))
    sampling = SamplingConfig(temperature=temperature)
    full = ModelDrafter(CachedLM(draft, 97), sampling)
    head = ModelDrafter(CachedLM(draft, 97, model_kwargs={"head_only": True}), sampling,
                        head_ids=draft.head_ids)
    seq = torch.tensor([4, 9, 33, 2, 71])
    drafts = [d.propose(seq, 6, make_controller("static:6"), SequenceState(5),
                        torch.Generator().manual_seed(7)) for d in (full, head)]
    assert set(drafts[1].tokens.tolist()) <= set(draft.head_ids.tolist())
    same = slice(None) if temperature == 0 else slice(0, 1)
    if temperature == 0:
        assert drafts[0].tokens.tolist() == drafts[1].tokens.tolist()
    else:
        assert torch.allclose(drafts[0].q_draft[same], drafts[1].q_draft[same], atol=1e-6)
    assert torch.allclose(drafts[0].raw_probs[same], drafts[1].raw_probs[same], atol=1e-6)
    spread = slice(0, 1 + TOP_K)  # entropy and top probabilities (the tokens may differ)
    assert torch.allclose(drafts[0].stats[same, spread], drafts[1].stats[same, spread], atol=1e-5)
    tokens, stats = head.continuations(torch.cat([seq, drafts[0].tokens]), 5, 3)
    reference = full.continuations(torch.cat([seq, drafts[0].tokens]), 5, 3)
    assert torch.equal(tokens, reference[0]) and torch.allclose(stats, reference[1], atol=1e-5)


def test_head_only_sampling_matches_the_target_distribution():
    """A distilled draft over part of the vocabulary (q is 0 off its head), drafting over its
    head's columns: SD's output still has the target's distribution."""
    from draftctl.decode.cached_lm import CachedLM
    from draftctl.distill.model import from_target
    from draftctl.drafters.model import ModelDrafter

    target, _ = tiny_pair(vocab_size=6, noise=0.8, layers=2, hidden=16)
    draft = from_target(target, 1, torch.tensor([0, 2, 3, 5]))
    sampling = make_decoder(target, None, **SAMPLING).config.sampling
    drafter = ModelDrafter(CachedLM(draft, 6, model_kwargs={"head_only": True}), sampling,
                           head_ids=draft.head_ids)
    decoder = make_decoder(target, drafter, max_new_tokens=3, **SAMPLING)
    exact = exact_distribution(target, decoder.config.sampling, decoder.config.pass_shape)
    assert fits(sample_counts(decoder, make_controller("static:2"), 6000), exact, 6000)
