"""Drafting with a small causal LM that shares the target's vocabulary."""

from __future__ import annotations

import torch

from draftctl.controllers.base import Controller
from draftctl.decode.cached_lm import CachedLM
from draftctl.decode.features import SequenceState
from draftctl.decode.verify import SamplingConfig
from draftctl.drafters.base import Draft, Picked, TokenPicker, branch_matches, draft_chain
from draftctl.drafters.context import LookupConfig, Match


class ModelDrafter:
    """Proposes tokens one draft-model step at a time, asking the controller after each.

    The draft cache lags the sequence by the tokens it has not seen yet (the last token of the
    previous round, or two after a full accept: the last draft token and the bonus token);
    ``propose`` feeds them first ("catch-up"), so the first draft step may process 1-2 tokens.
    A draft whose logits span its head only (``DraftLM(head_only=True)``) gives ``head_ids``:
    column i is token head_ids[i]. ``lookup`` mixes in context lookup (``drafters.lookup``).
    """

    tree = False
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, lm: CachedLM, sampling: SamplingConfig,
                 token_classes: torch.Tensor | None = None,
                 head_ids: torch.Tensor | None = None, lookup: LookupConfig | None = None):
        self.lm = lm
        self.token_classes = token_classes
        self.picker = TokenPicker(lm.vocab_size, sampling, head_ids, lookup)

    @property
    def forwards(self) -> int:
        return self.lm.forwards

    def reset(self) -> None:
        self.lm.reset()

    def accepted(self, length: int, hidden: torch.Tensor | None = None) -> None:
        """Keep at most the first ``length`` tokens of the sequence in the draft cache."""
        self.lm.truncate(length)

    def propose(self, seq: torch.Tensor, budget: int, controller: Controller,
                state: SequenceState, generator: torch.Generator) -> Draft:
        """Draft up to ``budget`` tokens after ``seq`` (1-D long on the device)."""
        if budget <= 0:
            return Draft.empty(self.lm.vocab_size, seq.device)

        def pick_next(previous: torch.Tensor | None, match: Match | None) -> Picked:
            inputs = seq[len(self.lm):] if previous is None else previous
            logits = self.lm.forward(inputs, last_only=True)  # (1, V), or (1, K): the head
            return self.picker.pick(logits, generator, self.token_classes, [match])

        return draft_chain(pick_next, seq, budget, controller, state, self.picker.lookup,
                           self.lm.vocab_size, self.token_classes)

    @torch.inference_mode()
    def continuations(self, seq: torch.Tensor, n_prompt: int, k: int,
                      hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy ``k``-token draft after every prefix ``seq[:n_prompt + t]``, t = 0 .. T-1
        (T = len(seq) - n_prompt), batched: one draft pass over the sequence gives every
        branch's first token, then each further step feeds all T branches at once, each
        attending to its own context prefix and its own earlier draft tokens
        (``CachedLM.forward_masked``). Returns tokens (T, k) and ``draft_stats`` rows
        (T, k, STATS)."""
        lm, device = self.lm, seq.device
        n_out = len(seq) - n_prompt
        lm.reset()
        logits = lm.forward(seq[:-1], keep=n_out)  # (T, V): row t continues seq[:n_prompt + t]
        base = len(lm)
        context_len = n_prompt + torch.arange(n_out, device=device)
        prefix_ok = torch.arange(base, device=device)[None, :] < context_len[:, None]
        own = torch.eye(n_out, dtype=torch.bool, device=device)
        host = seq.tolist()
        tokens, stats = [], []
        for step in range(k):
            drafted = torch.stack(tokens, dim=1).tolist() if tokens else [[]] * n_out
            picked = self.picker.pick(logits, None, self.token_classes,
                                      branch_matches(self.picker, host, n_prompt, drafted),
                                      greedy=True)
            tokens.append(picked.tokens)
            stats.append(picked.stats)
            if step + 1 == k:
                break
            allowed = torch.cat([prefix_ok, *([own] * (step + 1))], dim=1)
            logits = lm.forward_masked(tokens[-1], context_len + step, allowed)
        lm.reset()
        return torch.stack(tokens, dim=1), torch.stack(stats, dim=1)
