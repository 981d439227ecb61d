"""Drafters: where draft tokens come from, behind one protocol (``base.Drafter``): a draft
model, a feature-level draft reading the target's hidden states, REST retrieval."""

from __future__ import annotations

from typing import TYPE_CHECKING

from draftctl.drafters.base import Draft, Drafter

if TYPE_CHECKING:
    from draftctl.decode.verify import SamplingConfig
    from draftctl.models import LoadedModel

__all__ = ["Draft", "Drafter", "model_drafter"]


def model_drafter(draft: LoadedModel, vocab_size: int, sampling: SamplingConfig) -> Drafter:
    """The drafter for a loaded draft model: a feature-level draft reads the target's states,
    any other causal LM drafts on its own."""
    from draftctl.decode.cached_lm import CachedLM
    from draftctl.distill.feature import FeatureDraftLM

    if isinstance(draft.model, FeatureDraftLM):
        from draftctl.drafters.feature import FeatureDrafter

        return FeatureDrafter(draft.model, vocab_size, sampling)
    from draftctl.distill.model import DraftLM
    from draftctl.drafters.model import ModelDrafter

    if isinstance(draft.model, DraftLM):  # draft over its head only (q is 0 elsewhere)
        return ModelDrafter(CachedLM(draft.model, vocab_size, model_kwargs={"head_only": True}),
                            sampling, head_ids=draft.model.head_ids)
    return ModelDrafter(CachedLM(draft.model, vocab_size), sampling)
