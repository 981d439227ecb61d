"""A causal LM paired with its KV cache, with rollback by length."""

from __future__ import annotations

import torch
from transformers import DynamicCache


class CachedLM:
    """Feeds tokens to a transformers causal LM, keeping the KV cache of everything fed.

    Invariant: the cache holds the keys and values of the first ``len(self)`` tokens of the
    sequence being decoded. Rolling back rejected draft tokens is ``truncate(length)``.
    Logits are cut to ``vocab_size`` (models may pad their output layer past the tokenizer).
    """

    def __init__(self, model: torch.nn.Module, vocab_size: int):
        self.model = model
        self.vocab_size = vocab_size
        self.forwards = 0
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self._length = 0

    def __len__(self) -> int:
        return self._length

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, last_only: bool = False,
                keep: int = 0) -> torch.Tensor:
        """Feed ``tokens`` (n,) long; return logits (n, vocab), or of the last ``keep``
        tokens only (``last_only`` is ``keep=1``)."""
        out = self.model(input_ids=tokens[None], cache=self.cache, use_cache=True,
                         logits_to_keep=1 if last_only else keep)
        self._length += tokens.shape[0]
        self.forwards += 1
        return out.logits[0, :, : self.vocab_size]

    @torch.inference_mode()
    def forward_masked(self, tokens: torch.Tensor, positions: torch.Tensor,
                       allowed: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` (n,) at explicit ``positions`` (n,) under an explicit attention
        pattern: ``allowed`` (n, len(self) + n) bool, True where query i may attend to key j
        (the cached keys, then the new tokens). For trees and batched branches: several
        continuations share one cache. Returns logits (n, vocab); the cache grows by n."""
        n = tokens.shape[0]
        if allowed.shape != (n, self._length + n):
            raise ValueError(f"attention pattern has shape {tuple(allowed.shape)}, expected "
                             f"({n}, {self._length + n})")
        mask = allowed[None, None]
        if self.model.config._attn_implementation != "sdpa":  # eager: additive float mask
            dtype = next(self.model.parameters()).dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(dtype).min)
        out = self.model(input_ids=tokens[None], cache=self.cache, use_cache=True,
                         attention_mask=mask, position_ids=positions[None])
        self._length += n
        self.forwards += 1
        return out.logits[0, :, : self.vocab_size]

    def keep(self, start: int, offsets: list[int]) -> None:
        """Keep the first ``start`` cached positions, then the positions ``start + offsets``
        in that order (a verified tree path); drop the rest."""
        index = torch.cat([torch.arange(start), start + torch.tensor(offsets, dtype=torch.long)])
        for layer in self.cache.layers:
            index = index.to(layer.keys.device)
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)
        self._length = len(index)

    def truncate(self, length: int) -> None:
        """Drop cached positions ``length`` and beyond (no-op if the cache is shorter)."""
        if length < self._length:
            self.cache.crop(length - self._length)
            self._length = length
