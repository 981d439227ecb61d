"""Retrieval drafting (REST): a datastore of text, suffix-array lookup, trie candidates."""

from __future__ import annotations

from typing import TYPE_CHECKING

from draftctl.errors import DraftctlError

if TYPE_CHECKING:
    from draftctl.retrieval.retriever import Retriever

PREFIX = "rest:"


def is_retrieval(drafter: str | None) -> bool:
    return drafter is not None and drafter.startswith(PREFIX)


def make_retriever(drafter: str, tokenizer) -> Retriever:
    """The retriever a drafter spec ``rest:DIR`` or ``rest:DIR,key=value,...`` names (keys:
    the ``RetrievalConfig`` fields, e.g. ``max_nodes=16``), checked against ``tokenizer``."""
    from dataclasses import fields

    from draftctl.retrieval.datastore import Datastore
    from draftctl.retrieval.retriever import RetrievalConfig, Retriever

    folder, *options = drafter[len(PREFIX):].split(",")
    if not folder:
        raise DraftctlError("drafter spec 'rest:' needs the datastore folder: rest:DIR")
    known = {f.name for f in fields(RetrievalConfig)}
    settings = {}
    for option in options:
        key, _, value = option.partition("=")
        if key not in known or not value.isdigit():
            raise DraftctlError(f"drafter spec {drafter!r}: {option!r} is not key=integer with "
                                f"a key among {', '.join(sorted(known))}")
        settings[key] = int(value)
    return Retriever(Datastore(folder, tokenizer), RetrievalConfig(**settings))
