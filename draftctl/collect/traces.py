"""Trace rows and Parquet shards.

A trace row is one drafted token: who it belongs to (run, prompt, round, position), its
feature record (``FEATURE_NAMES`` columns, the same vector controllers see), and what the
target made of it. Shards are plain Parquet files, written atomically (temporary file, then
rename), so a killed collection leaves only whole shards; one shard holds one prompt.

Two kinds of trace, told apart by ``run.json``'s ``mode``:

- ``rounds`` (probe or on-policy): real SD rounds. Labels: ``accepted`` (the token was
  accepted), ``reached`` (every earlier token of its round was accepted), ``accept_prob``
  (``min(1, p/q)``), ``beta`` (``sum min(p, q)``), ``target_top1_match``, and the round's
  ``round_accepted`` / ``round_drafted`` / ``draft_time_s`` / ``verify_time_s``.
  ``node`` / ``parent`` give each token's index in its round and its parent's (-1 under the
  root): a chain for model drafts, a trie for retrieval drafts, where ``position`` is the
  node's depth, ``reached`` means its parent was accepted (or it hangs under the root) and
  ``target_top1_match`` that its token is the target's argmax after its parent. A retrieval
  round whose lookup found nothing still costs a lookup and a target pass: it gets one row
  with ``node`` -1 and ``reached`` false (no token; training skips it, replay counts it).
- ``dense`` (greedy only): for every position ``round`` of the target's greedy output, the
  draft's ``K_probe``-token greedy continuation; ``match_len`` is how many of its leading
  tokens the target agrees with. Replay is exact: greedy SD is lossless, so any controller's
  run is a walk over these rows.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from draftctl.decode.features import FEATURE_NAMES
from draftctl.decode.loop import RoundRecord
from draftctl.errors import DraftctlError
from draftctl.retrieval.features import accepted_mask

ID_COLUMNS = {"run_id": pa.string(), "prompt_id": pa.int64(), "category": pa.string(),
              "round": pa.int32(), "position": pa.int32()}
FEATURE_COLUMNS = {name: pa.float64() for name in FEATURE_NAMES}
ROUND_LABELS = {"draft_token": pa.int64(), "accepted": pa.bool_(), "reached": pa.bool_(),
                "accept_prob": pa.float64(), "beta": pa.float64(),
                "target_top1_match": pa.bool_(), "round_accepted": pa.int32(),
                "round_drafted": pa.int32(), "draft_time_s": pa.float64(),
                "verify_time_s": pa.float64(), "node": pa.int32(), "parent": pa.int32()}
DENSE_LABELS = {"draft_token": pa.int64(), "target_token": pa.int64(),
                "match_len": pa.int32(), "output_len": pa.int32()}

SCHEMAS = {
    "rounds": pa.schema({**ID_COLUMNS, **FEATURE_COLUMNS, **ROUND_LABELS}),
    "dense": pa.schema({**ID_COLUMNS, **FEATURE_COLUMNS, **DENSE_LABELS}),
}


class TraceError(DraftctlError):
    """A trace folder or shard that cannot be read."""


def round_rows(record: RoundRecord, run_id: str, prompt_id: int, category: str,
               retrieval: bool = False) -> list[dict]:
    """One row per drafted token (chain) or trie node (retrieval) of a round."""
    if retrieval and not record.drafted:
        return [{"run_id": run_id, "prompt_id": prompt_id, "category": category,
                 "round": record.index, "position": 0, **dict.fromkeys(FEATURE_NAMES, 0.0),
                 "draft_token": -1, "accepted": False, "reached": False, "accept_prob": 0.0,
                 "beta": float("nan"), "target_top1_match": False, "round_accepted": 0,
                 "round_drafted": 0, "draft_time_s": record.draft_time_s,
                 "verify_time_s": record.verify_time_s, "node": -1, "parent": -1}]
    match = [t == a for t, a in zip(record.draft_tokens, record.target_argmax)]
    if record.tree_parents:
        parents = record.tree_parents
        accepted = accepted_mask(parents, match).tolist()
    else:
        parents = list(range(-1, record.drafted - 1))
        accepted = [i < record.n_accepted for i in range(record.drafted)]
    rows = []
    for i, (feature, token) in enumerate(zip(record.features, record.draft_tokens)):
        parent = parents[i]
        reached = parent < 0 or accepted[parent]
        rows.append({
            "run_id": run_id, "prompt_id": prompt_id, "category": category,
            "round": record.index, "position": feature.draft_pos, **feature.as_row(),
            "draft_token": token, "accepted": accepted[i], "reached": reached,
            "accept_prob": record.accept_prob[i],
            "beta": record.beta[i] if record.beta else float("nan"),
            "target_top1_match": match[i], "round_accepted": record.n_accepted,
            "round_drafted": record.drafted, "draft_time_s": record.draft_time_s,
            "verify_time_s": record.verify_time_s, "node": i, "parent": parent,
        })
    return rows


# A shard's schema metadata: the sha256 of the prompt's token ids it was decoded from.
PROMPT_KEY = b"draftctl.prompt_sha256"


def prompt_digest(prompt_ids: list[int]) -> str:
    """What a shard records of its prompt: the sha256 of its token ids (chat template
    included), so an edited prompt or template is noticed when a collection resumes."""
    return hashlib.sha256(json.dumps([int(i) for i in prompt_ids]).encode()).hexdigest()


def shard_prompt_digest(path: Path) -> str | None:
    """The ``prompt_digest`` a shard was written with (None: a shard from before it was)."""
    value = (pq.read_schema(path).metadata or {}).get(PROMPT_KEY)
    return value.decode() if value else None


def write_shard(rows: list[dict], path: Path, mode: str, prompt_sha256: str | None = None) -> None:
    """Write rows atomically: a reader sees the whole shard or none of it."""
    table = pa.Table.from_pylist(rows, schema=SCHEMAS[mode])
    if prompt_sha256 is not None:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}),
                                               PROMPT_KEY: prompt_sha256.encode()})
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def shard_files(folder: str | Path) -> list[Path]:
    files = sorted(Path(folder).glob("shards/*.parquet"))
    if not files:
        raise TraceError(f"no trace shards in {Path(folder) / 'shards'}")
    return files


def read_traces(folder: str | Path) -> pa.Table:
    """All shards of a trace folder as one table; a corrupt shard is named in the error."""
    tables = []
    for path in shard_files(folder):
        try:
            tables.append(pq.read_table(path))
        except (pa.ArrowInvalid, OSError) as err:
            raise TraceError(f"corrupt trace shard {path}: {err}") from None
    return pa.concat_tables(tables, promote_options="default")
