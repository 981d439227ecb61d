"""Pure accept functions: greedy and lossless speculative sampling (methods.md section 1).

Names follow the methods reference: ``p_target`` is the target distribution, ``q_draft`` the
draft distribution, both *after* temperature / top-k / top-p processing, so that the output
is distributed exactly as the processed target distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from draftctl.errors import DecodeInputError


@dataclass(frozen=True)
class SamplingConfig:
    """Decoding mode. ``temperature == 0`` means greedy; top-k / top-p apply when sampling."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise DecodeInputError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise DecodeInputError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise DecodeInputError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Processed distribution: (n, V) logits -> (n, V) float32 probabilities."""
        scores = logits.float()
        if self.temperature != 1:
            scores = TemperatureLogitsWarper(self.temperature)(None, scores)
        if self.top_k:
            scores = TopKLogitsWarper(self.top_k)(None, scores)
        if self.top_p < 1:
            scores = TopPLogitsWarper(self.top_p)(None, scores)
        return torch.softmax(scores, dim=-1)


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft.

    n_accepted: length of the accepted prefix of the draft (host int).
    next_token: () long tensor on the device, the correction (after a rejection) or the
        bonus token (after a full accept).
    accept_prob: (k,) per-token ``min(1, p/q)``; in greedy mode 1.0 if the token is the
        target's argmax, else 0.0. Computed for every drafted token, reached or not.
    tree_path: for a tree draft, the accepted nodes from the root down; None for a chain,
        whose accepted tokens are its first ``n_accepted``.
    """

    n_accepted: int
    next_token: torch.Tensor
    accept_prob: torch.Tensor
    tree_path: list[int] | None = None

    @property
    def path(self) -> list[int] | slice:
        """Index of the accepted draft tokens, in order."""
        return self.tree_path if self.tree_path is not None else slice(0, self.n_accepted)


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Accept while the draft token is the target's argmax; the next token is the argmax.

    draft_tokens: (k,) long; target_logits: (k+1, V), row i scores the token after i drafts.
    """
    k = draft_tokens.shape[0]
    target_argmax = target_logits.argmax(dim=-1)
    matches = draft_tokens == target_argmax[:k]
    n_accepted = int(matches.cumprod(0).sum()) if k else 0
    return Verdict(n_accepted, target_argmax[n_accepted], matches.float())


def verify_sampling(draft_tokens: torch.Tensor, q_draft: torch.Tensor, p_target: torch.Tensor,
                    generator: torch.Generator) -> Verdict:
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Accept ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection
    sample the correction from ``norm(max(0, p_i - q_i))``; after a full accept sample a bonus
    token from ``p_{k+1}``. The returned tokens are distributed exactly as ``p_target``.

    draft_tokens: (k,) long, sampled from q_draft; q_draft: (k, V); p_target: (k+1, V).
    """
    k = draft_tokens.shape[0]
    rows = torch.arange(k, device=draft_tokens.device)
    p_x = p_target[rows, draft_tokens]
    q_x = q_draft[rows, draft_tokens]
    accept_prob = torch.clamp(p_x / q_x, max=1.0)
    uniform = torch.rand(k, generator=generator, device=draft_tokens.device)
    accepted = uniform < accept_prob
    n_accepted = int(accepted.cumprod(0).sum()) if k else 0
    if n_accepted < k:
        residual = torch.clamp(p_target[n_accepted] - q_draft[n_accepted], min=0)
        # p == q exactly makes the residual empty, but then the token cannot be rejected;
        # the guard only protects against float round-off (and needs no host sync).
        dist = torch.where(residual.sum() > 0, residual, p_target[n_accepted])
    else:
        dist = p_target[k]
    next_token = torch.multinomial(dist, 1, generator=generator)[0]
    return Verdict(n_accepted, next_token, accept_prob)


def overlap(p_target: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """``beta = sum_v min(p(v), q(v)) = 1 - TV(p, q)``, the expected acceptance: (k, V) -> (k,)."""
    return torch.minimum(p_target, q_draft).sum(dim=-1)
