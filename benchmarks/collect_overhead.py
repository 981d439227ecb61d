"""Tracing overhead: tokens/s of collection vs plain SD under the same policy.

Same pair (the built-in target and its shipped draft unless --target/--draft), same prompts,
same controller, greedy. For each prompt, plain SD (``generate``) and collection (the loop of
``draftctl collect --mode policy``: rounds -> trace rows -> one atomic Parquet shard) run back
to back in alternating order, so machine noise hits both alike. Model loading and the cost
curve measurement are left out of both, as the collect progress bar leaves them out. Prints and
writes JSON with the ratio collection / plain (goal: >= 0.8).

    python benchmarks/collect_overhead.py [--controller svip] [--limit 8] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import write_report

from draftctl.collect.traces import round_rows, write_shard
from draftctl.controllers import make_controller
from draftctl.decode import DecodeConfig, SpeculativeDecoder, generate
from draftctl.decode.loop import synchronize
from draftctl.models import DEFAULT_TARGET, default_draft, encode_prompt, load_model
from draftctl.prompts import load_prompts


def collect_one(decoder, ids, controller, prompt, shard: Path) -> tuple[int, float]:
    synchronize(decoder.device)
    start = time.perf_counter()
    rows, tokens = [], 0
    for record in decoder.rounds(ids, controller):
        rows += round_rows(record, "bench", prompt.question_id, prompt.category)
        tokens += len(record.new_tokens)
    write_shard(rows, shard, "rounds")
    return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--prompts", default=None, help="JSONL prompts (default: draftctl's set)")
    parser.add_argument("--split", default="test")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--controller", default="svip")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="benchmarks/results/collect_overhead.json")
    args = parser.parse_args()

    target = load_model(args.target, args.device)
    draft = load_model(args.draft or default_draft(args.target), target.device, target=target)
    decoder = SpeculativeDecoder.from_loaded(
        target, draft, DecodeConfig(max_new_tokens=args.max_new_tokens))
    controller = make_controller(args.controller)
    prompts = load_prompts(args.prompts, args.split, args.limit)
    totals = {"plain": [0, 0.0], "collect": [0, 0.0]}
    with tempfile.TemporaryDirectory() as tmp:
        for i, prompt in enumerate(prompts):
            ids = encode_prompt(target.tokenizer, prompt.text)
            generate(decoder, ids, controller)  # warm-up, untimed
            order = ("plain", "collect") if i % 2 == 0 else ("collect", "plain")
            for what in order:
                if what == "plain":
                    result = generate(decoder, ids, controller)
                    tokens, seconds = result.new_tokens, result.wall_s
                else:
                    tokens, seconds = collect_one(decoder, ids, controller, prompt,
                                                  Path(tmp) / f"q{prompt.question_id}.parquet")
                totals[what][0] += tokens
                totals[what][1] += seconds
    rates = {k: n / s for k, (n, s) in totals.items()}
    report = {"controller": args.controller, "prompts": len(prompts),
              "plain_tokens_per_s": rates["plain"], "collect_tokens_per_s": rates["collect"],
              "ratio": rates["collect"] / rates["plain"], "goal": 0.8,
              "tokens": totals["plain"][0]}
    write_report(report, args.out)


if __name__ == "__main__":
    main()
