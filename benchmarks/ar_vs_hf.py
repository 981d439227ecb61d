"""Plain autoregressive decoding: draftctl's loop vs transformers' ``generate``, per dtype.

Same model (the built-in target unless --target), same prompts, greedy, one run. For each
dtype: draftctl with unpadded passes (``free``), draftctl at the two bit-exact pass shapes
(the fixed shape the profile chose for that dtype and, where the CPU has them, the exact
shape's row-invariant kernels), and transformers' ``generate``; all are interleaved prompt by
prompt so machine noise hits all alike. Prints and writes JSON with the tokens/s ratios (goal:
draftctl free / generate >= 1.05), what each exact shape costs plain decoding (free / shape),
and whether the outputs are identical. Dtypes the machine lacks are reported as skipped.

    python benchmarks/ar_vs_hf.py [--dtypes float32,bfloat16] [--n-prompts 10]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import write_report

from draftctl.controllers import make_controller
from draftctl.decode import DecodeConfig, SpeculativeDecoder, generate, kernels
from draftctl.decode.cached_lm import PassShape
from draftctl.decode.loop import synchronize
from draftctl.models import (
    DEFAULT_TARGET,
    default_draft,
    encode_prompt,
    load_model,
    resolve_device,
    resolve_dtype,
)
from draftctl.profile import settle
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
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default="benchmarks/results/ar_vs_hf.json")
    args = parser.parse_args()

    profile = settle(args.target, default_draft(args.target), args.device).profile
    prompts = load_prompts(args.prompts, "test", args.n_prompts)
    report = {"target": args.target, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
              "dtypes": {}}
    device = resolve_device(args.device)
    for dtype in args.dtypes.split(","):
        if str(resolve_dtype(dtype, device)).removeprefix("torch.") != dtype:
            report["dtypes"][dtype] = {"skipped": f"{device.type} here has no {dtype} kernels"}
            continue
        target = load_model(args.target, device, dtype)
        eos = sorted(target.eos_token_ids)
        rows = profile["target"]["by_dtype"][dtype]["rows"]
        shapes = {"free": PassShape(), f"fixed:{rows}": PassShape(fixed=rows)}
        if kernels.supported(target.model) is None:
            shapes["exact"] = PassShape(row_invariant=True)
        decoders = {name: SpeculativeDecoder.from_loaded(target, None, DecodeConfig(
            max_new_tokens=args.max_new_tokens, pass_shape=shape))
            for name, shape in shapes.items()}
        encoded = [encode_prompt(target.tokenizer, p.text) for p in prompts]
        for decoder in decoders.values():  # warm-up, untimed
            generate(decoder, encoded[0], make_controller("none"))
        hf_generate(target.model, encoded[0], 8, eos)
        totals = {name: [0, 0.0] for name in [*decoders, "hf"]}
        identical = dict.fromkeys(decoders, 0)
        for i, ids in enumerate(encoded):
            names = [*decoders, "hf"]
            outputs = {}
            for name in names[i % len(names):] + names[:i % len(names)]:
                if name == "hf":
                    tokens, seconds = hf_generate(target.model, ids, args.max_new_tokens, eos)
                else:
                    result = generate(decoders[name], ids, make_controller("none"))
                    tokens, seconds = result.output_ids, result.wall_s
                outputs[name] = tokens
                totals[name][0] += len(tokens)
                totals[name][1] += seconds
            for name in decoders:
                identical[name] += outputs[name] == outputs["hf"]
        rate = {name: n / s for name, (n, s) in totals.items()}
        exact = [name for name in decoders if name != "free"]
        report["dtypes"][dtype] = {
            "tokens_per_s": rate, "draftctl_free_over_hf": rate["free"] / rate["hf"],
            "over_hf": {name: rate[name] / rate["hf"] for name in decoders},
            "shape_cost": {name: rate["free"] / rate[name] for name in exact},
            "identical_to_hf": identical, "prompts": len(encoded)}
        print(f"{dtype}: " + ", ".join(f"{name} {rate[name]:.2f}" for name in rate)
              + f" tok/s; free/hf {rate['free'] / rate['hf']:.3f}; cost of the exact shapes for "
              "plain decoding (free/shape): " + ", ".join(
                  f"{name} {rate['free'] / rate[name]:.2f}x" for name in exact))
    write_report(report, args.out, show=False)


if __name__ == "__main__":
    main()
