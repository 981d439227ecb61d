"""How good is a draft for its target? Spec-Bench test split, greedy.

Reports, in one run:
  (a) greedy top-1 agreement of the draft with the target along the target's own output;
  (b) mean ``beta = sum_v min(p, q)`` at temperature 1 along the same output;
  (c) draft forward time / target forward time for one token with a warm cache;
  (d) mean accepted draft tokens per round with ``static:4`` (and tau, which adds the bonus).
The target's greedy output comes from the ``static:4`` run itself (greedy SD is lossless; the
script checks it against plain decoding on the first prompts).

    python benchmarks/draft_quality.py [--draft smollm2-135m-draft] [--limit 60]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from common import write_report
from tqdm import tqdm

from draftctl.controllers import make_controller
from draftctl.decode import DecodeConfig, SpeculativeDecoder, generate
from draftctl.decode.cached_lm import CachedLM
from draftctl.decode.loop import synchronize
from draftctl.models import DEFAULT_TARGET, encode_prompt, load_model
from draftctl.prompts import load_prompts

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


@torch.inference_mode()
def along_output(target, draft, prompt_ids: list[int], output_ids: list[int]) -> tuple[int, float]:
    """(draft argmax hits, summed beta) over the output positions, teacher-forced."""
    tokens = torch.tensor([prompt_ids + output_ids], device=target.device)
    start = len(prompt_ids) - 1
    p = torch.softmax(target.model(tokens).logits[0, start:-1].float(), -1)
    vocab = p.shape[-1]
    q = torch.softmax(draft.model(tokens).logits[0, start:-1, :vocab].float(), -1)
    hits = int((q.argmax(-1) == tokens[0, start + 1:]).sum())
    return hits, float(torch.minimum(p, q).sum(-1).sum())


@torch.inference_mode()
def step_cost_ratio(target, draft, context: list[int], repeats: int = 30) -> dict:
    """Median seconds of one single-token forward with a warm cache, interleaved."""
    lms = {"target": CachedLM(target.model, len(target.tokenizer)),
           "draft": CachedLM(draft.model, len(target.tokenizer))}
    ids = torch.tensor(context, device=target.device)
    for lm in lms.values():
        lm.forward(ids[:-1])
    times = {name: [] for name in lms}
    for _ in range(repeats):
        for name, lm in lms.items():
            start = time.perf_counter()
            lm.forward(ids[-1:], last_only=True)
            synchronize(target.device)
            times[name].append(time.perf_counter() - start)
            lm.truncate(len(ids) - 1)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {"target_s": medians["target"], "draft_s": medians["draft"],
            "ratio": medians["draft"] / medians["target"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default="smollm2-135m-draft")
    parser.add_argument("--prompts", default=str(SPEC_BENCH))
    parser.add_argument("--split", default="test")
    parser.add_argument("--limit", type=int, default=60)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default="benchmarks/results/draft_quality.json")
    args = parser.parse_args()

    target = load_model(args.target, args.device)
    draft = load_model(args.draft, target.device, target=target)
    decoder = SpeculativeDecoder.from_loaded(target, draft,
                                             DecodeConfig(max_new_tokens=args.max_new_tokens))
    prompts = load_prompts(args.prompts, args.split, args.limit)
    encoded = [encode_prompt(target.tokenizer, p.text) for p in prompts]
    cost = step_cost_ratio(target, draft, encoded[0][:128])

    hits = positions = 0
    beta_sum = 0.0
    accepted = rounds = new_tokens = 0
    checked = 0
    for ids in tqdm(encoded, desc="draft quality", unit="prompt"):
        result = generate(decoder, ids, make_controller("static:4"))
        if checked < 3:  # losslessness spot check: greedy SD equals plain decoding
            plain = generate(decoder, ids, make_controller("none"))
            assert plain.output_ids == result.output_ids, "greedy SD differs from plain decoding"
            checked += 1
        h, b = along_output(target, draft, ids, result.output_ids)
        hits, beta_sum, positions = hits + h, beta_sum + b, positions + len(result.output_ids)
        accepted += sum(r.n_accepted for r in result.rounds)
        rounds += len(result.rounds)
        new_tokens += result.new_tokens

    report = {"target": args.target, "draft": args.draft, "prompts": len(prompts),
              "split": args.split, "max_new_tokens": args.max_new_tokens,
              "positions": positions,
              "greedy_agreement": hits / positions,
              "mean_beta_t1": beta_sum / positions,
              "step_cost": cost,
              "static4_accepted_per_round": accepted / rounds,
              "static4_tau": new_tokens / rounds,
              "threads": torch.get_num_threads(), "device": str(target.device)}
    write_report(report, args.out)


if __name__ == "__main__":
    main()
