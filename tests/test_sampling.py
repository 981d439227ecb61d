"""Sampling is lossless: SD's output has exactly the processed target distribution."""

import copy
import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from draftctl.controllers import make_controller
from draftctl.decode import SamplingConfig
from draftctl.decode.cached_lm import CachedLM, PassShape
from tests.conftest import make_decoder, tiny_pair

VOCAB = 6
PROMPT = [1, 4, 2]
N_TOKENS = 3
N_SAMPLES = 12_000
SAMPLING = {"temperature": 0.9, "top_k": 5, "top_p": 1.0}


@pytest.fixture(scope="module")
def pair():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model is all overhead; a second thread only spins
    yield tiny_pair(vocab_size=VOCAB, noise=0.8, layers=1, hidden=16)
    torch.set_num_threads(threads)


def exact_distribution(model, sampling: SamplingConfig,
                       shape: PassShape | None = None) -> dict[tuple[int, ...], float]:
    """P(first N_TOKENS tokens) under target-only sampling, by enumeration. With a fixed pass
    shape, the logits come from passes of that shape, as the decoder computes them (in
    bfloat16 a batched full forward rounds differently)."""
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    lm = CachedLM(model, VOCAB, shape) if shape else None

    def last_logits(prefix: tuple[int, ...]) -> torch.Tensor:
        if lm is None:
            return model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1]
        lm.reset()
        lm.prefill(torch.tensor(PROMPT[:-1]))
        return lm.forward(torch.tensor(PROMPT[-1:] + list(prefix)))[-1]

    with torch.no_grad():
        for _ in range(N_TOKENS):
            prefixes = list(probs)
            logits = torch.stack([last_logits(p) for p in prefixes])
            next_probs = sampling.probs(logits).tolist()
            probs = {p + (t,): probs[p] * next_probs[i][t]
                     for i, p in enumerate(prefixes) for t in range(VOCAB)}
    return probs


def sample_counts(decoder, controller, n: int) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(n):
        out = tuple(t for r in decoder.rounds(PROMPT, controller, seed=seed) for t in r.new_tokens)
        counts[out] = counts.get(out, 0) + 1
    return counts


def fits(counts: dict, exact: dict, n: int) -> bool:
    """Chi-square goodness of fit at p > 1e-3, pooling outcomes with expected count < 5;
    any outcome the target cannot produce fails outright."""
    if not set(counts) <= {k for k, v in exact.items() if v > 0}:
        return False
    big = [k for k, v in exact.items() if v * n >= 5]
    observed = [counts.get(k, 0) for k in big]
    expected = [exact[k] * n for k in big]
    if n - sum(expected) > 1e-9:
        observed.append(n - sum(observed))
        expected.append(n - sum(expected))
    expected = np.array(expected) * sum(observed) / sum(expected)
    return chisquare(observed, expected).pvalue > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_speculative_sampling_matches_the_target_distribution(pair, dtype):
    target, draft = (copy.deepcopy(m).to(dtype) for m in pair)
    decoder = make_decoder(target, draft, max_new_tokens=N_TOKENS, **SAMPLING)
    exact = exact_distribution(target, decoder.config.sampling, decoder.config.pass_shape)
    assert fits(sample_counts(decoder, make_controller("static:2"), N_SAMPLES), exact, N_SAMPLES)
    # The test has power: the draft's own distribution, sampled as often, does not fit.
    draft_exact = exact_distribution(draft, decoder.config.sampling)
    keys = sorted(draft_exact)
    weights = np.array([draft_exact[k] for k in keys])
    draws = np.random.default_rng(0).choice(len(keys), size=N_SAMPLES, p=weights / weights.sum())
    draft_counts = {keys[i]: int(c) for i, c in zip(*np.unique(draws, return_counts=True))}
    assert not fits(draft_counts, exact, N_SAMPLES)


def test_sampling_is_deterministic_for_a_seed(pair):
    target, draft = pair
    decoder = make_decoder(target, draft, max_new_tokens=8, **SAMPLING)
    controller = make_controller("svip:0.5")
    runs = [[t for r in decoder.rounds(PROMPT, controller, seed=7) for t in r.new_tokens]
            for _ in range(2)]
    assert runs[0] == runs[1]
    other = [[t for r in decoder.rounds(PROMPT, controller, seed=s) for t in r.new_tokens]
             for s in range(8, 14)]
    assert any(o != runs[0] for o in other)


def test_every_output_sequence_is_possible_under_the_target(pair):
    target, draft = pair
    decoder = make_decoder(target, draft, max_new_tokens=N_TOKENS, **SAMPLING)
    exact = exact_distribution(target, decoder.config.sampling)
    counts = sample_counts(decoder, make_controller("pmin:0.5"), 2000)
    possible = {k for k, v in exact.items() if v > 0}
    assert set(counts) <= possible
    assert len(set(itertools.chain.from_iterable(counts))) > 1
