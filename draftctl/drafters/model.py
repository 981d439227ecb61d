"""Drafting with a small causal LM that shares the target's vocabulary."""

from __future__ import annotations

import torch

from draftctl.controllers.base import Action, Controller
from draftctl.decode.cached_lm import CachedLM
from draftctl.decode.features import SequenceState, draft_stats
from draftctl.decode.verify import SamplingConfig
from draftctl.drafters.base import Draft, ask_controller


class ModelDrafter:
    """Proposes tokens one draft-model step at a time, asking the controller after each.

    The draft cache lags the sequence by the tokens it has not seen yet (the last token of the
    previous round, or two after a full accept: the last draft token and the bonus token);
    ``propose`` feeds them first ("catch-up"), so the first draft step may process 1-2 tokens.
    """

    tree = False
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, lm: CachedLM, sampling: SamplingConfig,
                 token_classes: torch.Tensor | None = None,
                 head_ids: torch.Tensor | None = None):
        self.lm = lm
        self.sampling = sampling
        self.token_classes = token_classes
        # a draft whose logits span its head only (``DraftLM(head_only=True)``): column i is
        # token head_ids[i], q is 0 off the head
        self.head_ids = head_ids

    def _token(self, index: torch.Tensor) -> torch.Tensor:
        return self.head_ids[index] if self.head_ids is not None else index

    def _full(self, probs: torch.Tensor) -> torch.Tensor:
        """(n, K) head probabilities -> (n, V), 0 off the head (as they are)."""
        if self.head_ids is None:
            return probs
        full = probs.new_zeros((probs.shape[0], self.lm.vocab_size))
        full[:, self.head_ids] = probs
        return full

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
        forwards_before = self.lm.forwards
        tokens, raw, q_rows, stats, records = [], [], [], [], []
        controller_s, calls, discarded = 0.0, 0, 0
        inputs = seq[len(self.lm):]
        for i in range(budget):
            logits = self.lm.forward(inputs, last_only=True)  # (1, V), or (1, K): the head
            probs = torch.softmax(logits.float(), dim=-1)
            if self.sampling.greedy:
                index = logits.argmax(dim=-1)
            else:
                q = self.sampling.probs(logits)
                index = torch.multinomial(q, 1, generator=generator)[0]
            token = self._token(index)
            stat = draft_stats(probs, index, token, self.token_classes)
            if controller.reads_features:
                action, record, seconds = ask_controller(
                    controller, stat, i + 1, records[-1] if records else None, state, token)
                controller_s += seconds
                calls += 1
                if action is Action.DISCARD:
                    discarded = 1
                    break
                records.append(record)
            tokens.append(token)
            raw.append(self._full(probs))
            stats.append(stat)
            if not self.sampling.greedy:
                q_rows.append(self._full(q))
            if controller.reads_features and action is Action.STOP:
                break
            inputs = token
        if not tokens:
            draft = Draft.empty(self.lm.vocab_size, seq.device)
        else:
            draft = Draft(torch.cat(tokens), torch.cat(raw), torch.cat(q_rows) if q_rows else None,
                          torch.cat(stats), records if controller.reads_features else None)
        draft.forwards = self.lm.forwards - forwards_before
        draft.discarded, draft.controller_s, draft.controller_calls = discarded, controller_s, calls
        return draft

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
        tokens, stats = [], []
        for step in range(k):
            index = logits.argmax(dim=-1)
            tokens.append(self._token(index))
            stats.append(draft_stats(torch.softmax(logits.float(), -1), index, tokens[-1],
                                     self.token_classes))
            if step + 1 == k:
                break
            allowed = torch.cat([prefix_ok, *([own] * (step + 1))], dim=1)
            logits = lm.forward_masked(tokens[-1], context_len + step, allowed)
        lm.reset()
        return torch.stack(tokens, dim=1), torch.stack(stats, dim=1)
