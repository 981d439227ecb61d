"""Traces -> training examples, DISCO-style.

Each example is a drafted token that was *reached* (every earlier token of its round was
accepted); its label is whether the target accepted it: 0/1 in greedy mode, the soft
``accept_prob = min(1, p/q)`` when sampling. In dense traces, token ``j`` of the continuation
at ``t`` is reached when ``match_len >= j - 1`` and accepted when ``match_len >= j``. In
retrieval traces a trie node is reached when its parent was accepted (or it hangs under the
root): the label is then whether its token is the target's argmax after the parent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from draftctl.collect.traces import TraceError, read_traces
from draftctl.decode.features import FEATURE_NAMES, RETRIEVAL_FEATURES, check_trace_schema
from draftctl.prompts import split_of

# Features that describe the sequence's history. Dense traces hold placeholders there (the
# history depends on the controller being replayed), so models fitted on them leave these out.
HISTORY_FEATURES = ("prev_accepted", "prev_drafted", "accept_rate")


@dataclass
class Examples:
    X: np.ndarray  # (n, len(features)) float32
    y: np.ndarray  # (n,) float32 in [0, 1]
    prompt_ids: np.ndarray  # (n,)
    splits: np.ndarray  # (n,) "train" | "dev" | "test"
    features: tuple[str, ...]
    info: dict  # run.json of the traces

    def subset(self, split: str) -> Examples:
        keep = self.splits == split
        return Examples(self.X[keep], self.y[keep], self.prompt_ids[keep], self.splits[keep],
                        self.features, self.info)


def default_features(info: dict) -> tuple[str, ...]:
    """All features the traces carry: no history placeholders (dense traces), no retrieval
    features for a draft model without lookup (they are 0 there)."""
    left_out = (HISTORY_FEATURES if info["mode"] == "dense" else ()) + (
        RETRIEVAL_FEATURES if info.get("drafter", "model") == "model" else ())
    return tuple(f for f in FEATURE_NAMES if f not in left_out)


def load_examples(folder: str | Path, features: tuple[str, ...] | None = None) -> Examples:
    folder = Path(folder)
    info_path = folder / "run.json"
    if not info_path.is_file():
        raise TraceError(f"{folder} has no run.json: not a trace folder")
    info = json.loads(info_path.read_text())
    check_trace_schema(info, folder)
    features = features or default_features(info)
    unknown = sorted(set(features) - set(FEATURE_NAMES))
    if unknown:
        raise TraceError(f"unknown feature(s) {', '.join(unknown)}; known: "
                         f"{', '.join(FEATURE_NAMES)}")
    table = read_traces(folder)
    col = {name: table.column(name).to_numpy() for name in (*features, "prompt_id", "position")}
    if info["mode"] == "dense":
        match = table.column("match_len").to_numpy()
        known = table.column("target_token").to_numpy() >= 0
        reached = (match >= col["position"] - 1) & known
        label = (match >= col["position"]).astype(np.float32)
    else:
        reached = table.column("reached").to_numpy(zero_copy_only=False)
        greedy = info["decoding"]["temperature"] == 0
        label = (table.column("accepted").to_numpy(zero_copy_only=False) if greedy
                 else table.column("accept_prob").to_numpy()).astype(np.float32)
    X = np.stack([col[name] for name in features], axis=1).astype(np.float32)[reached]
    prompt_ids = col["prompt_id"][reached]
    splits = np.array([split_of(int(p)) for p in prompt_ids])
    return Examples(X, label[reached], prompt_ids, splits, tuple(features), info)
