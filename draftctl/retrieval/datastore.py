"""The REST datastore: a token corpus and its suffix array, memory-mapped.

Files in the datastore folder:

- ``tokens.bin``: the corpus as big-endian uint32 token ids, documents separated by
  ``SEPARATOR`` (an id no tokenizer uses). Big-endian, so comparing the bytes of two token
  runs orders them as the suffix array does (token by token, numerically); the lookup compares
  bytes straight from the memory map.
- ``suffix_array.npy``: the start offsets of all suffixes in sorted order (int32 or int64),
  built by libdivsufsort (``pydivsufsort``).
- ``manifest.json``: format, tokenizer hash, corpus files with their SHA-256, token count.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from draftctl.errors import DraftctlError

FORMAT = "draftctl-rest-datastore/1"
SEPARATOR = 0xFFFFFFFF  # between documents; never a token id, so no match crosses documents
BUILTIN_CORPORA = {"stdlib": "the Python standard library's .py source files",
                   "chat": "the target's own greedy responses to the train split of a prompt "
                           "set (generated once, then reused; see draftctl.retrieval.chat)"}
TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".jsonl", ".c", ".h", ".js", ".ts",
                 ".java", ".go", ".rs", ".cpp", ".html", ".css", ".sh", ".yaml", ".yml"}


class DatastoreError(DraftctlError):
    """A datastore that cannot be built or used as asked."""


def tokenizer_sha256(tokenizer) -> str:
    """A hash of the vocabulary (token -> id) and special tokens: equal for tokenizers that
    turn text into the same ids."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = sorted(str(t) for t in tokenizer.all_special_tokens)
    return hashlib.sha256(json.dumps([vocab, special]).encode()).hexdigest()


def corpus_files(corpus: Iterable[str]) -> list[Path]:
    """Files of the corpus arguments: files, folders (their text files, recursively) or a
    built-in corpus name (``stdlib``)."""
    files: list[Path] = []
    for item in corpus:
        if item == "stdlib":
            root = Path(sysconfig.get_paths()["stdlib"])
            files += sorted(p for p in root.rglob("*.py")
                            if "site-packages" not in p.parts and "test" not in p.parts)
            continue
        path = Path(item)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file()
                            and p.suffix in TEXT_SUFFIXES)
        elif path.is_file():
            files.append(path)
        else:
            raise DatastoreError(f"corpus {item!r} is neither a file, a folder nor a built-in "
                                 f"corpus ({', '.join(BUILTIN_CORPORA)})")
    if not files:
        raise DatastoreError(f"no text files in the corpus {list(corpus)}")
    return files


def _dataset_texts(path: str) -> Iterator[str]:
    import datasets

    try:
        data = datasets.load_from_disk(path)
    except FileNotFoundError as err:
        raise DatastoreError(f"{path} is not a saved datasets dataset: {err}") from None
    if isinstance(data, datasets.DatasetDict):
        data = data["train"] if "train" in data else next(iter(data.values()))
    column = next((c for c in ("text", "content", "response", "prompt")
                   if c in data.column_names), None)
    if column is None:
        raise DatastoreError(f"{path} has no text column (text, content, response or "
                             f"prompt); its columns: {', '.join(data.column_names)}")
    yield from data[column]


def read_responses_files(paths: Iterable[str | Path]) -> tuple[list[list[int]], list[dict]]:
    """Token documents (prompt then response, as the target saw and wrote them) from JSONL
    files of ``{"prompt_ids", "response_ids"}`` rows (``draftctl distill``'s
    ``data/responses.jsonl`` or the chat corpus), and each file's entry for the manifest."""
    documents, sources = [], []
    for path in map(Path, paths):
        try:
            data = path.read_bytes()
            rows = [json.loads(line) for line in data.decode("utf-8").splitlines()
                    if line.strip()]
            docs = [[int(t) for t in r["prompt_ids"] + r["response_ids"]] for r in rows]
        except OSError as err:
            raise DatastoreError(f"cannot read responses file {path}: {err}") from None
        except (ValueError, KeyError, TypeError) as err:
            raise DatastoreError(f"{path} is not a responses file (JSON lines with prompt_ids "
                                 f"and response_ids): {err!r}") from None
        documents += docs
        sources.append({"file": str(path), "sha256": hashlib.sha256(data).hexdigest(),
                        "tokens": sum(map(len, docs)), "responses": len(docs)})
    return documents, sources


