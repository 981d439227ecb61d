"""Distillation data: the target's own responses, and its soft labels on them.

Stage 1 (``generate_responses``): for each prompt, one greedy and ``samples_per_prompt``
sampled responses, batched through transformers' ``generate`` (left padding), appended to a
JSONL file batch by batch so that an interrupted run resumes where it stopped.

Stage 2 (``teacher_labels``): one teacher-forced target pass per sequence; for every response
position keep the target's top-k probabilities restricted to the draft's head tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from draftctl.errors import DraftctlError
from draftctl.models import encode_prompt
from draftctl.prompts import Prompt


def _done_keys(path: Path) -> set[tuple[int, int]]:
    """(question_id, sample) pairs already written; a torn last line is dropped."""
    if not path.is_file():
        return set()
    keys, good = set(), 0
    with path.open("rb") as handle:
        for line in handle:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break
            keys.add((row["question_id"], row["sample"]))
            good += len(line)
    if good < path.stat().st_size:  # truncate a partial line left by a kill
        with path.open("r+b") as handle:
            handle.truncate(good)
    return keys


def generate_responses(model, tokenizer, prompts: Sequence[Prompt], path: Path, *,
                       samples_per_prompt: int, max_new_tokens: int, temperature: float,
                       top_p: float, batch_size: int, max_prompt_tokens: int, seed: int,
                       eos_ids: Iterable[int],
                       on_batch: Callable[[dict], None] | None = None,
                       cache: str = "auto", greedy: bool = True) -> dict:
    """Append ``{"question_id", "sample", "prompt_ids", "response_ids"}`` rows to ``path``.

    Sample 0 is greedy (unless ``greedy`` is False); samples 1.. are drawn at
    ``temperature`` / ``top_p``. Each batch is seeded from (seed, its first key), so a resumed
    run draws what a straight run would.
    Returns what this call wrote: ``{"responses", "tokens", "seconds"}``; ``on_batch`` hears
    the same of each batch once it is on disk (a stage ledger that a kill does not lose).
    ``cache`` is transformers' cache for the batch: ``static`` (preallocated, no copy of the
    keys and values per step; measured faster on CPU by ``benchmarks/batch_generate.py``),
    ``dynamic``, or ``auto``: static on CPU, dynamic elsewhere (where transformers would
    compile the model for a static cache, once per batch shape).
    """
    if cache not in ("auto", "static", "dynamic"):
        raise ValueError(f"cache must be auto, static or dynamic, got {cache!r}")
    started = time.perf_counter()
    written = tokens = 0
    eos = sorted(eos_ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    done = _done_keys(path)
    jobs = []
    for prompt in prompts:
        ids = encode_prompt(tokenizer, prompt.text)[-max_prompt_tokens:]
        for sample in range(0 if greedy else 1, samples_per_prompt + 1):
            if (prompt.question_id, sample) not in done:
                jobs.append((prompt.question_id, sample, ids))
    # Greedy and sampled jobs go in separate batches; similar lengths together cut padding.
    jobs.sort(key=lambda job: len(job[2]))
    batches = [group[i:i + batch_size]
               for group in ([j for j in jobs if j[1] == 0], [j for j in jobs if j[1] > 0])
               for i in range(0, len(group), batch_size)]
    device = next(model.parameters()).device
    if cache == "auto":
        cache = "static" if device.type == "cpu" else "dynamic"
    bar = tqdm(total=len(jobs), desc="target responses", unit="resp")
    with path.open("a", encoding="utf-8") as out:
        for batch in batches:
            batch_started, batch_tokens = time.perf_counter(), tokens
            greedy = batch[0][1] == 0
            width = max(len(j[2]) for j in batch)
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (_, _, ids) in enumerate(batch):
                input_ids[row, width - len(ids):] = torch.tensor(ids)
                mask[row, width - len(ids):] = 1
            torch.manual_seed(seed * 1_000_003 + batch[0][0] * 97 + batch[0][1])
            with torch.inference_mode():
                generated = model.generate(
                    input_ids.to(device), attention_mask=mask.to(device),
                    max_new_tokens=max_new_tokens, do_sample=not greedy,
                    temperature=None if greedy else temperature,
                    top_p=None if greedy else top_p, top_k=None,
                    eos_token_id=eos, pad_token_id=pad, cache_implementation=cache)
            for row, (qid, sample, ids) in enumerate(batch):
                response = generated[row, width:].tolist()
                end = next((i + 1 for i, t in enumerate(response) if t in eos), len(response))
                out.write(json.dumps({"question_id": qid, "sample": sample, "prompt_ids": ids,
                                      "response_ids": response[:end]}) + "\n")
                written, tokens = written + 1, tokens + end
            out.flush()
            os.fsync(out.fileno())
            bar.update(len(batch))
            if on_batch is not None:
                on_batch({"responses": len(batch), "tokens": tokens - batch_tokens,
                          "seconds": time.perf_counter() - batch_started,
                          "dtype": dtype_of(model)})
    bar.close()
    return {"responses": written, "tokens": tokens, "seconds": time.perf_counter() - started}


def read_stages(folder: Path) -> dict:
    """The stage ledger ``record_stage`` keeps in ``folder/stages.json`` ({} if none)."""
    path = folder / "stages.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def record_stage(folder: Path, stage: str, done: dict, new_run: bool = True) -> dict:
    """Add what a run of ``stage`` did (``seconds`` and counts) to ``folder/stages.json``, so
    that the figures of a recipe that was interrupted and resumed add up; returns them all,
    with ``tokens_per_s`` where tokens were counted. ``new_run=False`` adds to the current
    run (work recorded as it is done)."""
    path = folder / "stages.json"
    stages = read_stages(folder)
    entry = stages.setdefault(stage, {"runs": 0})
    entry["runs"] += int(new_run)
    for key, value in done.items():
        if isinstance(value, str):  # a setting (e.g. the dtype): every value it took
            entry[key] = sorted({*entry.get(key, []), value})
        else:
            entry[key] = entry.get(key, 0) + value
    if entry.get("tokens") and entry.get("seconds"):
        entry["tokens_per_s"] = entry["tokens"] / entry["seconds"]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(stages, indent=2))
    os.replace(tmp, path)
    return stages


def dtype_of(model) -> str:
    """The dtype a model computes in, as the ledger records it ("float32")."""
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def ledger(folder: Path, stage: str) -> Callable[[dict], None]:
    """Count a new run of ``stage`` in ``folder/stages.json`` and return the callback that
    adds each piece of its work there as it is done (``on_batch`` of ``generate_responses``)."""
    record_stage(folder, stage, {})
    return lambda done: record_stage(folder, stage, done, new_run=False)


def read_responses(path: Path) -> list[dict]:
    _done_keys(path)
    with path.open(encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    rows.sort(key=lambda r: (r["question_id"], r["sample"]))
    return rows


def ranked_tokens(rows: Sequence[dict]) -> list[int]:
    """The ids of the rows' responses (the target's own outputs, which the head must draft;
    extra text is all response), most frequent first."""
    counts = Counter()
    for row in rows:
        counts.update(row["response_ids"])
    return [t for t, _ in counts.most_common()]


def choose_head_ids(rows: Sequence[dict], head_size: int, always: Iterable[int],
                    vocab_size: int) -> torch.Tensor:
    """``always`` and the ``head_size`` most frequent ids of the responses (``ranked_tokens``)."""
    chosen = list(dict.fromkeys([*always, *ranked_tokens(rows)]))[:head_size]
    if len(chosen) < head_size:  # pad with the lowest unused ids so the head has a fixed size
        used = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in used][: head_size - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def text_rows(tokenizer, paths: Sequence[str], chunk_tokens: int) -> dict:
    """Rows for extra local text: each file tokenised (no chat template) and cut into chunks of
    ``chunk_tokens``, labelled at every position. Returns {"rows", "files"} where "files" gives
    each file's path, sha256 and token count for the manifest."""
    if chunk_tokens < 2:
        raise DraftctlError(f"text_chunk_tokens must be at least 2, got {chunk_tokens}")
    rows, files = [], []
    for path in map(Path, paths):
        try:
            data = path.read_bytes()
            text = data.decode("utf-8")
        except OSError as err:
            raise DraftctlError(f"cannot read extra text file {path}: {err}") from None
        except UnicodeDecodeError as err:
            raise DraftctlError(f"extra text file {path} is not UTF-8 text: {err}") from None
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        files.append({"path": str(path), "sha256": hashlib.sha256(data).hexdigest(),
                      "tokens": len(ids)})
        for first in range(0, len(ids) - 1, chunk_tokens):
            chunk = ids[first:first + chunk_tokens]
            if len(chunk) > 1:  # position 0 predicts token 1: the whole chunk is labelled
                rows.append({"question_id": -1 - len(rows), "sample": 0,
                             "prompt_ids": chunk[:1], "response_ids": chunk[1:]})
    return {"rows": rows, "files": files}
