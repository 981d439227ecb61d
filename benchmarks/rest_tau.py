"""Mean accepted tokens per round (tau) of greedy REST, for several retrieval settings at once.

Greedy SD is lossless, so a REST round at output position ``t`` accepts the longest trie path
that spells the target's own greedy continuation there. The script decodes each prompt once
with plain greedy decoding, then walks that output round by round for every drafter spec:
look up the context, accept the longest matching path (depth capped like ``static:K``),
advance by that plus the bonus token. Only lookups run per setting, so many settings cost
one decoding. The walk is what the decoder does with a ``RetrievalDrafter``; the script checks that on the
first prompt against a real run of the first spec.

    python benchmarks/rest_tau.py --prompts benchmarks/prompts/code.jsonl \
        --drafters rest:runs/rest-stdlib rest:runs/rest-stdlib,max_nodes=128
"""

from __future__ import annotations

import argparse
import statistics

from common import write_report
from tqdm import tqdm

from draftctl.controllers import make_controller
from draftctl.decode import DecodeConfig, SpeculativeDecoder, generate
from draftctl.decode.tree import accepted_path
from draftctl.drafters.retrieval import RetrievalDrafter
from draftctl.models import DEFAULT_TARGET, encode_prompt, load_model
from draftctl.prompts import load_prompts
from draftctl.retrieval import make_retriever


def walk(retriever, prompt_ids: list[int], output: list[int], depth: int,
         max_new_tokens: int) -> tuple[int, list[float]]:
    """(rounds, lookup seconds per round) of greedy REST along the target's ``output``."""
    t, rounds, lookup_s = 0, 0, []
    while t < len(output):
        budget = min(depth, max_new_tokens - t - 1)
        trie = retriever.lookup(prompt_ids + output[:t], max_depth=budget) if budget > 0 \
            else None
        accepted = 0
        if trie is not None:
            lookup_s.append(trie.lookup_s)
            truth = output[t:]
            # The target's argmax after the root and after each node: its own continuation.
            argmax = [truth[0]] + [truth[d] if d < len(truth) else -1 for d in trie.depths]
            accepted = len(accepted_path(trie.tokens, trie.parents, argmax))
        t += accepted + 1
        rounds += 1
    return rounds, lookup_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--split", default="all")
    parser.add_argument("--limit", type=int)
    parser.add_argument("--per-category", type=int)
    parser.add_argument("--drafters", nargs="+", required=True, help="rest:DIR[,key=value] specs")
    parser.add_argument("--depth", type=int, default=10, help="static:K depth cap")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="benchmarks/results/rest_tau.json")
    args = parser.parse_args()

    target = load_model(args.target, args.device)
    prompts = load_prompts(args.prompts, args.split, args.limit, args.per_category)
    plain = SpeculativeDecoder.from_loaded(target, None,
                                           DecodeConfig(max_new_tokens=args.max_new_tokens))
    encoded = [encode_prompt(target.tokenizer, p.text) for p in prompts]
    outputs = [generate(plain, ids, make_controller("none")).output_ids
               for ids in tqdm(encoded, desc="greedy outputs", unit="prompt")]
    retrievers = {spec: make_retriever(spec, target.tokenizer) for spec in args.drafters}

    # The walk against a real REST run of the first spec on the first prompt.
    first = args.drafters[0]
    rest = SpeculativeDecoder.from_loaded(target, RetrievalDrafter(retrievers[first]),
                                          plain.config)
    real = generate(rest, encoded[0],
                    make_controller(f"static:{args.depth}"))
    walked, _ = walk(retrievers[first], encoded[0], outputs[0], args.depth, args.max_new_tokens)
    if real.output_ids != outputs[0] or len(real.rounds) != walked:
        raise SystemExit(f"walk disagrees with the decoder: {walked} rounds vs "
                         f"{len(real.rounds)} real")

    results = []
    for spec, retriever in retrievers.items():
        rounds, lookups = 0, []
        for ids, output in zip(encoded, outputs):
            r, s = walk(retriever, ids, output, args.depth, args.max_new_tokens)
            rounds += r
            lookups += s
        tokens = sum(map(len, outputs))
        results.append({"drafter": spec, "tau": tokens / rounds, "rounds": rounds,
                        "tokens": tokens, "lookup_ms_median": 1e3 * statistics.median(lookups),
                        "config": vars(retriever.config)})
        print(f"{spec}: tau {tokens / rounds:.3f} over {rounds} rounds")
    write_report({"target": args.target, "prompts": args.prompts, "split": args.split,
                  "n_prompts": len(prompts), "depth": args.depth,
                  "max_new_tokens": args.max_new_tokens, "checked_against_decoder": first,
                  "results": results}, args.out)


if __name__ == "__main__":
    main()
