"""Draft or lookup? How much a per-token choice between them could add to greedy agreement.

``model+lookup`` mixes the draft's distribution with the looked-up token by fixed weights per
match length (``drafters.lookup``); greedily that means: take the looked-up token after a
longer match, and after a one-token match unless the draft prefers another token by 0.25. This
script measures, position by position along the target's greedy output (first draft token,
the feature draft reading the target's states, as it drafts live), which of the two was right:
the draft's argmax, the looked-up token, both or neither. It reports, per prompt set and task
group, the agreement of the draft alone, of lookup alone where it finds a match, of the
shipped mixture, of a logistic gate fitted on the ``--fit`` split (features: the draft's top
probability and its probability of the looked-up token, the match's length, occurrences and
share) and evaluated on the ``--eval`` split, and the ceiling of any such choice (either
right).

    python benchmarks/lookup_gate.py --per-category 4
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch
from common import write_report
from draft_quality import SPEC_BENCH
from sklearn.linear_model import LogisticRegression
from tqdm import tqdm

from draftctl.controllers import make_controller
from draftctl.decode import DecodeConfig, SamplingConfig, SpeculativeDecoder, generate
from draftctl.distill.feature import FeatureDraftLM
from draftctl.drafters.base import TokenPicker
from draftctl.drafters.context import LookupConfig, find_match
from draftctl.models import DEFAULT_TARGET, default_draft, encode_prompt, load_model
from draftctl.profile import settle
from draftctl.prompts import load_prompts

FEATURES = ("log_q_max", "log_q_lookup", "match_len", "log_occurrences", "share", "unigram")


@torch.inference_mode()
def positions(target, draft, picker: TokenPicker, lookup: LookupConfig, prompt_ids: list[int],
              output_ids: list[int]) -> list[dict]:
    """One row per output position: the gate's features and who was right."""
    tokens = torch.tensor([prompt_ids + output_ids], device=target.device)
    start = len(prompt_ids) - 1
    states = target.model(tokens, output_hidden_states=True).hidden_states
    features = torch.stack([states[k][0] for k in draft.feature_layers], dim=1)
    _, logits = draft(tokens[:, 1:], features[None, :-1])
    # row p reads token p + 1 and the target's state at p, and drafts token p + 2
    logits = logits[0, start - 1:-1].float()  # row t: the output's token t
    q = picker.full(torch.softmax(logits, -1))
    seq = prompt_ids + output_ids
    matches = [find_match(np.asarray(seq[:start + 1 + t]), lookup)
               for t in range(len(output_ids))]
    mixed = picker.pick(logits, None, None, matches, greedy=True).tokens.tolist()
    q_max, alone = q.max(-1)
    rows = []
    for t, (truth, match) in enumerate(zip(output_ids, matches)):
        row = {"draft": int(alone[t]) == truth, "mixed": mixed[t] == truth, "match": False}
        if match is not None:
            q_lookup = float(q[t, match.token])
            row.update(match=True, lookup=match.token == truth,
                       same=match.token == int(alone[t]),
                       x=[math.log(max(float(q_max[t]), 1e-9)), math.log(max(q_lookup, 1e-9)),
                          float(min(match.length, lookup.max_ngram)),
                          math.log(match.occurrences), match.share(match.token),
                          float(match.length == 1)])
        rows.append(row)
    return rows


def collect(decoder, target, draft, picker, lookup, prompts) -> dict[str, list[dict]]:
    by_task: dict[str, list[dict]] = {}
    for prompt in tqdm(prompts, desc="lookup gate", unit="prompt"):
        ids = encode_prompt(target.tokenizer, prompt.text)
        output = generate(decoder, ids, make_controller("none")).output_ids
        by_task.setdefault(prompt.task, []).extend(
            positions(target, draft.model, picker, lookup, ids, output))
    return by_task


def fit_gate(rows: list[dict]) -> LogisticRegression:
    """P(the looked-up token is right rather than the draft's), fitted where they differ and
    exactly one of them is right."""
    useful = [r for r in rows if r["match"] and not r["same"] and r["lookup"] != r["draft"]]
    x = np.array([r["x"] for r in useful])
    y = np.array([r["lookup"] for r in useful])
    return LogisticRegression(max_iter=1000).fit(x, y)


def scores(rows: list[dict], gate: LogisticRegression) -> dict:
    n = len(rows)
    matched = [r for r in rows if r["match"]]
    x = np.array([r["x"] for r in matched]) if matched else np.zeros((0, len(FEATURES)))
    take = gate.predict_proba(x)[:, 1] > 0.5 if matched else []
    gated = sum(r["draft"] for r in rows if not r["match"]) + sum(
        (r["lookup"] if t else r["draft"]) for r, t in zip(matched, take))
    return {"positions": n, "matched": len(matched) / n,
            "draft_alone": sum(r["draft"] for r in rows) / n,
            "lookup_where_matched": sum(r["lookup"] for r in matched) / max(1, len(matched)),
            "mixed_shipped": sum(r["mixed"] for r in rows) / n,
            "gated": gated / n,
            "either": sum(r["draft"] or r.get("lookup", False) for r in rows) / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=None, help="a feature draft (default: shipped)")
    parser.add_argument("--prompts", nargs="+", default=[str(SPEC_BENCH), "draftctl"],
                        help="JSONL prompt sets; 'draftctl' is draftctl's own set")
    parser.add_argument("--fit", default="dev", help="the split the gate is fitted on")
    parser.add_argument("--eval", default="test", help="the split it is scored on")
    parser.add_argument("--per-category", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results/lookup_gate.json")
    args = parser.parse_args()

    draft_spec = args.draft or default_draft(args.target)
    setup = settle(args.target, draft_spec, "auto", "auto", need_profile=True)
    target = load_model(args.target, "auto", setup.target_dtype)
    draft = load_model(draft_spec, target.device, setup.draft_dtype, target=target)
    if not isinstance(draft.model, FeatureDraftLM):
        parser.error("--draft: this reads a feature draft's first step along the output")
    lookup = LookupConfig()
    picker = TokenPicker(len(target.tokenizer), SamplingConfig(), draft.model.head_ids, lookup)
    decoder = SpeculativeDecoder.from_loaded(
        target, draft, DecodeConfig(max_new_tokens=args.max_new_tokens, pass_shape=setup.shape))
    data = {split: {path: collect(decoder, target, draft, picker, lookup,
                                  load_prompts(None if path == "draftctl" else path, split,
                                               None, args.per_category))
                    for path in args.prompts}
            for split in (args.fit, args.eval)}
    gate = fit_gate([r for sets in data[args.fit].values() for rows in sets.values()
                     for r in rows])
    report = {"target": args.target, "draft": draft_spec, "lookup": vars(lookup),
              "fit": args.fit, "eval": args.eval, "per_category": args.per_category,
              "max_new_tokens": args.max_new_tokens,
              "gate": {"features": list(FEATURES),
                       "coef": [round(c, 4) for c in gate.coef_[0].tolist()],
                       "intercept": round(float(gate.intercept_[0]), 4)},
              "sets": {}}
    for split in (args.fit, args.eval):
        for path, by_task in data[split].items():
            every = [r for rows in by_task.values() for r in rows]
            report["sets"][f"{path} [{split}]"] = {
                **scores(every, gate),
                "by_task": {task: scores(rows, gate) for task, rows in sorted(by_task.items())}}
    write_report(report, args.out)


if __name__ == "__main__":
    main()
