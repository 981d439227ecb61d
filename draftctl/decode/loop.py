"""The decode loop: a generator of round records.

One code path serves plain autoregressive decoding (a round that drafts nothing is one target
step) and speculative decoding (draft k tokens, one target pass over k + 1 positions, accept a
prefix, append the correction or bonus token, roll both caches back to the accepted prefix).

Cache invariant at the start of every round, for a sequence ``seq`` of length L: the target
cache holds ``seq[:L-1]`` (its last token is fed with the draft), the draft cache holds a
prefix of ``seq`` (it catches up when it next drafts).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from draftctl.controllers.base import Controller
from draftctl.controllers.rules import ReferenceOracle
from draftctl.decode.cached_lm import CachedLM, PassShape
from draftctl.decode.features import (
    FeatureRecord,
    SequenceState,
    entropy,
    records_from_stats,
    token_classes,
)
from draftctl.decode.tree import verify_tree
from draftctl.decode.verify import SamplingConfig, Verdict, overlap, verify_greedy, verify_sampling
from draftctl.drafters.base import Draft, Drafter
from draftctl.drafters.context import LookupConfig
from draftctl.errors import DecodeInputError
from draftctl.models import LoadedModel, check_same_vocabulary
from draftctl.retrieval.features import tried_chain

DEFAULT_ROWS = 4  # the library's fixed pass shape when no profile chose one


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = 128
    max_draft: int = 16  # hard cap on draft tokens per round, whatever the controller says
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0
    # The rows of every target pass after the prompt (see ``cached_lm``): a fixed shape makes
    # greedy SD equal plain decoding bit for bit in any dtype. Jobs take M from the profile.
    pass_shape: PassShape = field(default_factory=lambda: PassShape(fixed=DEFAULT_ROWS))

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise DecodeInputError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.max_draft < 0:
            raise DecodeInputError(f"max_draft must be >= 0, got {self.max_draft}")


@dataclass
class DecodingOptions:
    """The decoding settings jobs share as flat config keys; ``decode_config()`` builds the
    decoder's config from them (and checks them)."""

    max_new_tokens: int = 128
    max_draft: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    # auto: the calibrated dtypes (profile); or float32, bfloat16, ... for both models
    dtype: str = "auto"
    # auto: fixed at the profile's M; fixed:M; cheapest / free: faster, not bit-exact (opt-in)
    pass_shape: str = "auto"
    profile: str | None = None  # a profile file; default: this pair's calibrated one

    def decode_config(self, shape: PassShape | None = None) -> DecodeConfig:
        """The decoder's config (numbers checked); ``shape``: the settled pass shape."""
        if self.pass_shape not in ("auto", "cheapest"):
            PassShape.parse(self.pass_shape)  # a bad spec fails before any model loads
        return DecodeConfig(max_new_tokens=self.max_new_tokens, max_draft=self.max_draft,
                            sampling=SamplingConfig(self.temperature, self.top_k, self.top_p),
                            seed=self.seed, **({"pass_shape": shape} if shape else {}))


@dataclass
class RoundRecord:
    """What happened in one round.

    draft_tokens / features / accept_prob / beta: one entry per drafted (verified) token.
    accept_prob: ``min(1, p/q)``; greedy: 1.0 if the token is the target's argmax else 0.0.
    target_argmax: the target's most likely token at each drafted position.
    beta: ``sum_v min(p, q)`` (expected acceptance); on the processed distributions when
        sampling, on the temperature-1 softmaxes in greedy mode (processed ones are one-hot).
    new_tokens: tokens appended to the output: accepted drafts then the correction or bonus
        token, cut after EOS.
    discarded: draft tokens the controller dropped before verification (p-min).
    tree_parents: retrieval drafts only: each draft token's parent index (-1 under the root);
        the tokens form a trie, ``target_argmax`` is the target's argmax after each token's
        parent, and ``accept_prob`` is 1.0 on the accepted path. Empty for a chain.
    """

    index: int
    draft_tokens: list[int]
    features: list[FeatureRecord]
    n_accepted: int
    accept_prob: list[float]
    beta: list[float]
    target_argmax: list[int]
    new_tokens: list[int]
    discarded: int
    draft_forwards: int
    draft_time_s: float
    verify_time_s: float
    controller_time_s: float
    controller_calls: int
    tree_parents: list[int] = field(default_factory=list)

    @property
    def drafted(self) -> int:
        return len(self.draft_tokens)