def build_datastore(tokenizer, out: str | Path, corpus: Iterable[str] = (),
                    dataset: str | None = None, tokenizer_spec: str = "",
                    progress: bool = True, responses: Iterable[str | Path] = ()) -> dict:
    """Tokenise the corpus, add the token documents of ``responses`` files, build the suffix
    array, write the datastore; returns the manifest."""
    corpus, responses = list(corpus), list(responses)
    if not corpus and dataset is None and not responses:
        raise DatastoreError("give a corpus (--corpus PATH..., stdlib or chat), --dataset PATH "
                             "or --responses FILE")
    if "chat" in corpus:
        raise DatastoreError("the chat corpus is generated by the target first: build it with "
                             "draftctl datastore build --corpus chat (or pass --responses)")
    files = corpus_files(corpus) if corpus else []
    chunks: list[np.ndarray] = []
    sources = []

    def documents() -> Iterator[tuple[str | None, str]]:
        for path in files:
            yield str(path), path.read_text(encoding="utf-8", errors="replace")
        if dataset is not None:
            for text in _dataset_texts(dataset):
                yield None, text

    for name, text in tqdm(documents(), desc="tokenise", unit="doc", total=len(files) or None,
                           disable=not progress):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            continue
        chunks += [np.asarray(ids, dtype=np.uint32), np.array([SEPARATOR], dtype=np.uint32)]
        if name is not None:
            sources.append({"file": name, "sha256": hashlib.sha256(
                text.encode("utf-8")).hexdigest(), "tokens": len(ids)})
    token_docs, response_sources = read_responses_files(responses)
    vocab = len(tokenizer)
    for doc in filter(None, token_docs):
        if min(doc) < 0 or max(doc) >= vocab:
            raise DatastoreError(f"a responses file holds token ids outside this tokenizer's "
                                 f"vocabulary (0..{vocab - 1}): written with another target?")
        chunks += [np.asarray(doc, dtype=np.uint32), np.array([SEPARATOR], dtype=np.uint32)]
    if not chunks:
        raise DatastoreError("the corpus holds no text")
    manifest = {"tokenizer": tokenizer_spec, "tokenizer_sha256": tokenizer_sha256(tokenizer),
                "documents": len(chunks) // 2, "files": sources, "dataset": dataset,
                "responses": response_sources}
    return write_datastore(np.concatenate(chunks), out, manifest, progress)


def write_datastore(tokens: np.ndarray, out: str | Path, manifest: dict,
                    progress: bool = False) -> dict:
    """Suffix-sort ``tokens`` (uint32, documents ending in ``SEPARATOR``) and write the
    datastore files atomically; ``manifest`` needs ``tokenizer`` and ``tokenizer_sha256``."""
    from pydivsufsort import divsufsort

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokens = np.asarray(tokens, dtype=np.uint32)
    if progress:
        print(f"suffix array over {len(tokens):,} tokens ...", file=sys.stderr)
    suffix_array = divsufsort(tokens)
    tmp = out / "tokens.bin.tmp"
    tokens.astype(">u4").tofile(tmp)
    os.replace(tmp, out / "tokens.bin")
    with open(out / "suffix_array.npy.tmp", "wb") as f:
        np.save(f, suffix_array)
    os.replace(out / "suffix_array.npy.tmp", out / "suffix_array.npy")
    manifest = {"format": FORMAT, **manifest, "tokens": len(tokens),
                "suffix_array": "libdivsufsort (pydivsufsort)"}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return manifest


class Datastore:
    """A built datastore, memory-mapped; ``tokens`` (uint32 view) and ``suffix_array``."""

    def __init__(self, folder: str | Path, tokenizer=None):
        folder = Path(folder)
        manifest_path = folder / "manifest.json"
        if not manifest_path.is_file():
            raise DatastoreError(f"{folder} has no manifest.json: not a draftctl datastore "
                                 "(build one with draftctl datastore build)")
        self.manifest = json.loads(manifest_path.read_text())
        if self.manifest.get("format") != FORMAT:
            raise DatastoreError(f"{folder}: unknown datastore format "
                                 f"{self.manifest.get('format')!r}, expected {FORMAT}")
        if tokenizer is not None and tokenizer_sha256(tokenizer) != \
                self.manifest["tokenizer_sha256"]:
            raise DatastoreError(
                f"{folder} was built with another tokenizer ({self.manifest['tokenizer']!r}); "
                "its token ids would not mean the same text: rebuild it with this target")
        self.folder = folder
        with open(folder / "tokens.bin", "rb") as f:
            self.bytes = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.tokens = np.frombuffer(self.bytes, dtype=">u4")
        self.suffix_array = np.load(folder / "suffix_array.npy", mmap_mode="r")
        if len(self.suffix_array) != len(self.tokens) or \
                len(self.tokens) != self.manifest["tokens"]:
            raise DatastoreError(f"{folder}: tokens.bin, suffix_array.npy and the manifest "
                                 "disagree on the token count (a partial or corrupt build)")

    def __len__(self) -> int:
        return len(self.tokens)

    def find(self, pattern: np.ndarray | list[int]) -> tuple[int, int]:
        """[lo, hi): the suffix-array range of suffixes that start with ``pattern``."""
        key = np.asarray(pattern, dtype=">u4").tobytes()
        n, width = len(self.tokens), len(key)
        sa, data = self.suffix_array, self.bytes

        def prefix(i: int) -> bytes:
            start = 4 * int(sa[i])
            return data[start:start + width]

        lo, hi = 0, n
        while lo < hi:  # first suffix >= pattern
            mid = (lo + hi) // 2
            if prefix(mid) < key:
                lo = mid + 1
            else:
                hi = mid
        first, hi = lo, n
        while lo < hi:  # first suffix whose prefix > pattern
            mid = (lo + hi) // 2
            if prefix(mid) <= key:
                lo = mid + 1
            else:
                hi = mid
        return first, lo
