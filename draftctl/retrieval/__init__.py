"""Retrieval drafting (REST): a datastore of text, suffix-array lookup, trie candidates."""

from __future__ import annotations

from typing import TYPE_CHECKING

from draftctl.errors import DraftctlError

if TYPE_CHECKING:
    from draftctl.decode.loop import DecodeConfig
    from draftctl.decode.tree import RetrievalDecoder
    from draftctl.models import LoadedModel

PREFIX = "rest:"


def is_retrieval(drafter: str | None) -> bool:
    return drafter is not None and drafter.startswith(PREFIX)


def retrieval_decoder(target: LoadedModel, drafter: str,
                      config: DecodeConfig) -> RetrievalDecoder:
    """The decoder for a ``rest:DIR`` drafter spec over a loaded target."""
    from draftctl.decode.tree import RetrievalDecoder
    from draftctl.retrieval.datastore import Datastore
    from draftctl.retrieval.retriever import Retriever

    folder = drafter[len(PREFIX):]
    if not folder:
        raise DraftctlError("drafter spec 'rest:' needs the datastore folder: rest:DIR")
    datastore = Datastore(folder, target.tokenizer)
    return RetrievalDecoder.from_loaded(target, Retriever(datastore), config)
