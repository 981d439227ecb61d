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

from draftctl.controllers.base import Controller
from draftctl.decode.cached_lm import BlockLayer
from draftctl.decode.features import SequenceState
from draftctl.decode.verify import SamplingConfig
from draftctl.distill.feature import FeatureDraftLM
from draftctl.drafters.base import Draft, Picked, TokenPicker, branch_matches, draft_chain
from draftctl.drafters.context import LookupConfig, Match
from draftctl.errors import DecodeInputError


class FeatureDrafter:
    """Proposes a chain from a ``FeatureDraftLM``, asking the controller after each token."""

    tree = False

    def __init__(self, model: FeatureDraftLM, vocab_size: int, sampling: SamplingConfig,
                 token_classes: torch.Tensor | None = None, lookup: LookupConfig | None = None):
        self.model = model
        self.vocab_size = vocab_size
        self.token_classes = token_classes
        self.picker = TokenPicker(vocab_size, sampling, model.head_ids, lookup)
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
        """Feed positions entries + 1 .. entries + n; (outputs (n, H), the last position's
        head logits (1, K))."""
        n, start = len(tokens), self.entries
        positions = torch.arange(start + 1, start + 1 + n, device=self.device)
        mask = None
        if n > 1:  # causal over the cache and the new rows
            keys = torch.arange(start + n, device=self.device)
            mask = (keys[None, :] <= (positions - 1)[:, None])[None, None]
        out, _ = self.model(tokens[None], features[None], own=own, cache=self.cache,
                            position_ids=positions[None], attention_mask=mask, logits=False)
        self.forwards += 1
        self.entries += n
        return out[0], self.model.head_logits(out[0, -1:])

    @torch.inference_mode()
    def propose(self, seq: torch.Tensor, budget: int, controller: Controller,
                state: SequenceState, generator: torch.Generator) -> Draft:
        if budget <= 0 or self.pending is None or len(self.pending) == 0:
            return Draft.empty(self.vocab_size, seq.device)
        feature = None  # the draft's own output at the last drafted position

        def pick_next(previous: torch.Tensor | None, match: Match | None) -> Picked:
            nonlocal feature
            if previous is None:  # catch up from the target's states
                catch_up = seq[self.entries + 1:self.entries + 1 + len(self.pending)]
                out, logits = self._step(catch_up, self.pending, own=False)
                self.pending = None
            else:
                out, logits = self._step(previous, feature, own=True)
            feature = out[-1:]
            # (1, K) logits: q is 0 off the head
            return self.picker.pick(logits, generator, self.token_classes, [match])

        return draft_chain(pick_next, seq, budget, controller, state, self.picker.lookup,
                           self.vocab_size, self.token_classes)

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
        out, _ = self._step(seq[1:-1], hidden[:-1], own=False)  # positions 1 .. L - 2
        base = self.entries
        first = n_prompt - 2 + torch.arange(n_out, device=device)  # entry of each branch
        feature = out[first]
        logits = self.model.head_logits(feature)
        prefix_ok = torch.arange(base, device=device)[None, :] <= first[:, None]
        own = torch.eye(n_out, dtype=torch.bool, device=device)
        host = seq.tolist()
        tokens, stats = [], []
        for step in range(k):
            drafted = torch.stack(tokens, dim=1).tolist() if tokens else [[]] * n_out
            picked = self.picker.pick(logits, None, self.token_classes,
                                      branch_matches(self.picker, host, n_prompt, drafted),
                                      greedy=True)
            token = picked.tokens
            tokens.append(token)
            stats.append(picked.stats)
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
