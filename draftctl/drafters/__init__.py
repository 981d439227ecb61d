"""Drafters: where draft tokens come from, behind one protocol (``base.Drafter``): a draft
model, a feature-level draft reading the target's hidden states, REST retrieval, context
lookup, and a draft model mixed with context lookup.

A drafter spec names one for the jobs: ``model`` (the draft model, ``--draft``; the default),
``model+lookup[,key=value...]``, ``lookup[,key=value...]`` (``drafters.lookup``) and
``rest:DIR[,key=value...]`` (``draftctl.retrieval``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import draftctl.decode  # noqa: F401  (first: the decoder imports the drafters' base)
from draftctl.decode.cached_lm import PassShape
from draftctl.drafters.base import Draft, Drafter
from draftctl.drafters.context import LookupConfig
from draftctl.errors import DraftctlError

if TYPE_CHECKING:
    from draftctl.decode.verify import SamplingConfig
    from draftctl.models import LoadedModel

__all__ = ["MODEL", "Draft", "Drafter", "DrafterSpec", "model_drafter", "parse_drafter"]

MODEL = "model"  # the draft model (--draft)


def model_drafter(draft: LoadedModel, vocab_size: int, sampling: SamplingConfig,
                  lookup: LookupConfig | None = None) -> Drafter:
    """The drafter for a loaded draft model: a feature-level draft reads the target's states,
    any other causal LM drafts on its own; ``lookup`` mixes in context lookup. On a CPU the
    draft runs on its packed view (``kernels.packed_view``): a draft's numerics never change
    what verification accepts, and its steps cost less there."""
    from draftctl.decode import kernels
    from draftctl.decode.cached_lm import CachedLM
    from draftctl.distill.feature import FeatureDraftLM

    model = draft.model if kernels.packable(draft.model) else kernels.packed_view(draft.model)
    if isinstance(model, FeatureDraftLM):
        from draftctl.drafters.feature import FeatureDrafter

        return FeatureDrafter(model, vocab_size, sampling, lookup=lookup)
    from draftctl.distill.model import DraftLM
    from draftctl.drafters.model import ModelDrafter

    if isinstance(model, DraftLM):  # draft over its head only (q is 0 elsewhere)
        return ModelDrafter(CachedLM(model, vocab_size, model_kwargs={"head_only": True}),
                            sampling, head_ids=model.head_ids, lookup=lookup)
    return ModelDrafter(CachedLM(model, vocab_size), sampling, lookup=lookup)


@dataclass(frozen=True)
class DrafterSpec:
    """A parsed drafter spec. kind: ``model``, ``model+lookup``, ``lookup`` or ``rest``."""

    text: str
    kind: str
    lookup: LookupConfig | None = None

    @property
    def uses_model(self) -> bool:
        """Whether it drafts with the draft model (``--draft``)."""
        return self.kind in (MODEL, "model+lookup")

    @property
    def dense(self) -> bool:
        """Whether it drafts after every prefix for dense traces: a draft model's chain,
        mixed with lookup or not, unless lookup drafts rounds alone."""
        return self.uses_model and not (self.lookup and self.lookup.alone)

    @property
    def tree(self) -> bool:
        return self.kind == "rest"

    def pass_shape(self, shape: PassShape) -> PassShape:
        """The shape its verification passes run at in a decoder set to ``shape``: tries run
        unpadded (``free``), chains at ``shape``."""
        return PassShape() if self.tree else shape

    def source(self, target: LoadedModel, draft: LoadedModel | None) -> LoadedModel | Drafter | None:
        """What ``SpeculativeDecoder.from_loaded`` takes (with ``lookup=self.lookup``): the
        loaded draft model for the model kinds, else this spec's drafter."""
        if self.uses_model:
            return draft
        if self.kind == "lookup":
            from draftctl.drafters.lookup import LookupDrafter

            return LookupDrafter(len(target.tokenizer), self.lookup)
        from draftctl.drafters.retrieval import RetrievalDrafter
        from draftctl.retrieval import make_retriever

        return RetrievalDrafter(make_retriever(self.text, target.tokenizer))


def parse_drafter(spec: str | None) -> DrafterSpec:
    """The drafter a spec names (None: the draft model), or a clear error."""
    from draftctl.drafters.lookup import lookup_kind, parse_lookup
    from draftctl.retrieval import is_retrieval

    if spec is None or spec == MODEL:
        return DrafterSpec(MODEL, MODEL)
    if lookup_kind(spec):
        return DrafterSpec(spec, lookup_kind(spec), parse_lookup(spec))
    if is_retrieval(spec):
        return DrafterSpec(spec, "rest")
    raise DraftctlError(f"unknown drafter {spec!r}: use model, model+lookup, lookup or rest:DIR "
                        "(options after commas, e.g. lookup,max_ngram=4)")
