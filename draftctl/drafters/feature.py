"""Drafting with a feature-level draft (``draftctl.distill.feature.FeatureDraftLM``), which
reads the target's hidden states.

The draft keeps its own KV cache (one layer): its entry for position p was computed from the
token ``x_p`` and the target's states at ``p - 1``. After each verification the loop hands
over the target's states at the positions it has just seen (``accepted``); entries that were
computed from the draft's own features (its drafted tokens) are dropped, and the next
``propose`` first computes the entries it can now compute from the target's states, one pass
for all of them ("catch-up"); the last of these predicts the first draft token, and each
further draft token feeds the draft's own output back as the feature.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from draftctl.controllers.base import Action, Controller
from draftctl.decode.cached_lm import BlockLayer
from draftctl.decode.features import SequenceState, draft_stats
from draftctl.decode.verify import SamplingConfig
from draftctl.distill.feature import FeatureDraftLM
from draftctl.drafters.base import Draft, ask_controller
from draftctl.errors import DecodeInputError


class FeatureDrafter:
    """Proposes a chain from a ``FeatureDraftLM``, asking the controller after each token."""

    tree = False

    def __init__(self, model: FeatureDraftLM, vocab_size: int, sampling: SamplingConfig,
                 token_classes: torch.Tensor | None = None):
        self.model = model
        self.vocab_size = vocab_size
        self.sampling = sampling
        self.token_classes = token_classes
        self.hidden_layers = model.feature_layers
        self.device = model.head.weight.device
        self.forwards = 0
        self.reset()

    def reset(self) -> None:
        self.cache = Cache(layers=[BlockLayer()])
        self.entries = 0  # the cache holds positions 1 .. entries
        self.pending = None  # the target's states at positions entries .. seen - 1

    def accepted(self, length: int, hidden: torch.Tensor | None = None) -> None:
        first = length - len(hidden)  # hidden covers positions first .. length - 1
        if self.entries > first:  # entries past it came from the draft's own features
            self._truncate(first)
        self.pending = hidden if self.pending is None else torch.cat([self.pending, hidden])

    def _truncate(self, entries: int) -> None:
        self.cache.layers[0].length = entries
        self.entries = entries

    def _step(self, tokens: torch.Tensor, features: torch.Tensor, own: bool) -> tuple:
        """Feed positions entries + 1 .. entries + n; (outputs (n, H), head logits (n, K))."""
        n, start = len(tokens), self.entries
        positions = torch.arange(start + 1, start + 1 + n, device=self.device)
        mask = None
        if n > 1:  # causal over the cache and the new rows
            keys = torch.arange(start + n, device=self.device)
            mask = (keys[None, :] <= (positions - 1)[:, None])[None, None]
        out, logits = self.model(tokens[None], features[None], own=own, cache=self.cache,
                                 position_ids=positions[None], attention_mask=mask)
        self.forwards += 1
        self.entries += n
        return out[0], logits[0]

    @torch.inference_mode()
    def propose(self, seq: torch.Tensor, budget: int, controller: Controller,
                state: SequenceState, generator: torch.Generator) -> Draft:
        if budget <= 0 or self.pending is None or len(self.pending) == 0:
            return Draft.empty(self.vocab_size, seq.device)
        catch_up = seq[self.entries + 1:self.entries + 1 + len(self.pending)]
        out, logits = self._step(catch_up, self.pending, own=False)
        self.pending = None
        feature, logits = out[-1:], logits[-1:]
        head_ids = self.model.head_ids
        tokens, raw, q_rows, stats, records = [], [], [], [], []
        controller_s, calls, discarded = 0.0, 0, 0
        for i in range(budget):
            if i:
                out, logits = self._step(tokens[-1], feature, own=True)
                feature = out
            probs = torch.softmax(logits.float(), dim=-1)  # (1, K): q is 0 off the head
            if self.sampling.greedy:
                index = logits.argmax(dim=-1)
            else:
                q = self.sampling.probs(logits)
                index = torch.multinomial(q, 1, generator=generator)[0]
            token = head_ids[index]
            stat = draft_stats(probs, index, token, self.token_classes)
            action = Action.CONTINUE
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
            if action is Action.STOP:
                break
        if not tokens:
            return Draft.empty(self.vocab_size, seq.device)
        return Draft(torch.cat(tokens), torch.cat(raw), torch.cat(q_rows) if q_rows else None,
                     torch.cat(stats), records if controller.reads_features else None,
                     discarded=discarded, controller_s=controller_s, controller_calls=calls)

    def _full(self, probs: torch.Tensor) -> torch.Tensor:
        """(1, K) head probabilities -> (1, V) over the vocabulary, 0 off the head."""
        full = probs.new_zeros((1, self.vocab_size))
        full[:, self.model.head_ids] = probs
        return full

    @torch.inference_mode()
    def continuations(self, seq: torch.Tensor, n_prompt: int, k: int,
                      hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy ``k``-token draft after every prefix ``seq[:n_prompt + t]`` as
        ``propose`` would draft it, batched. hidden: (len(seq) - 1, layers, H) the target's
        states at positions 0 .. len(seq) - 2. One pass computes the cache entries of
        positions 1 .. len(seq) - 2 from the target's states (each branch's first token comes
        from the entry at its last context position); each further step feeds all T branches
        at once, each attending to the entries of its own context and its own earlier draft
        tokens. Returns tokens (T, k) and ``draft_stats`` rows (T, k, STATS)."""
        if hidden is None or n_prompt < 2:
            raise DecodeInputError("a feature draft's dense continuations need the target's "
                                   "states and a prompt of at least two tokens")
        device = seq.device
        n_out = len(seq) - n_prompt
        self.reset()
        out, logits = self._step(seq[1:-1], hidden[:-1], own=False)  # positions 1 .. L - 2
        base = self.entries
        first = n_prompt - 2 + torch.arange(n_out, device=device)  # entry of each branch
        feature, logits = out[first], logits[first]
        prefix_ok = torch.arange(base, device=device)[None, :] <= first[:, None]
        own = torch.eye(n_out, dtype=torch.bool, device=device)
        tokens, stats = [], []
        for step in range(k):
            index = logits.argmax(dim=-1)
            token = self.model.head_ids[index]
            tokens.append(token)
            stats.append(draft_stats(torch.softmax(logits.float(), -1), index, token,
                                     self.token_classes))
            if step + 1 == k:
                break
            allowed = torch.cat([prefix_ok, *([own] * (step + 1))], dim=1)
            positions = first + 2 + step  # the branch's step-th draft token's position
            out, logits = self.model(token[None], feature[None], own=True, cache=self.cache,
                                     position_ids=positions[None],
                                     attention_mask=allowed[None, None])
            self.forwards += 1
            feature, logits = out[0], logits[0]
        self.reset()
        return torch.stack(tokens, dim=1), torch.stack(stats, dim=1)
