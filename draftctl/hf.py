"""draftctl's controllers inside transformers' ``generate()``.

Most speculative decoding in Python runs as ``model.generate(..., assistant_model=draft)``,
where transformers offers its own draft-length schedules only. ``generate`` here runs that same
call with a candidate generator that asks any draftctl controller (every spec, ``onnx:PATH``
included) after each drafted token whether to go on, and tells it each round's accepted count.
Verification, greedy and sampled, stays transformers' own.

    from draftctl import hf
    out = hf.generate(model, input_ids, assistant_model=draft, controller="svip:0.3",
                      max_new_tokens=128)

The controller sees the feature record draftctl's own decoder builds (``FeatureRecord``): the
assistant's temperature-1 distribution at each drafted token (read from its output layer, so
sampling settings do not change the features), its position, and the sequence's acceptance
history. A draftctl feature-level draft drafts from the target's hidden states, which
transformers hands to ``FeatureCandidateGenerator``.

On a CPU, ``packed_view(model)`` (``draftctl.decode.kernels``) gives a model whose passes of
several tokens, the ones that verify a draft, run through oneDNN with packed weights: on an
AVX2 CPU in float32 they cost 0.53-0.70x what they cost through the stock kernels, so drafting
pays more (``generate()`` runs on the view as on the model).
"""

from __future__ import annotations

import json
import os
import time
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from transformers import GenerationMixin, PreTrainedModel
from transformers.generation.candidate_generator import (
    AssistedCandidateGenerator,
    CandidateGenerator,
)
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.modeling_outputs import CausalLMOutputWithPast

from draftctl.controllers import make_controller
from draftctl.controllers.base import Action, Controller
from draftctl.decode.features import (
    STATS,
    FeatureRecord,
    SequenceState,
    draft_stats,
    entropy,
    token_classes,
)
from draftctl.decode.kernels import packed_view  # noqa: F401  (re-exported: hf.packed_view)
from draftctl.decode.loop import RoundRecord
from draftctl.decode.verify import SamplingConfig, overlap
from draftctl.distill.feature import FeatureDraftLM
from draftctl.distill.model import DraftLM
from draftctl.drafters.base import ask_controller
from draftctl.drafters.context import LookupConfig
from draftctl.errors import DraftctlError

SUPPORTED_TRANSFORMERS = ">=5.24,<6"  # as pinned in pyproject.toml
# a folder holding custom_generate/generate.py, for generate(custom_generate=...)
CUSTOM_GENERATE = str(Path(__file__).resolve().parent / "data" / "hf")
MAX_DRAFT = 16  # draft tokens per round at most, whatever the controller allows


class HFEngineError(DraftctlError):
    """An installed transformers, a pair of models or a controller ``draftctl.hf`` cannot run."""


def check_transformers(version: str | None = None) -> None:
    """Refuse a transformers version outside the tested range, naming both."""
    found = version or transformers.__version__
    if Version(found) not in SpecifierSet(SUPPORTED_TRANSFORMERS):
        raise HFEngineError(f"draftctl.hf supports transformers {SUPPORTED_TRANSFORMERS}, found "
                            f"{found}: install a supported version")


def _vocabulary(model: torch.nn.Module) -> int:
    """Tokens the model's logits span: its output layer's rows, else its config's vocabulary
    (a draftctl draft has no full output layer; its logits span the vocabulary)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head.weight.shape[0] if head is not None else model.config.vocab_size


class DraftAssistant(PreTrainedModel, GenerationMixin):
    """A draftctl-distilled draft (``DraftLM``: the target's first layers with a reduced head,
    full-vocabulary logits) as a transformers model that ``generate`` can drive."""

    _supports_cache_class = True
    _supports_sdpa = True  # attention is the wrapped draft's own (sdpa, as loaded)

    def __init__(self, draft: DraftLM):
        super().__init__(draft.config)
        self.draft = draft
        self.post_init()

    def _init_weights(self, module) -> None:
        """The draft's weights are trained: nothing to initialise."""

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache=None,
                use_cache: bool | None = None, logits_to_keep: int = 0,
                **kwargs) -> CausalLMOutputWithPast:
        out = self.draft(input_ids=input_ids, cache=cache, use_cache=bool(use_cache),
                         logits_to_keep=logits_to_keep, attention_mask=attention_mask,
                         position_ids=position_ids)
        return CausalLMOutputWithPast(logits=out.logits, cache=cache)


