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
history.
"""

from __future__ import annotations

import types

import torch
import transformers
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from transformers import GenerationMixin, PreTrainedModel
from transformers.generation.candidate_generator import AssistedCandidateGenerator
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.modeling_outputs import CausalLMOutputWithPast

from draftctl.controllers import make_controller
from draftctl.controllers.base import Action, Controller
from draftctl.decode.features import FeatureRecord, SequenceState, distribution_stats
from draftctl.distill.model import DraftLM
from draftctl.drafters.base import ask_controller
from draftctl.errors import DraftctlError

SUPPORTED_TRANSFORMERS = ">=5.24,<6"  # as pinned in pyproject.toml
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
    (a wrapped draftctl draft has no full output layer; its logits span the vocabulary)."""
    head = model.get_output_embeddings()
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
    is, a draftctl draft wrapped in ``DraftAssistant``; a feature-level draft is refused (it
    reads the target's hidden states, which generate() does not hand over)."""
    from draftctl.distill.feature import FeatureDraftLM

    if isinstance(model, DraftLM):
        return DraftAssistant(model).eval()
    if isinstance(model, FeatureDraftLM):
        raise HFEngineError("a feature-level draft reads the target's hidden states, which "
                            "transformers' generate() does not hand to its assistant: use "
                            "draftctl decode, or a draft model (distill --kind model)")
    if not isinstance(model, GenerationMixin):
        raise HFEngineError(f"the assistant ({type(model).__name__}) is neither a transformers "
                            "causal LM nor a draftctl draft")
    return model


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
        self.cum_top1 = 1.0
        self.discard = False

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        gen = self.generator
        depth = input_ids.shape[1] - self.start
        probs = torch.softmax(self.logits.logits[:gen.vocab_size].float(), dim=-1)
        stat = distribution_stats(probs[None])
        action, record, _ = ask_controller(gen.controller, stat, depth, self.cum_top1,
                                           gen.state, input_ids[0, -1])
        if not gen.controller.reads_features:
            action = Action.CONTINUE
        if action is Action.DISCARD:
            self.discard = True
        else:
            gen.records.append(record)
            self.cum_top1 = record.cum_top1
        stop = action is not Action.CONTINUE
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


class ControlledCandidateGenerator(AssistedCandidateGenerator):
    """transformers' assistant-model candidate generator with a draftctl controller choosing
    each round's draft length token by token (instead of ``num_assistant_tokens`` schedules)."""

    def __init__(self, *args, controller: Controller, vocab_size: int, max_draft: int,
                 **kwargs):
        super().__init__(*args, **kwargs)
        # transformers' own rule (stop below a confidence threshold, 0.4 by default) would end
        # drafts the controller asked to go on with; 0 turns it off (None means "default")
        self.generation_config.assistant_confidence_threshold = 0
        self.controller = controller
        self.vocab_size = vocab_size
        self.max_draft = max_draft
        self.records: list[FeatureRecord] = []
        self.state: SequenceState | None = None
        controller.reset()

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs):
        if self.state is None:
            self.state = SequenceState(input_ids.shape[1])
        self.records = []
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
        self.state = self.state.after_round(input_ids.shape[1], len(self.records), accepted)


def generate(model, input_ids: torch.Tensor, assistant_model, controller: str | Controller = "svip",
             max_draft: int = MAX_DRAFT, **generate_kwargs):
    """``model.generate(input_ids, assistant_model=..., **generate_kwargs)`` with ``controller``
    (a spec string or a ``Controller``) deciding each round's draft length. Returns what
    ``model.generate`` returns. Batch size 1, as transformers' assisted generation requires."""
    check_transformers()
    if isinstance(controller, str):
        controller = make_controller(controller)
    if controller.reads_tokens:
        raise HFEngineError(f"controller {controller.spec!r} needs the reference output, which "
                            "generate() does not have: run it in draftctl bench")
    assistant_model = as_assistant(assistant_model)
    target_vocab, draft_vocab = _vocabulary(model), _vocabulary(assistant_model)
    if target_vocab != draft_vocab:
        raise HFEngineError(f"the assistant's vocabulary has {draft_vocab} tokens and the "
                            f"target's {target_vocab}: draftctl.hf needs a draft that shares "
                            "the target's tokenizer")
    if max_draft < 1:
        raise HFEngineError(f"max_draft must be >= 1, got {max_draft}")

    def candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor,
                            model_kwargs, assistant_model=None, **_):
        return ControlledCandidateGenerator(
            input_ids, assistant_model, generation_config, model_kwargs, inputs_tensor,
            logits_processor, controller=controller, vocab_size=target_vocab,
            max_draft=max_draft)

    model._get_candidate_generator = types.MethodType(candidate_generator, model)
    try:
        return model.generate(input_ids, assistant_model=assistant_model, **generate_kwargs)
    finally:
        del model._get_candidate_generator
