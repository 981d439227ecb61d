"""Batched generation of the target's answers (distill's stage 1, the chat corpus): tokens/s
per dtype, interleaved.

Runs ``draftctl.distill.data.generate_responses`` (transformers' batched ``generate``, left
padding) on the same prompts in each dtype, one greedy and one sampled (T=1) answer per
prompt, and reports generated tokens per second and the ratio to float32 (goal: bfloat16 >=
3x float32). With ``--caches static,dynamic`` each dtype runs with both of transformers'
caches, interleaved, and the report gives each cache's rates and ratios.

    python benchmarks/batch_generate.py [--prompts PATH] [--limit 64] [--batch 64]
        [--caches static,dynamic]
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
    parser.add_argument("--caches", default="auto",
                        help="comma-separated: auto (distill's choice), static, dynamic")
    parser.add_argument("--out", default="benchmarks/results/batch_generate.json")
    args = parser.parse_args()

    prompts = load_prompts(args.prompts, "train", args.limit)
    models = {d: load_model(args.target, "cpu", d) for d in args.dtypes.split(",")}
    caches = args.caches.split(",")
    runs = [(dtype, cache) for dtype in models for cache in caches]
    totals = {run: [0, 0.0] for run in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for dtype, cache in runs if rep % 2 == 0 else runs[::-1]:
                target = models[dtype]
                path = Path(tmp) / f"{dtype}-{cache}-{rep}.jsonl"
                start = time.perf_counter()
                generate_responses(
                    target.model, target.tokenizer, prompts, path, samples_per_prompt=1,
                    max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0,
                    batch_size=args.batch, max_prompt_tokens=384, seed=rep,
                    eos_ids=target.eos_token_ids, cache=cache)
                seconds = time.perf_counter() - start
                rows = [json.loads(line) for line in path.read_text().splitlines()]
                totals[dtype, cache][0] += sum(len(r["response_ids"]) for r in rows)
                totals[dtype, cache][1] += seconds
    by_cache = {}
    for cache in caches:
        rates = {d: totals[d, cache][0] / totals[d, cache][1] for d in models}
        by_cache[cache] = {"tokens_per_s": rates,
                           "ratio_to_float32": {d: r / rates["float32"] for d, r in rates.items()}
                           if "float32" in rates else None}
    report = {"target": args.target, "prompts": len(prompts), "batch": args.batch,
              "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(),
              **by_cache[caches[0]]}
    if len(caches) > 1:
        report["by_cache"] = by_cache
        report["ratio_to_first_cache"] = {
            f"{d}/{cache}": by_cache[cache]["tokens_per_s"][d] / by_cache[caches[0]][
                "tokens_per_s"][d] for d in models for cache in caches[1:]}
    write_report(report, args.out)


if __name__ == "__main__":
    main()
