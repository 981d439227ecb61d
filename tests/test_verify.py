import torch

from draftctl.decode.verify import SamplingConfig, overlap, verify_greedy, verify_sampling


def test_greedy_accepts_the_matching_prefix_and_returns_the_target_argmax():
    logits = torch.full((4, 5), -1.0)
    for row, best in enumerate([2, 3, 0, 4]):
        logits[row, best] = 1.0
    verdict = verify_greedy(torch.tensor([2, 3, 1]), logits)
    assert verdict.n_accepted == 2
    assert int(verdict.next_token) == 0  # correction = target argmax at the rejected position
    assert verdict.accept_prob.tolist() == [1.0, 1.0, 0.0]
    full = verify_greedy(torch.tensor([2, 3, 0]), logits)
    assert full.n_accepted == 3 and int(full.next_token) == 4  # bonus token


def test_greedy_with_no_draft_is_one_argmax_step():
    verdict = verify_greedy(torch.empty(0, dtype=torch.long), torch.tensor([[0.0, 2.0, 1.0]]))
    assert verdict.n_accepted == 0 and int(verdict.next_token) == 1


def test_sampling_output_follows_the_target_distribution():
    """One-token draft: the emitted first token must be distributed as p, whatever q is."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7]])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    n = 40_000
    for _ in range(n):
        x = torch.multinomial(q[0], 1, generator=gen)
        verdict = verify_sampling(x, q, p, gen)
        first = x[0] if verdict.n_accepted == 1 else verdict.next_token
        counts[int(first)] += 1
    assert torch.allclose(counts / n, p[0], atol=0.01)
    assert counts[3] == 0  # a token the target gives probability 0 is never emitted


def test_accept_prob_and_overlap():
    p = torch.tensor([[0.6, 0.4], [0.5, 0.5]])
    q = torch.tensor([[0.3, 0.7]])
    verdict = verify_sampling(torch.tensor([1]), q, p, torch.Generator().manual_seed(0))
    assert torch.allclose(verdict.accept_prob, torch.tensor([0.4 / 0.7]))
    assert torch.allclose(overlap(p[:1], q), torch.tensor([0.3 + 0.4]))


def test_sampling_config_processes_logits():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    top2 = SamplingConfig(temperature=1.0, top_k=2).probs(logits)
    assert (top2[0, 2:] == 0).all() and torch.isclose(top2.sum(), torch.tensor(1.0))
    hot = SamplingConfig(temperature=0.5).probs(logits)
    assert hot[0, 0] > torch.softmax(logits, -1)[0, 0]
    nucleus = SamplingConfig(temperature=1.0, top_p=0.5).probs(logits)
    assert nucleus[0, 0] == 1.0