def as_assistant(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` as transformers' assisted generation takes it: a transformers causal LM as it
    is, a draftctl draft wrapped in ``DraftAssistant``, a feature-level draft as it is (it
    drafts through ``FeatureCandidateGenerator``)."""
    if isinstance(model, DraftLM):
        return DraftAssistant(model).eval()
    if isinstance(model, FeatureDraftLM):
        return model
    if not isinstance(model, GenerationMixin):
        raise HFEngineError(f"the assistant ({type(model).__name__}) is neither a transformers "
                            "causal LM nor a draftctl draft")
    return model


class FeatureCandidateGenerator(CandidateGenerator):
    """A draftctl feature-level draft inside ``generate()``, drafting with ``FeatureDrafter``
    and asking the controller after each token. It reads the target's hidden states, which
    transformers hands to a candidate generator that asks for the target's outputs
    (``requires_model_outputs``, as its own MTP and DFlash drafts do): the first round drafts
    nothing, so that the target's prefill gives the prompt's states; after each round the
    states of the tokens the target accepted go to the drafter. Candidate logits are
    ``log q`` of the distribution the tokens were drawn from (transformers' speculative
    sampling reads q from them). With ``lookup`` the draft's q is mixed with context lookup
    (``model+lookup``, ``draftctl.drafters.lookup``), as in draftctl's own decoder."""

    requires_model_outputs = True

    def __init__(self, draft, controller: Controller, vocab_size: int, max_draft: int,
                 max_length: int, sampling, token_classes: torch.Tensor | None,
                 lookup: LookupConfig | None = None, logits: bool = True):
        from draftctl.drafters.feature import FeatureDrafter

        self.drafter = FeatureDrafter(draft, vocab_size, sampling, token_classes, lookup)
        self.model_kwargs_overrides = {"output_hidden_states": list(draft.feature_layers)}
        self.controller, self.vocab_size, self.max_draft = controller, vocab_size, max_draft
        self.max_length, self.logits = max_length, logits
        # seeded from torch's global generator: a torch.manual_seed before generate() repeats
        self.generator = torch.Generator(self.drafter.device).manual_seed(
            int(torch.randint(2 ** 62, ())))
        self.records: list[FeatureRecord] = []
        self.raw_probs: list[torch.Tensor] = []
        self.controller_s = 0.0  # the round's seconds inside the controller
        self.state: SequenceState | None = None
        self.prefilled = False
        controller.reset()

    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens a round drafts (transformers >= 5.25 sizes the cache's recording of
        recurrent states by it)."""
        return self.max_draft

    def get_candidates(self, input_ids: torch.LongTensor, model_kwargs=None, model_outputs=None,
                       is_first_iteration: bool = False, n_last_matches: int = 0, **kwargs):
        from draftctl.decode.features import records_from_stats

        self.records, self.raw_probs, self.controller_s = [], [], 0.0
        if is_first_iteration:
            return input_ids, None
        seen = input_ids.shape[1] - 1  # the target has seen all but the newest token
        new = n_last_matches + 1 if self.prefilled else seen
        self.prefilled = True
        hidden = torch.stack([model_outputs.hidden_states[i][0, :new] for i in
                              self.drafter.hidden_layers], dim=1)
        self.drafter.accepted(seen, hidden.to(self.drafter.device))
        budget = min(self.controller.max_draft(), self.max_draft,
                     self.max_length - input_ids.shape[1] - 1)
        draft = self.drafter.propose(input_ids[0].to(self.drafter.device), budget,
                                     self.controller, self.state, self.generator)
        self.controller_s = draft.controller_s
        if not len(draft.tokens):
            return input_ids, None
        self.records = draft.records if draft.records is not None else records_from_stats(
            draft.stats.tolist(), self.state)
        self.raw_probs = list(draft.raw_probs)
        candidates = torch.cat([input_ids, draft.tokens[None].to(input_ids.device)], dim=1)
        if not self.logits:
            return candidates, None
        q = draft.q_draft if draft.q_draft is not None else draft.raw_probs
        return candidates, torch.log(q)[None].to(input_ids.device)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor,
                                  num_matches: int) -> None:
        accepted = int(num_matches)
        target_entropy = float(entropy(scores[0, accepted, :self.vocab_size]))
        if self.state is None:  # the prefill's round: its entropy is the first round's
            self.state = SequenceState(input_ids.shape[1], target_entropy=target_entropy)
            return
        self.controller.observe(self.records, accepted)
        self.state = self.state.after_round(input_ids.shape[1], len(self.records), accepted,
                                            target_entropy)


class _LastLogits:
    """Keeps the assistant's last output row: its raw logits at the drafted token."""

    def __init__(self, model: torch.nn.Module):
        self.logits: torch.Tensor | None = None
        self.handle = model.register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        self.logits = output.logits[0, -1]

    def remove(self) -> None:
        self.handle.remove()


class _AskController(StoppingCriteria):
    """Asks the controller after each token the assistant drafts; ends the draft when it says
    stop or discard."""

    def __init__(self, generator: ControlledCandidateGenerator, logits: _LastLogits,
                 start: int):
        self.generator, self.logits, self.start = generator, logits, start
        self.discard = False

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        gen = self.generator
        depth = input_ids.shape[1] - self.start
        token = input_ids[0, -1:]
        if gen.features:
            probs = torch.softmax(self.logits.logits[:gen.vocab_size].float(), dim=-1)[None]
            stat = draft_stats(probs, token, token, gen.token_classes)
        else:  # a record that only counts: the controller reads no features, nobody traces
            probs, stat = None, torch.zeros((1, STATS))
        action, record, seconds = ask_controller(gen.controller, stat, depth,
                                                 gen.records[-1] if gen.records else None,
                                                 gen.state, token)
        gen.controller_s += seconds
        if not gen.controller.reads_features:
            action = Action.CONTINUE
        if action is Action.DISCARD:
            self.discard = True
        else:
            gen.records.append(record)
            if probs is not None:
                gen.raw_probs.append(probs[0])
        stop = action is not Action.CONTINUE
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


class ControlledCandidateGenerator(AssistedCandidateGenerator):
    """transformers' assistant-model candidate generator with a draftctl controller choosing
    each round's draft length token by token (instead of ``num_assistant_tokens`` schedules).
    ``features``: build every drafted token's feature record (traces want them); without it
    they are built only for a controller that reads features, saving a softmax over the
    vocabulary per drafted token and one per round."""

    def __init__(self, *args, controller: Controller, vocab_size: int, max_draft: int,
                 token_classes: torch.Tensor | None = None, features: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        # transformers' own rule (stop below a confidence threshold, 0.4 by default) would end
        # drafts the controller asked to go on with; 0 turns it off (None means "default")
        self.generation_config.assistant_confidence_threshold = 0
        self.controller = controller
        self.vocab_size = vocab_size
        self.max_draft = max_draft
        self.token_classes = token_classes
        self.records: list[FeatureRecord] = []
        self.raw_probs: list[torch.Tensor] = []  # (V,) temperature-1 draft softmax per token
        self.controller_s = 0.0  # the round's seconds inside the controller
        self.features = features or controller.reads_features
        self.state: SequenceState | None = None
        controller.reset()

    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens a round drafts: the controller's length, not a schedule's."""
        return self.max_draft

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs):
        if self.state is None:
            self.state = SequenceState(input_ids.shape[1])
        self.records, self.raw_probs, self.controller_s = [], [], 0.0
        self.num_assistant_tokens = min(self.controller.max_draft(), self.max_draft)
        return super().get_candidates(input_ids, **kwargs)

    def _generate_candidates(self, generation_args: dict):
        logits = _LastLogits(self.assistant_model)
        ask = _AskController(self, logits, generation_args[self.input_ids_key].shape[1])
        try:
            ids, scores = super()._generate_candidates(
                {**generation_args, "stopping_criteria": StoppingCriteriaList([ask])})
        finally:
            logits.remove()
        if ask.discard:
            ids, scores = ids[:, :-1], scores[:, :-1]
        return ids, scores

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor,
                                  num_matches: int) -> None:
        accepted = int(num_matches)
        self.controller.observe(self.records, accepted)
        self.state = self.state.after_round(
            input_ids.shape[1], len(self.records), accepted,
            float(entropy(scores[0, accepted, :self.vocab_size])) if self.features else 0.0)


class RoundRecorder:
    """Wraps a transformers candidate generator (its own schedules, or the controlled one) and
    records every round as draftctl's ``RoundRecord``: the drafted tokens, the accepted count,
    the target's argmax and accept probabilities (``min(1, p/q)`` when sampling, 1/0 in
    greedy mode), the new tokens, and draft and verification seconds; with ``beta``, also
    each token's ``sum_v min(p, q)`` (a pass over the vocabulary per token inside the timed
    call: traces want it, a timed comparison leaves it out). Everything else is the wrapped
    generator's (transformers keeps its checks on the real class)."""

    def __init__(self, inner, vocab_size: int, greedy: bool, beta: bool = True):
        self.inner, self.vocab_size, self.greedy, self.beta = inner, vocab_size, greedy, beta
        self.rounds: list[RoundRecord] = []
        self._pending: tuple | None = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs):
        start = time.perf_counter()
        ids, logits = self.inner.get_candidates(input_ids, **kwargs)
        length = input_ids.shape[1]
        self._pending = (length, ids[0, length:].to(input_ids.device), logits,
                         time.perf_counter() - start, time.perf_counter())
        return ids, logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor,
                                  num_matches: int) -> None:
        verify_s = time.perf_counter() - self._pending[4]
        length, drafted, q_logits, draft_s, _ = self._pending
        k = len(drafted)
        target = scores[0, :k, :self.vocab_size].float()  # (k, V): the target's, processed
        argmax = target.argmax(-1)
        # a controlled generator keeps each token's record and draft softmax; transformers'
        # own schedules keep neither
        records = getattr(self.inner, "records", [])
        if self.greedy or k == 0:
            accept = (drafted == argmax).float()
            raw = getattr(self.inner, "raw_probs", [])
            beta = overlap(torch.softmax(target, -1), torch.stack(raw)).tolist() \
                if self.beta and raw and k else []
        else:
            p = torch.softmax(target, -1)
            rows = torch.arange(k, device=p.device)
            if q_logits is None:  # prompt lookup: q is a point mass, min(1, p/q) = p(token)
                accept = p[rows, drafted]
                beta = accept.tolist() if self.beta else []
            else:
                q = torch.softmax(q_logits[0, :, :self.vocab_size].float().to(p.device), -1)
                accept = (p[rows, drafted] / q[rows, drafted]).clamp(max=1.0)
                beta = overlap(p, q).tolist() if self.beta else []
        self.rounds.append(RoundRecord(
            index=len(self.rounds), draft_tokens=drafted.tolist(), features=list(records),
            n_accepted=int(num_matches), accept_prob=accept.tolist(), beta=beta,
            target_argmax=argmax.tolist(), new_tokens=input_ids[0, length:].tolist(),
            discarded=0, draft_forwards=k, draft_time_s=draft_s, verify_time_s=verify_s,
            controller_time_s=getattr(self.inner, "controller_s", 0.0),
            controller_calls=len(records)))
        self.inner.update_candidate_strategy(input_ids, scores, num_matches)


OWN = "hf:"  # spec prefix of transformers' own schedules
LOOKUP_KEY = "prompt_lookup_num_tokens"  # generate()'s switch to its prompt lookup decoding


def own_schedule(spec: str) -> dict:
    """The assistant generation settings of one of transformers' own schedules:

    - ``hf:constant:K``: K draft tokens every round;
    - ``hf:heuristic[:K0]``: transformers' heuristic (+2 after a full accept, else -1), from K0
      (default 20, transformers' start);
    - ``hf:confidence[:T]``: transformers' default: up to 20 tokens, stopping below draft
      confidence T (default 0.4), T refitted online by its ROC rule;
    - ``hf:lookup[:N]``: transformers' prompt lookup decoding, up to N tokens a round (default
      10), no assistant model (its settings are ``generate()`` arguments, ``LOOKUP_KEY``).

    Schedules other than ``confidence`` run with the confidence rule off."""
    name, _, value = spec.removeprefix(OWN).partition(":")
    try:
        if name == "constant" and value:
            return {"num_assistant_tokens_schedule": "constant",
                    "num_assistant_tokens": int(value), "assistant_confidence_threshold": 0.0}
        if name == "heuristic":
            return {"num_assistant_tokens_schedule": "heuristic",
                    "num_assistant_tokens": int(value or 20),
                    "assistant_confidence_threshold": 0.0}
        if name == "confidence":
            return {"num_assistant_tokens_schedule": "constant", "num_assistant_tokens": 20,
                    "assistant_confidence_threshold": float(value or 0.4)}
        if name == "lookup" and int(value or 10) >= 1:
            return {LOOKUP_KEY: int(value or 10)}
    except ValueError:
        pass
    raise HFEngineError(f"unknown transformers schedule {spec!r}: use hf:constant:K, "
                        "hf:heuristic[:K0], hf:confidence[:T] or hf:lookup[:N]")


def own_schedule_is_lookup(spec: str) -> bool:
    """Whether ``spec`` is transformers' prompt lookup (``hf:lookup[:N]``), which drafts
    without an assistant model."""
    return spec.startswith(OWN) and LOOKUP_KEY in own_schedule(spec)


@dataclass
class HFRun:
    """One ``generate()`` call: what it returned, its rounds, and its wall time."""

    output: object
    rounds: list[RoundRecord] = field(default_factory=list)
    wall_s: float = 0.0


def run(model, input_ids: torch.Tensor, assistant_model,
        controller: str | Controller | None = "svip", max_draft: int = MAX_DRAFT,
        lookup: str | None = None, beta: bool = True, features: bool = True,
        **generate_kwargs) -> HFRun:
    """``model.generate(input_ids, assistant_model=..., **generate_kwargs)``, recording every
    round (``beta``: with each token's ``sum_v min(p, q)``, see ``RoundRecorder``).
    ``controller``: a draftctl spec or ``Controller`` deciding each round's draft
    length; one of transformers' own schedules (``hf:...``, see ``own_schedule``; with
    ``hf:lookup`` the assistant is not used); or None: transformers' schedule as the
    assistant's generation config sets it. ``lookup``: ``model+lookup[,key=value...]`` mixes
    a feature draft's distribution with context lookup (``draftctl.drafters.lookup``).
    ``features``: give every round's records their draft features (traces need them);
    without it an assistant model's rounds carry them only for a controller that reads
    features (see ``ControlledCandidateGenerator``). A
    ``tokenizer`` in ``generate_kwargs`` (generate() takes one) gives the records their token
    classes."""
    check_transformers()
    schedule = {}
    if isinstance(controller, str) and controller.startswith(OWN):
        schedule, controller = own_schedule(controller), None
    elif isinstance(controller, str):
        controller = make_controller(controller)
    if controller is not None and controller.reads_tokens:
        raise HFEngineError(f"controller {controller.spec!r} needs the reference output, which "
                            "generate() does not have: run it in draftctl bench")
    if LOOKUP_KEY in schedule:  # transformers' prompt lookup: no assistant model
        if lookup is not None:
            raise HFEngineError("hf:lookup is transformers' own prompt lookup; lookup= mixes "
                                "context lookup into a feature draft's drafts")
        return _run_prompt_lookup(model, input_ids, schedule, beta, **generate_kwargs)
    lookup_config = _lookup_config(lookup, assistant_model)
    assistant_model = as_assistant(assistant_model)
    target_vocab, draft_vocab = _vocabulary(model), _vocabulary(assistant_model)
    if target_vocab != draft_vocab:
        raise HFEngineError(f"the assistant's vocabulary has {draft_vocab} tokens and the "
                            f"target's {target_vocab}: draftctl.hf needs a draft that shares "
                            "the target's tokenizer")
    if max_draft < 1:
        raise HFEngineError(f"max_draft must be >= 1, got {max_draft}")
    do_sample = generate_kwargs.get("do_sample", model.generation_config.do_sample)
    tokenizer = generate_kwargs.get("tokenizer")  # generate() takes it; it names token classes
    classes = token_classes(tokenizer) if tokenizer is not None else None
    own = type(model)._get_candidate_generator
    recorders: list[RoundRecorder] = []

    feature = isinstance(assistant_model, FeatureDraftLM)
    if feature and controller is None:
        raise HFEngineError("transformers' own schedules drive an assistant model; a feature "
                            "draft drafts with a draftctl controller (e.g. svip, static:K)")
    sampling = SamplingConfig(
        float(generate_kwargs.get("temperature") or 1.0) if do_sample else 0.0,
        int(generate_kwargs.get("top_k") or 0), float(generate_kwargs.get("top_p") or 1.0))

    def candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor,
                            model_kwargs, assistant_model=None, **kwargs):
        if feature:  # greedy verification reads no candidate logits, unless it ensembles
            logits = generation_config.do_sample or getattr(
                generation_config, "assistant_ensemble_weight", None) is not None
            inner = FeatureCandidateGenerator(assistant_model, controller, target_vocab,
                                              max_draft, generation_config.max_length,
                                              sampling, classes, lookup_config, logits)
        elif controller is None:
            inner = own(self, generation_config, input_ids, inputs_tensor, logits_processor,
                        model_kwargs, assistant_model=assistant_model, **kwargs)
        else:
            inner = ControlledCandidateGenerator(
                input_ids, assistant_model, generation_config, model_kwargs, inputs_tensor,
                logits_processor, controller=controller, vocab_size=target_vocab,
                max_draft=max_draft, token_classes=classes, features=features)
        recorders.append(RoundRecorder(inner, target_vocab, greedy=not do_sample, beta=beta))
        return recorders[-1]

    config = getattr(assistant_model, "generation_config", None)
    before = {name: getattr(config, name) for name in schedule}
    if schedule:
        config.update(**schedule)
    try:
        return _recorded_generate(model, candidate_generator, recorders, input_ids,
                                  assistant_model=assistant_model, **generate_kwargs)
    finally:
        if schedule:
            config.update(**before)


def _recorded_generate(model, candidate_generator, recorders: list[RoundRecorder],
                       input_ids: torch.Tensor, **generate_kwargs) -> HFRun:
    """``model.generate`` with ``candidate_generator`` (which appends its ``RoundRecorder``
    to ``recorders``) in place of the model's own, timed."""
    model._get_candidate_generator = types.MethodType(candidate_generator, model)
    try:
        start = time.perf_counter()
        output = model.generate(input_ids, **generate_kwargs)
        if output_device(output).type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    finally:
        del model._get_candidate_generator
    return HFRun(output, recorders[-1].rounds if recorders else [], wall)


def _lookup_config(lookup: str | None, assistant_model) -> LookupConfig | None:
    """The context lookup a ``lookup=`` spec asks for, or a clear error: inside generate()
    it mixes into a feature draft's drafts (``model+lookup``)."""
    from draftctl.drafters.lookup import MODEL_LOOKUP, lookup_kind, parse_lookup

    if lookup is None:
        return None
    if lookup_kind(lookup) != MODEL_LOOKUP:
        raise HFEngineError(f"lookup={lookup!r}: inside generate() use model+lookup[,key=value"
                            "...] with a feature draft, or hf:lookup:N for transformers' own "
                            "prompt lookup")
    if not isinstance(assistant_model, FeatureDraftLM):
        raise HFEngineError(f"lookup={lookup!r} mixes context lookup into a feature draft's "
                            f"drafts; the assistant is a {type(assistant_model).__name__}")
    return parse_lookup(lookup)


def _run_prompt_lookup(model, input_ids: torch.Tensor, schedule: dict, beta: bool,
                       **generate_kwargs) -> HFRun:
    """transformers' prompt lookup decoding (``hf:lookup:N``), its rounds recorded."""
    do_sample = generate_kwargs.get("do_sample", model.generation_config.do_sample)
    own = type(model)._get_candidate_generator
    recorders: list[RoundRecorder] = []

    def candidate_generator(self, *args, **kwargs):
        recorders.append(RoundRecorder(own(self, *args, **kwargs), _vocabulary(model),
                                       greedy=not do_sample, beta=beta))
        return recorders[-1]

    return _recorded_generate(model, candidate_generator, recorders, input_ids, **schedule,
                              **generate_kwargs)


def output_device(output) -> torch.device:
    ids = output if isinstance(output, torch.Tensor) else output.sequences
    return ids.device


def generate(model, input_ids: torch.Tensor, assistant_model, controller: str | Controller = "svip",
             max_draft: int = MAX_DRAFT, trace_to: str | Path | None = None,
             trace_id: int | None = None, trace_category: str = "generate",
             lookup: str | None = None, **generate_kwargs):
    """``model.generate(input_ids, assistant_model=..., **generate_kwargs)`` with ``controller``
    (a spec string or a ``Controller``) deciding each round's draft length. Returns what
    ``model.generate`` returns. Batch size 1, as transformers' assisted generation requires.

    trace_to: a folder that gets this call's rounds as one Parquet shard of the rows
    ``draftctl collect --mode policy`` writes (``trace_id``: its prompt id, default the next
    free one; ``trace_category``: its category), and ``run.json``, so that ``replay`` and
    ``train`` read it unchanged. Calls that add to one folder must share the controller, the
    decoding settings and the models. lookup: ``model+lookup[,key=value...]`` mixes a feature
    draft's distribution with context lookup (see ``run``)."""
    result = run(model, input_ids, assistant_model, controller, max_draft, lookup,
                 beta=trace_to is not None, features=trace_to is not None, **generate_kwargs)
    if trace_to is not None:
        spec = controller if isinstance(controller, str) else controller.spec or repr(controller)
        write_traces(Path(trace_to), result.rounds, model, as_assistant(assistant_model), spec,
                     max_draft, generate_kwargs, trace_id, trace_category, lookup)
    return result.output


def custom_generate(model, inputs: torch.Tensor | None = None, assistant_model=None,
                    controller: str | Controller = "svip", max_draft: int = MAX_DRAFT,
                    trace_to: str | Path | None = None, **kwargs):
    """``generate`` as transformers' ``custom_generate`` calls it (``model.generate(...,
    custom_generate=CUSTOM_GENERATE, trust_remote_code=True, assistant_model=..., controller=
    ...)``): the arguments generate() was given, those left unset as None."""
    if assistant_model is None:
        raise HFEngineError("draftctl's custom_generate drafts with an assistant: pass "
                            "assistant_model=...")
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if input_ids is None:
        raise HFEngineError("draftctl's custom_generate needs input_ids")
    return generate(model, input_ids, assistant_model, controller, max_draft, trace_to=trace_to,
                    **kwargs)


def _decoding(model, kwargs: dict) -> dict:
    """The decoding settings of a generate() call, as ``collect`` records them."""
    config = model.generation_config
    sample = kwargs.get("do_sample", config.do_sample)

    def setting(name, default):
        value = kwargs.get(name, getattr(config, name, None))
        return default if value is None else value

    return {"temperature": float(setting("temperature", 1.0)) if sample else 0.0,
            "top_k": int(setting("top_k", 0)) if sample else 0,
            "top_p": float(setting("top_p", 1.0)) if sample else 1.0,
            "max_new_tokens": kwargs.get("max_new_tokens", config.max_new_tokens),
            "seed": None}


def write_traces(folder: Path, rounds: list[RoundRecord], model, assistant, spec: str,
                 max_draft: int, generate_kwargs: dict, trace_id: int | None,
                 category: str, lookup: str | None = None) -> Path:
    """One shard of ``rounds`` in ``folder/shards`` and the folder's ``run.json`` (checked
    against an existing one); the cost curve replay models time with is measured from every
    round the folder holds. Returns the shard's path."""
    from draftctl.collect.run import open_run_info
    from draftctl.collect.traces import read_traces, round_rows, write_shard

    shards = folder / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    taken = {int(p.stem[1:]) for p in shards.glob("q*.parquet")}
    prompt_id = trace_id if trace_id is not None else max(taken, default=-1) + 1
    if prompt_id in taken:
        raise HFEngineError(f"{shards} already holds trace {prompt_id}: pass another trace_id")
    info = open_run_info(folder, _run_info(model, assistant, spec, max_draft, generate_kwargs,
                                           lookup))
    run_id = f"{spec}-hf"[:48]
    rows = [row for record in rounds for row in round_rows(record, run_id, prompt_id, category)]
    path = shards / f"q{prompt_id}.parquet"
    write_shard(rows, path, "rounds")
    info["cost"] = measured_cost(read_traces(folder))
    tmp = folder / "run.json.tmp"
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, folder / "run.json")
    return path


def _name(model) -> str:
    return getattr(model.config, "_name_or_path", "") or type(model).__name__


def _run_info(model, assistant, spec: str, max_draft: int, generate_kwargs: dict,
              lookup: str | None = None) -> dict:
    from importlib.metadata import version

    from draftctl import __version__
    from draftctl.decode.features import FEATURE_NAMES, SCHEMA_VERSION
    from draftctl.drafters.lookup import parse_lookup

    return {"mode": "rounds", "drafter": "model+lookup" if lookup else "model",
            "lookup": asdict(parse_lookup(lookup)) if lookup else None,
            "policy": spec, "engine": "transformers",
            "target": _name(model), "target_sha256": None, "draft": _name(assistant),
            "draft_sha256": None, "decoding": _decoding(model, generate_kwargs),
            "k_probe": max_draft, "prompts": "draftctl.hf.generate", "split": None,
            "world_size": 1, "feature_schema_version": SCHEMA_VERSION,
            "feature_names": list(FEATURE_NAMES),
            "packages": {name: version(name) for name in ("torch", "transformers", "pyarrow")}
            | {"draftctl": __version__},
            "cost": None}


def measured_cost(table) -> dict:
    """The costs replay models time with (``draftctl.profile.profile_costs``' keys), from
    the rounds of a trace table: a pass verifying n tokens takes the median measured
    verification of rounds that drafted n - 1 (sizes never run are interpolated), a draft step
    the median draft time per drafted token. transformers' passes are unpadded: shape ``free``.
    """
    import numpy as np

    columns = table.select(["prompt_id", "round", "round_drafted", "draft_time_s",
                            "verify_time_s"]).to_pylist()
    rounds = {(r["prompt_id"], r["round"]): r for r in columns}.values()
    by_size: dict[int, list[float]] = {}
    per_token = []
    for r in rounds:
        by_size.setdefault(r["round_drafted"] + 1, []).append(r["verify_time_s"])
        if r["round_drafted"]:
            per_token.append(r["draft_time_s"] / r["round_drafted"])
    if not by_size:
        raise HFEngineError("no rounds to measure a cost curve from")
    sizes = sorted(by_size)
    medians = [float(np.median(by_size[n])) for n in sizes]
    top = max(sizes[-1], 2)
    curve = np.interp(np.arange(1, top + 1), sizes, medians).tolist()
    return {"t_verify_s": curve, "t_target_s": curve[0], "pass_shape": "free",
            "pad_to": list(range(1, top + 1)), "t_fastest_plain_s": curve[0],
            "t_draft_s": float(np.median(per_token)) if per_token else 0.0,
            "target_dtype": None, "draft_dtype": None, "profile": None,
            "measured": "from the recorded rounds (transformers' generate)"}
