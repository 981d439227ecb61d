"""A causal LM paired with its KV cache: preallocated, rolled back by length, and fed in passes
whose shape does not change the numbers.

Why the shape matters: a matmul kernel may sum a row's products in another order when the
matrix has another number of rows, and an attention kernel when the keys have another length.
So, in bfloat16, the target's logits for a token can differ by 0.5 between a one-token pass and
a pass of six, which is enough to flip a greedy choice, and greedy speculative decoding would
no longer equal plain decoding. Two rules remove every dependence on how tokens were split into
passes:

- the keys a pass attends to are padded to a multiple of ``KEY_BLOCK`` (masked, so they add
  exact zeros). PyTorch's CPU attention works through the keys in blocks of 512; a partly
  filled block goes through matmuls of another size, which round differently (float32 on this
  project's CPU: a query at position 150 gets other bits with 256 keys than with 192 or 320).
  With whole blocks only, every pass runs the same kernels in the same order. Lengths that
  still take another path on some machine are found once per attention geometry by probing
  the kernel (``inexact_key_lengths``), and padding skips them;
- the rows, in one of two ways. With a fixed pass shape (``fixed:M``) every pass after the
  prompt runs at exactly M rows: shorter inputs are padded (the padding's outputs and cache
  entries are dropped), longer ones go in chunks of M. Row r of a matmul then computes what it
  would compute at any other row, in any other pass of M rows. With the exact shape
  (``exact``, CPU) passes run at their own size through kernels whose rows do not depend on
  the row count (``draftctl.decode.kernels``), which spares plain decoding the padding. The
  prompt's pass (``prefill``) is the same in plain and speculative decoding, so it runs
  through the model's own, faster kernels.

With both, a token's logits depend only on the tokens before it, which makes greedy SD equal
plain decoding bit for bit, in any dtype (``tests/test_cached_lm.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from draftctl.decode.kernels import ATTENTION, QUERY_BLOCK, row_invariant_view
from draftctl.errors import DecodeInputError

KEY_BLOCK = 512  # keys per pass padded to a multiple of this: the CPU attention's block size
_GROW = KEY_BLOCK  # cache capacity grows in steps of this many positions


@dataclass(frozen=True)
class PassShape:
    """How many rows a pass over ``n`` new tokens runs at (the prompt's prefill excepted).

    fixed > 0: exactly ``fixed`` rows, longer inputs in chunks: a token's logits do not depend
        on how tokens were split into passes, so greedy SD is bit-exact (the default for the
        target, with M from the calibrated profile).
    row_invariant: n rows, through row-invariant kernels (``draftctl.decode.kernels``, CPU):
        bit-exact where ``calibrate`` checked it, and without the padding's cost.
    otherwise: ``pad_to[n - 1]`` rows when given (e.g. the cheapest m >= n on the measured
        cost curve), else n rows. Faster on some machines, but not bit-exact: opt-in.
    """

    fixed: int = 0
    pad_to: tuple[int, ...] = ()
    row_invariant: bool = False

    def __post_init__(self) -> None:
        if self.fixed < 0 or self.fixed == 1:
            raise DecodeInputError(f"a fixed pass shape needs M >= 2 rows, got {self.fixed}")
        if self.row_invariant and (self.fixed or self.pad_to):
            raise DecodeInputError("the exact pass shape runs every pass at its own size: it "
                                   "takes no fixed rows or padding")
        bad = [(n, m) for n, m in enumerate(self.pad_to, 1) if m < n]
        if bad:
            raise DecodeInputError(f"pad_to maps {bad[0][0]} tokens to {bad[0][1]} rows: a pass "
                                   "cannot run at fewer rows than it has tokens")

    @classmethod
    def parse(cls, spec: str) -> PassShape:
        """``fixed:M``, ``exact`` or ``free``; ``auto`` and ``cheapest`` need a profile (see
        ``draftctl.profile.settle``)."""
        if spec == "free":
            return cls()
        if spec == "exact":
            return cls(row_invariant=True)
        name, _, value = spec.partition(":")
        if name == "fixed" and value.isdigit() and int(value) >= 2:
            return cls(fixed=int(value))
        raise DecodeInputError(f"unknown pass shape {spec!r}: use auto, exact, fixed:M "
                               "(M >= 2), cheapest or free")

    @property
    def exact(self) -> bool:
        return self.fixed > 0 or self.row_invariant

    def rows(self, n: int) -> int:
        """Rows actually computed for ``n`` new tokens (all chunks together)."""
        if self.fixed:
            return -(-n // self.fixed) * self.fixed
        return self.pad_to[n - 1] if n <= len(self.pad_to) else n

    def chunks(self, n: int) -> list[tuple[int, int]]:
        """(first token, rows) of each pass that feeds ``n`` new tokens."""
        if self.fixed:
            return [(first, self.fixed) for first in range(0, n, self.fixed)]
        return [(0, self.rows(n))]

    def describe(self) -> str:
        if self.fixed:
            return f"fixed:{self.fixed}"
        if self.row_invariant:
            return "exact"
        return "cheapest" if self.pad_to else "free"


class _Pass(NamedTuple):
    logits: torch.Tensor  # (rows kept, vocab)
    hidden: torch.Tensor | None  # (rows, layers, H), when asked for


class BlockLayer(CacheLayerMixin):
    """One layer's keys and values in a preallocated buffer (batch size 1).

    ``update`` writes in place and returns the first ``keys_to`` keys (set by ``CachedLM``
    before each pass: the end of the new tokens, padded), the padding being whatever the buffer
    holds there (zeros or stale entries, always masked out). Rollback is moving ``length`` back.
    """

    is_croppable = True
    is_sliding = False

    def __init__(self) -> None:
        super().__init__()
        self.length = 0
        self.keys_to = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.keys = key_states.new_zeros((*key_states.shape[:2], 0, key_states.shape[-1]))
        self.values = value_states.new_zeros((*value_states.shape[:2], 0,
                                              value_states.shape[-1]))
        self.is_initialized = True

    def _reserve(self, size: int) -> None:
        if size <= self.keys.shape[2]:
            return
        capacity = -(-size // _GROW) * _GROW
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros((*old.shape[:2], capacity, old.shape[-1]))
            new[:, :, :old.shape[2]] = old
            setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        padded = max(self.keys_to, end)
        self._reserve(padded)
        self.keys[:, :, self.length:end] = key_states
        self.values[:, :, self.length:end] = value_states
        self.length = end
        return self.keys[:, :, :padded], self.values[:, :, :padded]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return max(self.keys_to, self.length + query_length), 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        self.length -= abs(tokens_to_remove)

    def keep(self, start: int, offsets: torch.Tensor) -> None:
        """Keep positions ``[0, start)`` then ``start + offsets`` (increasing), in that order."""
        index = start + offsets.to(self.device)
        for name in ("keys", "values"):
            buffer = getattr(self, name)
            buffer[:, :, start:start + len(index)] = buffer.index_select(2, index)
        self.length = start + len(index)


def padded_keys(length: int, avoid: frozenset[int] = frozenset()) -> int:
    """The smallest multiple of ``KEY_BLOCK`` >= length that is not in ``avoid``."""
    padded = -(-length // KEY_BLOCK) * KEY_BLOCK
    while padded in avoid:
        padded += KEY_BLOCK
    return padded


@functools.cache
def inexact_key_lengths(heads: int, head_dim: int, rows: int, dtype: torch.dtype,
                        device: str, longest: int) -> frozenset[int]:
    """Multiples of ``KEY_BLOCK`` up to ``longest`` at which this machine's attention kernel
    gives a query another result than at most lengths, with the keys past the query masked.

    Probes ``scaled_dot_product_attention`` as the model calls it under an explicit mask
    (heads repeated for grouped queries; ``rows`` query rows) with random data, for queries at
    several positions; a length whose outputs differ from the majority's takes another code
    path, and padding skips it. Under a second per geometry, once per process.
    """
    gen = torch.Generator().manual_seed(0)
    lengths = list(range(KEY_BLOCK, longest + KEY_BLOCK, KEY_BLOCK))
    top = lengths[-1]

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q, k, v = rand(1, heads, rows, head_dim), rand(1, heads, top, head_dim), rand(1, heads, top,
                                                                               head_dim)
    keys = torch.arange(top, device=device)
    bad: set[int] = set()
    for first in sorted({min(p, top - rows) for p in (0, 150, 700, top // 3, top - rows)}):
        positions = first + torch.arange(rows, device=device)
        outputs = {}
        for length in lengths:
            if length < first + rows:
                continue
            mask = (keys[None, :length] <= positions[:, None])[None, None]
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k[:, :, :length], v[:, :, :length], attn_mask=mask)
            outputs[length] = out.float().cpu().numpy().tobytes()
        groups: dict[bytes, list[int]] = {}
        for length, key in outputs.items():
            groups.setdefault(key, []).append(length)
        majority = max(groups.values(), key=len)
        bad.update(n for n in outputs if n not in majority)
    return frozenset(bad)


class CachedLM:
    """Feeds tokens to a transformers causal LM, keeping the KV cache of everything fed.

    Invariant: the cache holds the keys and values of the first ``len(self)`` tokens of the
    sequence being decoded. Rolling back rejected draft tokens is ``truncate(length)``.
    Logits are cut to ``vocab_size`` (models may pad their output layer past the tokenizer).
    ``shape`` sets the rows of every pass but ``prefill`` (see the module docstring); with the
    exact shape, ``model`` is the target's row-invariant view (the target itself is unchanged).
    ``forwards`` counts model calls, so a chunked pass counts once per chunk.
    ``model_kwargs`` go to every model call (a distilled draft's ``head_only``).
    """

    def __init__(self, model: torch.nn.Module, vocab_size: int, shape: PassShape | None = None,
                 model_kwargs: dict | None = None):
        self.shape = shape or PassShape()
        self.model_kwargs = model_kwargs or {}  # passed to every model call
        self.stock = model  # the prompt's pass (``prefill``)
        self.model = row_invariant_view(model) if self.shape.row_invariant else model
        self.vocab_size = vocab_size
        self.device = next(model.parameters()).device
        self.forwards = 0
        self.avoid = self._inexact_lengths() if self.shape.exact else frozenset()
        self.reset()

    def _inexact_lengths(self) -> frozenset[int]:
        config = self.model.config
        if config._attn_implementation not in ("sdpa", ATTENTION):
            return frozenset()
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        longest = min(int(getattr(config, "max_position_embeddings", 4096)), 8192)
        rows = QUERY_BLOCK if self.shape.row_invariant else self.shape.fixed
        return inexact_key_lengths(heads, head_dim, rows,
                                   next(self.model.parameters()).dtype, str(self.device),
                                   longest + 2 * KEY_BLOCK)

    def reset(self) -> None:
        self.cache = Cache(layers=[BlockLayer() for _ in range(self.model.config.num_hidden_layers)])
        self._length = 0

    def __len__(self) -> int:
        return self._length

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, keep: int = 1) -> torch.Tensor:
        """Feed a prompt in one pass of its own length, through the model's own kernels (the
        exact shape's row-invariant ones are for the passes after it); logits (keep, vocab) of
        its last ``keep`` tokens (0: all). Plain and speculative decoding prefill alike, so
        neither its shape nor its kernels need fixing."""
        return self._pass(tokens, len(tokens), None, keep, model=self.stock).logits

    @torch.inference_mode()
    def prefill_hidden(self, tokens: torch.Tensor, layers: Sequence[int],
                       keep: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed a prompt as ``prefill`` does; return the logits (keep, vocab) of its last
        ``keep`` tokens (0: all) and the hidden states (n, len(layers), H) of every token at
        ``layers`` (``output_hidden_states`` indices: 0 is the embedding)."""
        out = self._pass(tokens, len(tokens), None, keep, layers, model=self.stock)
        return out.logits, out.hidden

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, last_only: bool = False,
                keep: int = 0) -> torch.Tensor:
        """Feed ``tokens`` (n,) long; return logits (n, vocab), or of the last ``keep``
        tokens only (``last_only`` is ``keep=1``)."""
        keep = 1 if last_only else keep
        logits = self._feed(tokens, keep).logits
        return logits[-keep:] if keep else logits

    @torch.inference_mode()
    def forward_hidden(self, tokens: torch.Tensor,
                       layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed ``tokens`` (n,) long; return logits (n, vocab) and the hidden states
        (n, len(layers), H) at ``layers``, for drafters that read the target's states."""
        out = self._feed(tokens, 0, layers)
        return out.logits, out.hidden

    def _feed(self, tokens: torch.Tensor, keep: int, layers: Sequence[int] = ()) -> _Pass:
        """Feed ``tokens`` in the passes the shape asks for; the real rows' outputs."""
        n = tokens.shape[0]
        if n == 0:
            raise ValueError("no tokens to feed")
        if not self.shape.fixed and self.shape.rows(n) == n:
            return self._pass(tokens, n, None, keep, layers)
        parts = [self._pass(tokens[first:first + rows], rows, None, 0, layers)
                 for first, rows in self.shape.chunks(n)]
        return _Pass(torch.cat([p.logits for p in parts])[:n],
                     torch.cat([p.hidden for p in parts])[:n] if layers else None)

    @torch.inference_mode()
    def forward_masked(self, tokens: torch.Tensor, positions: torch.Tensor,
                       allowed: torch.Tensor, shape: PassShape | None = None) -> torch.Tensor:
        """Feed ``tokens`` (n,) at explicit ``positions`` (n,) under an explicit attention
        pattern: ``allowed`` (n, len(self) + n) bool, True where query i may attend to key j
        (the cached keys, then the new tokens). For trees and batched branches: several
        continuations share one cache. ``shape``: this call's rows, instead of the LM's.
        Returns logits (n, vocab); the cache grows by n."""
        n = tokens.shape[0]
        if allowed.shape != (n, self._length + n):
            raise ValueError(f"attention pattern has shape {tuple(allowed.shape)}, expected "
                             f"({n}, {self._length + n})")
        start = self._length
        out = []
        for first, rows in (shape or self.shape).chunks(n):
            real = min(rows, n - first)
            pattern = allowed[first:first + real, :start + first + real]
            out.append(self._pass(tokens[first:first + real], rows,
                                  (positions[first:first + real], pattern), 0).logits[:real])
        return torch.cat(out)

    def _pass(self, tokens: torch.Tensor, rows: int,
              masked: tuple[torch.Tensor, torch.Tensor] | None, keep: int,
              layers: Sequence[int] = (), model: torch.nn.Module | None = None) -> _Pass:
        """One call of ``model`` (default: the shape's) over ``tokens`` padded to ``rows``
        rows; the cache keeps the real tokens only. ``masked``: (positions, attention pattern)
        of the real tokens, else the usual causal pattern. Returns the real rows' logits (or
        their last ``keep``) and, with ``layers``, their hidden states there."""
        n, start = tokens.shape[0], self._length
        device = tokens.device
        kwargs = {}
        if masked is None and not self.shape.exact:
            # as transformers' own generation runs it: unpadded keys, the model's own causal
            # mask (none for a single row); the fastest pass, and not bit-exact
            for layer in self.cache.layers:
                layer.keys_to = 0
        else:
            total = start + rows
            padded = padded_keys(total, self.avoid)
            for layer in self.cache.layers:
                layer.keys_to = padded
            keys = torch.arange(padded, device=device)
            if masked is None:
                positions = torch.arange(start, total, device=device)
                mask = keys[None, :] <= positions[:, None]
            else:
                positions, pattern = masked
                # padding rows sit after the real ones and see the cache and themselves
                positions = torch.cat([positions, positions[-1] + 1 + torch.arange(
                    rows - n, device=device)])
                mask = torch.zeros(rows, padded, dtype=torch.bool, device=device)
                mask[:n, :start + n] = pattern
                mask[n:, :start] = True
                mask[torch.arange(n, rows, device=device),
                     torch.arange(start + n, total, device=device)] = True
            kwargs = {"attention_mask": self._mask(mask), "position_ids": positions[None]}
        if rows > n:
            tokens = torch.cat([tokens, tokens[-1:].expand(rows - n)])
        # a padded pass keeps every row's logits, so that the output layer's matmul has a
        # fixed shape too; an unpadded one keeps only what it returns
        out = (model or self.model)(input_ids=tokens[None], cache=self.cache, use_cache=True,
                         logits_to_keep=keep if rows == n else 0,
                         output_hidden_states=bool(layers), **kwargs, **self.model_kwargs)
        self.forwards += 1
        self._set_length(start + n)
        logits = out.logits[0, :, : self.vocab_size]
        if rows > n:
            logits = logits[:n]
            logits = logits[-keep:] if keep else logits
        hidden = torch.stack([out.hidden_states[i][0, :n] for i in layers], dim=1) \
            if layers else None
        return _Pass(logits, hidden)

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """(rows, keys) bool -> the 4-D mask the model's attention takes."""
        mask = allowed[None, None]
        if self.model.config._attn_implementation in ("sdpa", ATTENTION):
            return mask
        dtype = next(self.model.parameters()).dtype  # eager: additive float mask
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(dtype).min)

    def _set_length(self, length: int) -> None:
        for layer in self.cache.layers:
            layer.length = length
        self._length = length

    @torch.inference_mode()
    def keep(self, start: int, offsets: list[int]) -> None:
        """Keep the first ``start`` cached positions, then the positions ``start + offsets``
        in that order (a verified tree path); drop the rest."""
        index = torch.tensor(offsets, dtype=torch.long)
        for layer in self.cache.layers:
            layer.keep(start, index)
        self._length = start + len(offsets)

    def truncate(self, length: int) -> None:
        """Drop cached positions ``length`` and beyond (no-op if the cache is shorter)."""
        if length < self._length:
            self._set_length(length)


def exactness_splits(shape: PassShape) -> list[list[int]]:
    """The ways ``shape_is_exact`` feeds the same tokens: for ``fixed:M``, shifted by one row
    and by half a pass; for ``exact``, one pass, one token a pass, and mixed sizes on both sides
    of the attention's query block."""
    if shape.fixed:
        rows = shape.fixed
        return [[rows, rows], [1, rows, rows - 1], [rows // 2, rows, rows - rows // 2]]
    if shape.row_invariant:
        n = QUERY_BLOCK + 4
        return [[n], [1] * n, [3, 5, 8, n - 16], [QUERY_BLOCK, 1, n - QUERY_BLOCK - 1],
                [2, n - 3, 1]]
    raise ValueError(f"the {shape.describe()} pass shape is not meant to be exact")


@torch.inference_mode()
def shape_is_exact(model: torch.nn.Module, vocab_size: int, shape: PassShape,
                   tokens: torch.Tensor) -> bool:
    """Whether, on this machine, ``shape`` gives every token the same logits however the tokens
    are split into passes.

    Matmul kernels differ: MKL's float32 path on this project's CPU computes the last rows of
    a 5- to 7-row product with another kernel than the first four, so there ``fixed:6`` is not
    exact while 4 and 8 are; the exact shape's kernels may not be row-invariant on every CPU.
    tokens: a prompt, then the tokens fed after it in each of ``exactness_splits(shape)``,
    whose logits are compared. (Key lengths are checked by ``inexact_key_lengths``.)
    """
    splits = exactness_splits(shape)
    context = len(tokens) - sum(splits[0])
    if context < 1:
        raise ValueError(f"the check needs {sum(splits[0]) + 1} tokens, got {len(tokens)}")
    lm = CachedLM(model, vocab_size, shape)
    results = []
    for sizes in splits:
        lm.reset()
        lm.prefill(tokens[:context])
        at, out = context, []
        for n in filter(None, sizes):
            out.append(lm.forward(tokens[at:at + n]))
            at += n
        results.append(torch.cat(out))
    return all(torch.equal(results[0], other) for other in results[1:])
