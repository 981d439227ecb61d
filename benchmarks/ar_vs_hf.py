"""Plain autoregressive decoding: draftctl's loop vs transformers' ``generate``.

Same model (the built-in target unless --target), same 10 prompts, greedy, same machine, one
run; the two are interleaved prompt by prompt so machine noise hits both alike. Prints and
writes JSON with the tokens/s ratio (goal: >= 1.0) and checks that both produce the same tokens.

    python benchmarks/ar_vs_hf.py [--target SPEC] [--prompts PATH] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import write_report

from draftctl.controllers import make_controller
from draftctl.decode import DecodeConfig, SpeculativeDecoder, generate
from draftctl.decode.loop import synchronize
from draftctl.models import DEFAULT_TARGET, encode_prompt, load_model
from draftctl.prompts import load_prompts


def hf_generate(model, ids: list[int], max_new_tokens: int, eos: list[int]) -> tuple[list[int], float]:
    inputs = torch.tensor([ids], device=model.device)
    synchronize(model.device)
    start = time.perf_counter()
    out = model.generate(inputs, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos[0])
    synchronize(model.device)
    return out[0, len(ids):].tolist(), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--prompts", default=None, help="JSONL prompts (default: draftctl's set)")
    parser.add_argument("--n-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default="benchmarks/results/ar_vs_hf.json")
    args = parser.parse_args()

    target = load_model(args.target, args.device)
    eos = sorted(target.eos_token_ids)
    decoder = SpeculativeDecoder.from_loaded(target, None,
                                             DecodeConfig(max_new_tokens=args.max_new_tokens))
    prompts = load_prompts(args.prompts, "test", args.n_prompts)
    encoded = [encode_prompt(target.tokenizer, p.text) for p in prompts]
    generate(decoder, encoded[0], make_controller("none"))  # warm-up, both paths
    hf_generate(target.model, encoded[0], 8, eos)

    rows = []
    for prompt, ids in zip(prompts, encoded):
        ours = generate(decoder, ids, make_controller("none"))
        hf_tokens, hf_s = hf_generate(target.model, ids, args.max_new_tokens, eos)
        rows.append({"question_id": prompt.question_id, "new_tokens": ours.new_tokens,
                     "draftctl_s": ours.wall_s, "hf_tokens": len(hf_tokens), "hf_s": hf_s,
                     "identical": ours.output_ids == hf_tokens})
        print(f"q{prompt.question_id:>4}: draftctl {ours.tokens_per_s:6.2f} tok/s, "
              f"hf {len(hf_tokens) / hf_s:6.2f} tok/s, identical={rows[-1]['identical']}")

    ours_tps = sum(r["new_tokens"] for r in rows) / sum(r["draftctl_s"] for r in rows)
    hf_tps = sum(r["hf_tokens"] for r in rows) / sum(r["hf_s"] for r in rows)
    report = {"target": args.target, "device": str(target.device), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
              "draftctl_tokens_per_s": ours_tps, "hf_tokens_per_s": hf_tps,
              "ratio": ours_tps / hf_tps, "all_identical": all(r["identical"] for r in rows),
              "prompts": rows}
    write_report(report, args.out, show=False)
    print(f"draftctl {ours_tps:.2f} tok/s, hf generate {hf_tps:.2f} tok/s, "
          f"ratio {report['ratio']:.3f} (goal >= 1.0), identical: {report['all_identical']}")


if __name__ == "__main__":
    main()
