"""How good is a draft for its target? Greedy, on held-out prompt sets, calibrated dtypes.

The pair runs in the dtypes and pass shape its calibrated profile chose (calibrated now if
there is none). For each prompt set (default: Spec-Bench test and draftctl's own test split)
it reports, in one run:
  (a) greedy top-1 agreement of the draft with the target along the target's own output,
      teacher-forced (a feature draft reads the target's states there; its second unrolled
      step, reading its own features, is reported too);
  (b) mean ``beta = sum_v min(p, q)`` at temperature 1 along the same output;
  (c) mean accepted draft tokens per round with ``static:4``, the share of rounds whose first
      draft token is accepted, and tau (which adds the bonus token);
  (e) the drafter's own greedy agreement as it drafts live (``--drafter model+lookup``: with
      context lookup), from its batched continuations after every prefix of the output: its
      first token, and its second where the first was right;
(a) and (e) also per task group (``by_task``: where does the draft fall short?);
and once: (d) the draft's step (a one-token proposal) over the target's step, from the profile
(the target's step is a one-token pass at the pass shape decoding really uses, and unpadded).
The target's greedy output comes from the ``static:4`` run itself (greedy SD is lossless; the
script checks it against plain decoding on the first prompts of each set).

    python benchmarks/draft_quality.py [--draft smollm2-135m-draft] [--per-category 10]
        [--split train,dev,test] [--drafter model+lookup]
    python benchmarks/draft_quality.py --draft runs/distill-pool-v10 --split all \
        --prompts runs/pool-v9/pool.jsonl --holdout-every 20   # trained minus held out
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import write_report
from tqdm import tqdm

from draftctl.controllers import make_controller
from draftctl.decode import DecodeConfig, SpeculativeDecoder, generate
from draftctl.distill.feature import FeatureDraftLM, agreement
from draftctl.drafters import parse_drafter
from draftctl.models import DEFAULT_TARGET, default_draft, encode_prompt, load_model
from draftctl.profile import settle
from draftctl.prompts import first_of, load_prompts

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


@torch.inference_mode()
def along_output(target, draft, prompt_ids: list[int], output_ids: list[int]) -> dict:
    """Teacher-forced over the output positions: draft argmax hits (per unrolled step for a
    feature draft), summed beta at T=1, and the number of positions."""
    tokens = torch.tensor([prompt_ids + output_ids], device=target.device)
    start = len(prompt_ids) - 1
    p = torch.softmax(target.model(tokens).logits[0, start:-1].float(), -1)
    n = len(output_ids)
    if isinstance(draft.model, FeatureDraftLM):
        row = {"prompt_ids": prompt_ids, "response_ids": output_ids}
        steps = agreement(draft.model, [row], target.model, steps=2)
        states = target.model(tokens, output_hidden_states=True).hidden_states
        features = torch.stack([states[k][0] for k in draft.model.feature_layers], dim=1)
        _, logits = draft.model(tokens[:, 1:], features[None, :-1])
        # row r reads token r + 1 and the target's state at r, and drafts token r + 2
        q_head = torch.softmax(logits[0, start - 1:-1].float(), -1)
        beta = torch.minimum(p[:, draft.model.head_ids], q_head).sum()
        return {"hits": [a * n for a in steps], "beta": float(beta), "positions": n}
    q = torch.softmax(draft.model(tokens).logits[0, start:-1, :p.shape[-1]].float(), -1)
    hits = int((q.argmax(-1) == tokens[0, start + 1:]).sum())
    return {"hits": [hits], "beta": float(torch.minimum(p, q).sum()), "positions": n}


@torch.inference_mode()
def drafter_hits(decoder, prompt_ids: list[int], output_ids: list[int]) -> tuple[int, int, int]:
    """The live drafter's greedy continuations after every prefix of the output (what
    ``propose`` drafts there): (first tokens right, second tokens right after a right first,
    first tokens drafted)."""
    seq = torch.tensor(prompt_ids + output_ids, device=decoder.device)
    target, drafter = decoder.target, decoder.drafter
    hidden = None
    if drafter.hidden_layers:
        target.reset()
        _, hidden = target.prefill_hidden(seq[:-1], drafter.hidden_layers, keep=1)
        target.reset()
    tokens, _ = drafter.continuations(seq, len(prompt_ids), 2, hidden)
    truth = seq[len(prompt_ids):]
    first = tokens[:, 0] == truth
    second = first[:-1] & (tokens[:-1, 1] == truth[1:])
    return int(first.sum()), int(second.sum()), len(truth)


def step_cost(setup) -> dict:
    """The draft's one-token proposal over the target's step, as calibrate measured them."""
    profile = setup.profile
    t_target = profile["target"]["by_dtype"][setup.target_dtype]["t_ms"]
    t_draft = profile["draft"]["by_dtype"][setup.draft_dtype]["t_ms"]["1"]
    rows = setup.shape.rows(1)
    return {"draft_ms": t_draft, "target_ms_one_row": t_target["1"],
            "target_ms_pass_shape": t_target[str(rows)], "pass_rows": rows,
            "ratio": t_draft / t_target[str(rows)], "ratio_vs_one_row": t_draft / t_target["1"]}


def quality(decoder, target, draft, prompts, check: int = 3) -> dict:
    hits: list[float] = []
    positions = 0
    beta = 0.0
    accepted = rounds = first = new_tokens = 0
    live = [0, 0, 0]
    by_task: dict[str, list[float]] = {}
    for i, prompt in enumerate(tqdm(prompts, desc="draft quality", unit="prompt")):
        ids = encode_prompt(target.tokenizer, prompt.text)
        result = generate(decoder, ids, make_controller("static:4"))
        if i < check:  # losslessness spot check: greedy SD equals plain decoding
            plain = generate(decoder, ids, make_controller("none"))
            assert plain.output_ids == result.output_ids, "greedy SD differs from plain decoding"
        got = along_output(target, draft, ids, result.output_ids)
        live_hits = drafter_hits(decoder, ids, result.output_ids)
        live = [a + b for a, b in zip(live, live_hits)]
        task = by_task.setdefault(prompt.task, [0, 0, 0, 0])
        for k, value in enumerate((got["hits"][0], got["positions"], live_hits[0], live_hits[2])):
            task[k] += value
        hits = [a + b for a, b in zip(hits, got["hits"])] if hits else got["hits"]
        beta, positions = beta + got["beta"], positions + got["positions"]
        drafted = [r for r in result.rounds if r.draft_tokens]
        accepted += sum(r.n_accepted for r in drafted)
        first += sum(r.n_accepted > 0 for r in drafted)
        rounds += len(drafted)
        new_tokens += sum(len(r.new_tokens) for r in drafted)
    report = {"prompts": len(prompts), "positions": positions,
              "greedy_agreement": hits[0] / positions, "mean_beta_t1": beta / positions,
              "static4_accepted_per_round": accepted / rounds,
              "static4_first_token_accepted": first / rounds, "static4_tau": new_tokens / rounds,
              "drafter_agreement": live[0] / live[2],
              "drafter_agreement_step2": live[1] / max(1, live[0]),
              "by_task": {name: {"greedy_agreement": h / n, "drafter_agreement": lh / ln,
                                 "positions": n}
                          for name, (h, n, lh, ln) in sorted(by_task.items())}}
    if len(hits) > 1:
        report["greedy_agreement_step2"] = hits[1] / positions
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=None, help="default: the target's shipped draft")
    parser.add_argument("--drafter", default=None,
                        help="model+lookup: the draft mixed with context lookup (default model)")
    parser.add_argument("--prompts", nargs="+", default=[str(SPEC_BENCH), "draftctl"],
                        help="JSONL prompt sets; 'draftctl' is draftctl's own set")
    parser.add_argument("--split", default="test",
                        help="a split, or several joined by commas, each reported on its own "
                             "(train,dev,test: does the draft see every split alike?)")
    parser.add_argument("--per-category", type=int, default=10,
                        help="prompts per task group of each set and split")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--holdout-every", type=int, default=None, metavar="N",
                        help="report each set twice: the prompts a draft trained on (question_id "
                             "%% N != 0) and those held out (== 0), as distill's holdout_every")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", default="benchmarks/results/draft_quality.json")
    args = parser.parse_args()

    draft_spec = args.draft or default_draft(args.target)
    setup = settle(args.target, draft_spec, args.device, args.dtype, need_profile=True)
    target = load_model(args.target, args.device, setup.target_dtype)
    draft = load_model(draft_spec, target.device, setup.draft_dtype, target=target)
    drafter = parse_drafter(args.drafter)
    if not drafter.uses_model:
        parser.error("--drafter: this measures a draft model, alone or model+lookup")
    decoder = SpeculativeDecoder.from_loaded(
        target, draft, DecodeConfig(max_new_tokens=args.max_new_tokens, pass_shape=setup.shape),
        drafter.lookup)
    sets = {}
    splits = args.split.split(",")
    for path in args.prompts:
        for split in splits:
            key = path if len(splits) == 1 else f"{path} [{split}]"
            prompts = load_prompts(None if path == "draftctl" else path, split)
            parts = {key: prompts} if args.holdout_every is None else {
                f"{key} [{name}]": [p for p in prompts
                                    if (p.question_id % args.holdout_every == 0) == held]
                for name, held in (("trained", False), ("held out", True))}
            for name, part in parts.items():
                sets[name] = quality(decoder, target, draft,
                                     first_of(part, args.per_category, args.limit))
    report = {"target": args.target, "draft": draft_spec, "drafter": drafter.text,
              "split": args.split,
              "per_category": args.per_category,
              "max_new_tokens": args.max_new_tokens, "sets": sets, "step_cost": step_cost(setup),
              **setup.describe(), "threads": torch.get_num_threads(),
              "device": str(target.device)}
    write_report(report, args.out)


if __name__ == "__main__":
    main()
