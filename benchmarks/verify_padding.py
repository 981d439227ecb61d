"""Verification cost per pass size, and what padding small passes (``--verify-min``) buys.

Measures the target's warm-cache pass time for n = 1..--max-n new tokens (the cost curve
``collect`` records), then decodes the same prompts with ``static:K`` for each K in --ks, with
and without ``verify_min``, interleaved prompt by prompt, and checks that the outputs are
identical. Prints and writes JSON: the curve as ratios to one token, and tokens/s of each
controller padded and unpadded with their ratio.

    python benchmarks/verify_padding.py [--verify-min 5] [--limit 6] [--ks 1,2,3]
"""

from __future__ import annotations

import argparse

from common import write_report

from draftctl.collect.run import measure_costs
from draftctl.controllers import make_controller
from draftctl.decode import DecodeConfig, SpeculativeDecoder, generate
from draftctl.models import DEFAULT_TARGET, default_draft, encode_prompt, load_model
from draftctl.prompts import load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--prompts", default=None, help="JSONL prompts (default: draftctl's set)")
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--ks", default="1,2,3")
    parser.add_argument("--verify-min", type=int, default=5)
    parser.add_argument("--max-n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", default="benchmarks/results/verify_padding.json")
    args = parser.parse_args()

    target = load_model(args.target, "cpu")
    draft = load_model(default_draft(args.target), "cpu", target=target)
    plain = SpeculativeDecoder.from_loaded(
        target, draft, DecodeConfig(max_new_tokens=args.max_new_tokens))
    padded = SpeculativeDecoder.from_loaded(
        target, draft, DecodeConfig(max_new_tokens=args.max_new_tokens,
                                    verify_min=args.verify_min))
    prompts = [encode_prompt(target.tokenizer, p.text)
               for p in load_prompts(args.prompts, "test", args.limit)]
    context = (prompts[0] * (2 + 64 // len(prompts[0])))[:64 + args.max_n]
    curve = measure_costs(plain, context, args.max_n, repeats=7)["t_verify_s"]

    specs = [f"static:{k}" for k in args.ks.split(",")]
    totals = {(s, p): [0, 0.0] for s in ["none", *specs] for p in ("plain", "padded")}
    mismatches = 0
    for i, ids in enumerate(prompts):
        generate(plain, ids, make_controller("static:1"))  # warm-up, untimed
        for spec in ["none", *specs]:
            outputs = []
            order = (("plain", plain), ("padded", padded))
            for name, decoder in order if i % 2 == 0 else order[::-1]:
                result = generate(decoder, ids, make_controller(spec))
                totals[spec, name][0] += result.new_tokens
                totals[spec, name][1] += result.wall_s
                outputs.append(result.output_ids)
            mismatches += outputs[0] != outputs[1]
    rates = {f"{s}|{p}": n / t for (s, p), (n, t) in totals.items()}
    report = {
        "t_verify_ms": [round(1e3 * t, 2) for t in curve],
        "t_verify_ratio_to_1": [round(t / curve[0], 3) for t in curve],
        "verify_min": args.verify_min, "prompts": len(prompts),
        "tokens_per_s": rates,
        "padded_over_plain": {s: rates[f"{s}|padded"] / rates[f"{s}|plain"] for s in specs},
        "speedup_vs_ar": {f"{s}|{p}": rates[f"{s}|{p}"] / rates["none|plain"]
                          for s in specs for p in ("plain", "padded")},
        "mismatches": mismatches,
    }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
