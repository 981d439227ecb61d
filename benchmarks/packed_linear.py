"""The target's pass cost over n new tokens: stock linear kernels vs the packed view.

``draftctl.decode.kernels.packed_view`` runs every pass through oneDNN with packed weights.
This times the built-in target (unless --target) through transformers' own forward with a
``DynamicCache``, as ``generate()`` runs it, for n = 1..16 new tokens after a
--context-token prompt, stock and packed interleaved pass by pass (the fastest of --repeats
each). Prints and writes JSON with the ms per pass, the packed / stock ratio per n, the
prompt's prefill both ways, and the largest logit difference between the two (the view is
for speed, not exactness). Dtypes the CPU lacks are reported as skipped.

    python benchmarks/packed_linear.py [--dtypes float32,bfloat16] [--repeats 7]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import write_report
from transformers import DynamicCache

from draftctl.decode import kernels
from draftctl.models import DEFAULT_TARGET, bfloat16_supported, load_model

SIZES = (1, 2, 3, 4, 6, 8, 12, 16)


def pass_ms(model, cache: DynamicCache, tokens: torch.Tensor, context: int) -> float:
    """One timed pass of ``tokens`` after the first ``context`` cached positions."""
    if cache.get_seq_length() > context:
        cache.crop(context - cache.get_seq_length())
    start = time.perf_counter()
    model(tokens, past_key_values=cache, use_cache=True)
    return (time.perf_counter() - start) * 1000


def measure(target, dtype: str, context: int, repeats: int, seed: int) -> dict:
    stock = target.model
    packed = kernels.packed_view(stock)
    g = torch.Generator().manual_seed(seed)
    vocab = stock.config.vocab_size
    prompt = torch.randint(vocab, (1, context), generator=g)
    models = {"stock": stock, "packed": packed}
    with torch.no_grad():
        caches, prefill = {}, {"stock": float("inf"), "packed": float("inf")}
        for _ in range(2):
            for name, model in models.items():
                caches[name] = DynamicCache(config=model.config)
                start = time.perf_counter()
                model(prompt, past_key_values=caches[name], use_cache=True)
                prefill[name] = min(prefill[name], (time.perf_counter() - start) * 1000)
        rows, worst = [], 0.0
        for n in SIZES:
            tokens = torch.randint(vocab, (1, n), generator=g)
            for name, model in models.items():  # warm-up: each kernel's first call at n
                pass_ms(model, caches[name], tokens, context)
            best = {"stock": float("inf"), "packed": float("inf")}
            for r in range(repeats):
                for name in (("stock", "packed") if r % 2 == 0 else ("packed", "stock")):
                    best[name] = min(best[name], pass_ms(models[name], caches[name], tokens,
                                                         context))
            logits = {}
            for name, model in models.items():
                caches[name].crop(context - caches[name].get_seq_length())
                logits[name] = model(tokens, past_key_values=caches[name],
                                     use_cache=True).logits.float()
            worst = max(worst, (logits["stock"] - logits["packed"]).abs().max().item())
            rows.append({"n": n, "stock_ms": round(best["stock"], 2),
                         "packed_ms": round(best["packed"], 2),
                         "packed_over_stock": round(best["packed"] / best["stock"], 3)})
            print(f"{dtype:>9} n={n:>2}  stock {best['stock']:7.1f} ms  packed "
                  f"{best['packed']:7.1f} ms  ratio {best['packed'] / best['stock']:.3f}")
    return {"passes": rows,
            "prefill_ms": {k: round(v, 1) for k, v in prefill.items()},
            "prefill_packed_over_stock": round(prefill["packed"] / prefill["stock"], 3),
            "max_abs_logit_diff": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/packed_linear.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    report = {"target": args.target, "context": args.context, "repeats": args.repeats,
              "threads": torch.get_num_threads(), "dtypes": {}}
    for dtype in args.dtypes.split(","):
        if dtype == "bfloat16" and not bfloat16_supported(cpu):
            report["dtypes"][dtype] = {"skipped": "this CPU has no bfloat16 kernels"}
            continue
        target = load_model(args.target, cpu, dtype)
        reason = kernels.packable(target.model)
        if reason:
            report["dtypes"][dtype] = {"skipped": reason}
            continue
        report["dtypes"][dtype] = measure(target, dtype, args.context, args.repeats, args.seed)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