class _Stopwatch:
    """Wall time between marks; CUDA events on GPU so that timing adds no host sync."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def spans(self) -> list[float]:
        """Seconds between consecutive marks; call after the device work is done."""
        m, self.marks = self.marks, []
        if self.cuda:
            m[-1].synchronize()
            return [a.elapsed_time(b) / 1000 for a, b in itertools.pairwise(m)]
        return [b - a for a, b in itertools.pairwise(m)]


class SpeculativeDecoder:
    """Batch-size-1 draft/verify decoder over a transformers causal LM.

    target: the target model. drafter: where drafts come from (``draftctl.drafters``: a draft
    model, REST retrieval, ...), or None: then only controllers that never draft, such as
    ``none``, can run. Chain drafts are verified in one pass at the target's pass shape, tree
    drafts under a tree attention mask (``decode.tree``; greedy only). vocab_size: ids the
    tokenizer defines; logits past it (output-layer padding) are ignored. eos_ids: ids that
    end generation.
    """

    def __init__(self, target: torch.nn.Module, drafter: Drafter | None, *,
                 vocab_size: int, eos_ids: Sequence[int], context_length: int,
                 config: DecodeConfig | None = None):
        self.config = config or DecodeConfig()
        if drafter is not None and drafter.tree and not self.config.sampling.greedy:
            raise DecodeInputError(
                "tree drafts (retrieval) are verified as a trie of candidates, and draftctl "
                "has no lossless multi-candidate sampling rule for them: use greedy decoding "
                "(temperature 0)")
        self.target = CachedLM(target, vocab_size, self.config.pass_shape)
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.eos_ids = frozenset(eos_ids)
        self.context_length = context_length
        self.device = next(target.parameters()).device

    @classmethod
    def from_loaded(cls, target: LoadedModel, draft: LoadedModel | Drafter | None,
                    config: DecodeConfig | None = None,
                    lookup: LookupConfig | None = None) -> SpeculativeDecoder:
        """Pair a loaded target with a loaded draft model (refused before any compute if its
        vocabulary differs), mixed with context ``lookup`` if given, or with any other
        drafter."""
        config = config or DecodeConfig()
        context = target.context_length
        drafter = draft
        if isinstance(draft, LoadedModel):
            check_same_vocabulary(target.tokenizer, draft.tokenizer, target.spec, draft.spec)
            if draft.device != target.device:
                raise DecodeInputError(f"draft is on {draft.device}, target on {target.device}")
            context = min(context, draft.context_length)
            from draftctl.drafters import model_drafter

            drafter = model_drafter(draft, len(target.tokenizer), config.sampling, lookup)
        if drafter is not None:
            drafter.token_classes = token_classes(target.tokenizer)
        return cls(target.model, drafter, vocab_size=len(target.tokenizer),
                   eos_ids=target.eos_token_ids, context_length=context, config=config)

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        if len(prompt_ids) == 0:
            raise DecodeInputError("the prompt is empty: give at least one token")
        if len(prompt_ids) >= self.context_length:
            raise DecodeInputError(
                f"the prompt has {len(prompt_ids)} tokens but the model context is "
                f"{self.context_length} tokens; shorten the prompt")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise DecodeInputError(f"prompt token id {bad[0]} is outside the vocabulary "
                                   f"(size {self.vocab_size})")

    def rounds(self, prompt_ids: Sequence[int], controller: Controller,
               seed: int | None = None) -> Iterator[RoundRecord]:
        """Decode after ``prompt_ids``, yielding one ``RoundRecord`` per round.

        seed: sampling seed for this sequence (default ``config.seed``).
        """
        self.check_prompt(prompt_ids)
        if isinstance(controller, ReferenceOracle) and self.drafter is not None \
                and self.drafter.tree:
            raise DecodeInputError("the oracle follows a model draft's chain; it does not "
                                   "apply to tree (retrieval) drafts")
        cfg = self.config
        generator = torch.Generator(self.device).manual_seed(cfg.seed if seed is None else seed)
        seq = torch.tensor(list(prompt_ids), dtype=torch.long, device=self.device)
        self.target.reset()
        if self.drafter is not None:
            self.drafter.reset()
        controller.reset()
        layers = self.drafter.hidden_layers if self.drafter is not None else ()
        target_entropy = 0.0  # of the target's distribution over the last token it has seen
        if len(seq) > 1:  # all but the last token, which goes with the draft
            if layers:
                logits, hidden = self.target.prefill_hidden(seq[:-1], layers)
                self.drafter.accepted(len(seq) - 1, hidden)
            else:
                logits = self.target.prefill(seq[:-1])
            target_entropy = float(entropy(logits[-1]))
        state = SequenceState(len(seq), target_entropy=target_entropy)
        produced, index = 0, 0
        watch = _Stopwatch(self.device)
        while produced < cfg.max_new_tokens and len(seq) < self.context_length:
            budget = min(controller.max_draft(), cfg.max_draft,
                         cfg.max_new_tokens - produced - 1, self.context_length - len(seq) - 1)
            if budget > 0 and self.drafter is None:
                raise DecodeInputError(
                    f"controller {controller.spec or controller!r} drafts tokens but no draft "
                    "model was given")
            watch.mark()
            forwards = self.drafter.forwards if self.drafter is not None else 0
            draft = self.drafter.propose(seq, budget, controller, state, generator) \
                if budget > 0 else Draft.empty(self.vocab_size, self.device)
            if self.drafter is not None:
                draft.forwards = self.drafter.forwards - forwards
            watch.mark()
            if draft.is_tree and len(draft.tokens):
                verdict, beta, target_argmax = self._verify_tree(seq, draft)
                tried = [draft.records[k] for k in tried_chain(verdict.tree_path, draft.parents)]
                target_entropy = 0.0  # a tree pass keeps argmaxes only
            else:
                verdict, beta, target_argmax, target_entropy = self._verify(seq, draft,
                                                                            generator)
                tried = None
            n = verdict.n_accepted
            new = torch.cat([draft.tokens[verdict.path], verdict.next_token.view(1)])
            watch.mark()
            draft_s, verify_s = watch.spans()
            new_host = new.tolist()
            eos_at = next((i for i, t in enumerate(new_host) if t in self.eos_ids), None)
            if eos_at is not None:
                new, new_host = new[: eos_at + 1], new_host[: eos_at + 1]
            records = draft.records
            if records is None:
                records = records_from_stats(draft.stats.tolist(), state)
            controller.observe(records if tried is None else tried, n)
            yield RoundRecord(
                index=index, draft_tokens=draft.tokens.tolist(), features=records,
                n_accepted=n, accept_prob=verdict.accept_prob.tolist(), beta=beta.tolist(),
                target_argmax=target_argmax.tolist(), new_tokens=new_host,
                discarded=draft.discarded, draft_forwards=draft.forwards,
                draft_time_s=draft_s, verify_time_s=verify_s,
                controller_time_s=draft.controller_s, controller_calls=draft.controller_calls,
                tree_parents=draft.parents or [])
            seq = torch.cat([seq, new])
            produced += len(new_host)
            state = state.after_round(len(seq), len(records), n, target_entropy)
            index += 1
            if eos_at is not None:
                return

    def _verify(self, seq: torch.Tensor, draft: Draft,
                generator: torch.Generator) -> tuple[Verdict, torch.Tensor, torch.Tensor, float]:
        """One target pass over the last token and a chain draft, then roll both caches back
        to the accepted prefix. Returns the verdict, per-token beta (k,), target argmax (k,)
        and the entropy of the target's distribution at the round's next token."""
        k = draft.tokens.shape[0]
        fed = torch.cat([seq[len(self.target):], draft.tokens])
        layers = self.drafter.hidden_layers if self.drafter is not None else ()
        if layers:
            target_logits, hidden = self.target.forward_hidden(fed, layers)
            target_logits = target_logits[-(k + 1):]
        else:
            target_logits, hidden = self.target.forward(fed)[-(k + 1):], None  # (k+1, V)
        sampling = self.config.sampling
        if sampling.greedy:
            verdict = verify_greedy(draft.tokens, target_logits)
            beta = overlap(torch.softmax(target_logits[:k].float(), -1), draft.raw_probs) \
                if draft.raw_probs is not None else target_logits.new_zeros(0)
        else:
            p_target = sampling.probs(target_logits)
            q_draft = draft.q_draft if k else p_target[:0]
            verdict = verify_sampling(draft.tokens, q_draft, p_target, generator)
            beta = overlap(p_target[:k], q_draft)
        self.target.truncate(len(seq) + verdict.n_accepted)
        if self.drafter is not None:  # the fed tokens up to the accepted drafts are verified
            verified = len(fed) - k + verdict.n_accepted
            self.drafter.accepted(len(seq) + verdict.n_accepted,
                                  hidden[:verified] if hidden is not None else None)
        return (verdict, beta, target_logits[:k].argmax(dim=-1),
                float(entropy(target_logits[verdict.n_accepted])))

    def _verify_tree(self, seq: torch.Tensor,
                     draft: Draft) -> tuple[Verdict, torch.Tensor, torch.Tensor]:
        """One tree pass over the last token and the trie (greedy), keeping the accepted
        path's cache entries. Returns the verdict (``accept_prob`` 1.0 on the path), an empty
        beta, and the target's argmax after each node's parent."""
        path, argmax = verify_tree(self.target, seq, draft.tokens, draft.parents)
        accept = torch.zeros(len(draft.tokens), device=self.device)
        accept[path] = 1.0
        after_parent = torch.tensor([argmax[p + 1] for p in draft.parents], device=self.device)
        bonus = torch.tensor(argmax[path[-1] + 1 if path else 0], device=self.device)
        self.drafter.accepted(len(seq) + len(path))
        return Verdict(len(path), bonus, accept, path), accept.new_zeros(0), after_parent


@dataclass
class GenerationResult:
    """A finished generation and the rounds that made it."""

    prompt_ids: list[int]
    output_ids: list[int]
    rounds: list[RoundRecord]
    wall_s: float
    target_forwards: int  # prefill included
    draft_forwards: int
    stop_reason: str  # "eos", "max_new_tokens" or "context"

    @property
    def new_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    def summary(self) -> dict:
        """Counts and rates as plain JSON-ready values."""
        rounds = self.rounds
        drafted = sum(r.drafted for r in rounds)
        accepted = sum(r.n_accepted for r in rounds)
        return {
            "new_tokens": self.new_tokens,
            "rounds": len(rounds),
            "accepted_per_round": [r.n_accepted for r in rounds],
            "drafted_per_round": [r.drafted for r in rounds],
            "tau": self.new_tokens / len(rounds) if rounds else 0.0,
            "acceptance_rate": accepted / drafted if drafted else None,
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "draft_time_s": sum(r.draft_time_s for r in rounds),
            "verify_time_s": sum(r.verify_time_s for r in rounds),
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s,
            "stop_reason": self.stop_reason,
        }


def generate(decoder: SpeculativeDecoder, prompt_ids: Sequence[int], controller: Controller,
             seed: int | None = None) -> GenerationResult:
    """Run ``decoder.rounds`` to the end and collect the result, timed end to end."""
    target_before = decoder.target.forwards
    drafter = decoder.drafter
    draft_before = drafter.forwards if drafter is not None else 0
    synchronize(decoder.device)
    start = time.perf_counter()
    rounds = list(decoder.rounds(prompt_ids, controller, seed))
    synchronize(decoder.device)
    wall = time.perf_counter() - start
    output = [t for r in rounds for t in r.new_tokens]
    if output and output[-1] in decoder.eos_ids:
        reason = "eos"
    elif len(output) >= decoder.config.max_new_tokens:
        reason = "max_new_tokens"
    else:
        reason = "context"
    return GenerationResult(
        prompt_ids=list(prompt_ids), output_ids=output, rounds=rounds, wall_s=wall,
        target_forwards=decoder.target.forwards - target_before,
        draft_forwards=(drafter.forwards - draft_before) if drafter is not None else 0,
        stop_reason=reason)


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (CUDA); a no-op on CPU. For timing around whole calls."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
