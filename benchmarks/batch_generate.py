"""Batched generation of the target's answers (distill's stage 1, the chat corpus): tokens/s
per dtype, interleaved.

Runs ``draftctl.distill.data.generate_responses`` (transformers' batched ``generate``, left
padding) on the same prompts in each dtype, one greedy and one sampled (T=1) answer per
prompt, and reports generated tokens per second and the ratio to float32 (goal: bfloat16 >=
3x float32).

    python benchmarks/batch_generate.py [--prompts PATH] [--limit 64] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from common import write_report

from draftctl.distill.data import generate_responses
from draftctl.models import DEFAULT_TARGET, load_model
from draftctl.prompts import load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--prompts", default=None, help="JSONL prompts (default: draftctl's set)")
    parser.add_argument("--limit", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/batch_generate.json")
    args = parser.parse_args()

    prompts = load_prompts(args.prompts, "train", args.limit)
    models = {d: load_model(args.target, "cpu", d) for d in args.dtypes.split(",")}
    totals = {d: [0, 0.0] for d in models}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            order = list(models.items())
            for dtype, target in order if rep % 2 == 0 else order[::-1]:
                path = Path(tmp) / f"{dtype}-{rep}.jsonl"
                start = time.perf_counter()
                generate_responses(
                    target.model, target.tokenizer, prompts, path, samples_per_prompt=1,
                    max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0,
                    batch_size=args.batch, max_prompt_tokens=384, seed=rep,
                    eos_ids=target.eos_token_ids)
                seconds = time.perf_counter() - start
                rows = [json.loads(line) for line in path.read_text().splitlines()]
                totals[dtype][0] += sum(len(r["response_ids"]) for r in rows)
                totals[dtype][1] += seconds
    rates = {d: n / s for d, (n, s) in totals.items()}
    report = {"target": args.target, "prompts": len(prompts), "batch": args.batch,
              "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(),
              "tokens_per_s": rates,
              "ratio_to_float32": {d: r / rates["float32"] for d, r in rates.items()}
              if "float32" in rates else None}
    write_report(report, args.out)


if __name__ == "__main__":
    main()
