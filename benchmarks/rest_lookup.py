"""REST lookup time per round on a large datastore.

Builds (once, in --work) a datastore of --tokens tokens from a source datastore's tokens
(default: the stdlib datastore), tiled and with --noise of the tokens replaced at random so the
copies differ, then times ``Retriever.lookup`` on contexts cut from the source text (the case
REST is for: the context occurs in the datastore) and on random contexts (it does not). Prints
and writes JSON with the median and 90th-percentile milliseconds per lookup (goal: <= 1 ms for
a 50M-token datastore).

    python benchmarks/rest_lookup.py --source runs/rest-stdlib [--tokens 50000000]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from common import write_report

from draftctl.retrieval.datastore import SEPARATOR, Datastore, write_datastore
from draftctl.retrieval.retriever import Retriever


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", required=True, help="a datastore folder to draw text from")
    parser.add_argument("--tokens", type=int, default=50_000_000)
    parser.add_argument("--noise", type=float, default=0.05)
    parser.add_argument("--lookups", type=int, default=500)
    parser.add_argument("--work", default="runs/rest-lookup-bench")
    parser.add_argument("--out", default="benchmarks/results/rest_lookup.json")
    args = parser.parse_args()

    source = Datastore(args.source)
    text = np.asarray(source.tokens, dtype=np.uint32)
    work = Path(args.work)
    built = work / "manifest.json"
    if not built.is_file() or json.loads(built.read_text())["tokens"] != args.tokens:
        rng = np.random.default_rng(0)
        tokens = np.resize(text, args.tokens)
        swap = rng.random(args.tokens) < args.noise
        tokens[swap] = rng.choice(text[text != SEPARATOR], size=int(swap.sum()))
        start = time.perf_counter()
        write_datastore(tokens, work, {key: source.manifest[key]
                                       for key in ("tokenizer", "tokenizer_sha256")}, True)
        print(f"built {args.tokens:,} tokens in {time.perf_counter() - start:.1f} s")
    retriever = Retriever(Datastore(work))
    rng = np.random.default_rng(1)
    results = {}
    for kind in ("from_text", "random"):
        times, found = [], 0
        for _ in range(args.lookups):
            if kind == "from_text":
                at = int(rng.integers(16, len(text) - 1))
                context = text[at - 16:at].astype(np.int64).tolist()
            else:
                context = rng.integers(0, 49152, size=16).tolist()
            trie = retriever.lookup(context)
            times.append(trie.lookup_s)
            found += len(trie) > 0
        ms = np.array(times) * 1e3
        results[kind] = {"median_ms": float(np.median(ms)), "p90_ms": float(np.quantile(ms, 0.9)),
                         "mean_ms": float(ms.mean()), "found_share": found / args.lookups}
    report = {"datastore_tokens": args.tokens, "lookups": args.lookups, **results, "goal_ms": 1.0}
    write_report(report, args.out)


if __name__ == "__main__":
    main()
