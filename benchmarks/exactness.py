"""Bit-exactness of greedy speculative decoding: every controller's output against plain
decoding, token for token, in float32 and bfloat16.

For each dtype the target runs at each bit-exact pass shape: the fixed shape the calibrated
profile chose for that dtype (``by_dtype[...]["rows"]``) and, where the CPU has its kernels,
the exact shape (row-invariant kernels); every prompt is decoded plainly and by every
controller, and any output that differs counts as a mismatch (goal: 0). The same is then done
with unpadded passes (``--free-prompts`` prompts, pass shape ``free``), to show what the exact
shapes buy.
No timing: only outputs are compared. Prints and writes JSON.

    python benchmarks/exactness.py [--prompts PATH] [--limit 54] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import write_report
from tqdm import tqdm

from draftctl.controllers import expand_specs, make_controller
from draftctl.controllers.rules import ReferenceOracle
from draftctl.decode import DecodeConfig, SpeculativeDecoder, generate, kernels
from draftctl.decode.cached_lm import PassShape
from draftctl.models import DEFAULT_TARGET, default_draft, encode_prompt, load_model
from draftctl.profile import candidate_dtypes, settle
from draftctl.prompts import load_prompts

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
CONTROLLERS = "static:1-4,static:6,static:8,heuristic,confidence,confidence-roc,pmin,svip,adaedl,oracle"


def mismatches(decoder: SpeculativeDecoder, encoded: list[list[int]], specs: list[str],
               desc: str) -> dict[str, int]:
    counts = dict.fromkeys(specs, 0)
    for ids in tqdm(encoded, desc=desc, unit="prompt"):
        reference = generate(decoder, ids, make_controller("none")).output_ids
        for spec in specs:
            controller = make_controller(spec)
            if isinstance(controller, ReferenceOracle):
                controller.set_reference(reference)
            counts[spec] += generate(decoder, ids, controller).output_ids != reference
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--prompts", default=str(SPEC_BENCH))
    parser.add_argument("--split", default="all")
    parser.add_argument("--per-category", type=int, default=9)
    parser.add_argument("--controllers", default=CONTROLLERS)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="dtypes this CPU does not compute natively are reported as skipped")
    parser.add_argument("--shapes", default="fixed,exact",
                        help="bit-exact shapes to check on every prompt (exact: where supported)")
    parser.add_argument("--free-prompts", type=int, default=12,
                        help="prompts decoded with unpadded passes too (0: skip)")
    parser.add_argument("--out", default="benchmarks/results/exactness.json")
    args = parser.parse_args()

    draft_spec = args.draft or default_draft(args.target)
    specs = expand_specs([args.controllers])
    prompts = load_prompts(args.prompts, args.split, per_category=args.per_category)
    profile = settle(args.target, draft_spec, "cpu").profile
    report = {"target": args.target, "draft": draft_spec, "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "controllers": specs,
              "threads": torch.get_num_threads(), "runs": {}}
    native = candidate_dtypes(torch.device("cpu"))
    for dtype in args.dtypes.split(","):
        if dtype not in native:
            report.setdefault("skipped", {})[dtype] = "this CPU has no native kernels for it"
            continue
        target = load_model(args.target, "cpu", dtype)
        draft = load_model(draft_spec, "cpu", dtype, target=target)
        encoded = [encode_prompt(target.tokenizer, p.text) for p in prompts]
        rows = profile["target"]["by_dtype"][dtype]["rows"]
        runs = []
        if "fixed" in args.shapes.split(","):
            runs.append((PassShape(fixed=rows), encoded))
        if "exact" in args.shapes.split(","):
            reason = kernels.supported(target.model)
            if reason:
                report.setdefault("skipped", {})[f"{dtype} exact"] = reason
            else:
                runs.append((PassShape(row_invariant=True), encoded))
        for shape, subset in (*runs, (PassShape(), encoded[:args.free_prompts])):
            if not subset:
                continue
            config = DecodeConfig(max_new_tokens=args.max_new_tokens, pass_shape=shape)
            decoder = SpeculativeDecoder.from_loaded(target, draft, config)
            counts = mismatches(decoder, subset, specs, f"{dtype} {shape.describe()}")
            report["runs"][f"{dtype} {shape.describe()}"] = {
                "dtype": dtype, "pass_shape": shape.describe(), "prompts": len(subset),
                "runs": len(subset) * len(specs), "mismatches": sum(counts.values()),
                "by_controller": counts}
    write_report(report, args.out)
    for dtype, why in report.get("skipped", {}).items():
        print(f"{dtype:<20} skipped: {why}")
    for name, run in report["runs"].items():
        print(f"{name:<20} {run['mismatches']:>4} mismatches in {run['runs']} runs "
              f"({run['prompts']} prompts x {len(specs)} controllers)")


if __name__ == "__main__":
    main()
