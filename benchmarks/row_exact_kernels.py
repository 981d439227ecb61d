"""Can a pass of any size give every token bit-identical logits, without padding the pass?

The fixed pass shape (``fixed:M``) makes greedy SD bit-exact by running every target pass at M
rows, which taxes plain decoding (on an AVX2-only CPU in float32, a one-token step at
``fixed:8`` took about twice the unpadded step). Two kernels make a token's result depend on
the pass's row count: the linear layers' GEMM (MKL picks another kernel by row count) and
attention (another path for one query row). This probe replaces both, on a copy of the target:

- every ``nn.Linear`` runs oneDNN's prepacked linear (``torch.ops.mkldnn``), whose rows do not
  depend on how many rows the product has (and whose weights are packed once, not per call);
- attention pads its queries to whole blocks of ``--query-block`` rows (keys are padded to
  512-key blocks as in ``fixed:M``), then drops the padding.

It checks that feeding 16 tokens after a prompt as 16 one-token passes, one 16-token pass and
passes of 3, 5 and 8 gives bit-identical logits (stock kernels for contrast), and times, in
one interleaved run: the stock unpadded one-token step (not exact), the stock ``fixed:M``
steps, and the probe's passes of n = 1, 2, 4, 8, 16 tokens. CPU only. Prints and writes JSON.

    python benchmarks/row_exact_kernels.py [--dtype float32] [--context 200] [--repeats 9]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from common import write_report
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from draftctl.decode.cached_lm import CachedLM, PassShape
from draftctl.models import DEFAULT_TARGET, load_model

SPLITS = {"1x16": [1] * 16, "16": [16], "3+5+8": [3, 5, 8]}


class PackedLinear(nn.Module):
    """``nn.Linear`` through oneDNN with weights packed once."""

    def __init__(self, linear: nn.Linear, rows_hint: int = 16):
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self.packed,
                                               self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], y.shape[-1])


def packed_copy(model: nn.Module, attention: str) -> nn.Module:
    model = copy.deepcopy(model)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child))
    model.config._attn_implementation = attention
    for module in model.modules():
        if hasattr(module, "config"):
            module.config = model.config
    return model


def query_padded_sdpa(block: int):
    def attention(module, query, key, value, attention_mask, **kwargs):
        n = query.shape[2]
        rows = -(-n // block) * block
        if rows > n:
            query = torch.cat([query, query[:, :, -1:].expand(-1, -1, rows - n, -1)], dim=2)
            if attention_mask is not None:
                attention_mask = torch.cat([attention_mask, attention_mask[:, :, -1:].expand(
                    -1, -1, rows - n, -1)], dim=2)
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask,
                                              **kwargs)
        return out[:, :n], weights
    return attention


def logits_by_split(model: nn.Module, vocab: int, context: torch.Tensor,
                    fresh: torch.Tensor) -> dict[str, torch.Tensor]:
    """Logits of ``fresh`` fed after ``context`` in each split, every pass at its own size with
    padded keys (the masked path of ``fixed:M``, rows unpadded)."""
    out = {}
    for name, sizes in SPLITS.items():
        lm = CachedLM(model, vocab, PassShape(fixed=16))
        lm.prefill(context)
        parts, at = [], 0
        for n in sizes:
            parts.append(lm._pass(fresh[at:at + n], n, None, 0).logits)
            at += n
        out[name] = torch.cat(parts)
    return out


def exactness(results: dict[str, torch.Tensor]) -> dict:
    reference = results["16"]
    return {name: {"equal": torch.equal(reference, got),
                   "max_abs_diff": float((reference - got).abs().max())}
            for name, got in results.items() if name != "16"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--query-block", type=int, default=16)
    parser.add_argument("--fixed", default="4,8", help="stock fixed:M shapes to time")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="benchmarks/results/row_exact_kernels.json")
    args = parser.parse_args()

    name = f"draftctl_query_block_{args.query_block}"
    AttentionInterface.register(name, query_padded_sdpa(args.query_block))
    target = load_model(args.target, "cpu", args.dtype)
    vocab = len(target.tokenizer)
    text = "Speculative decoding drafts tokens cheaply and verifies them in one pass. " * 40
    ids = torch.tensor(target.tokenizer(text)["input_ids"][:args.context + 16])
    context, fresh = ids[:args.context], ids[args.context:]
    probe = packed_copy(target.model, name)

    report = {"target": args.target, "dtype": args.dtype, "context": args.context,
              "query_block": args.query_block, "threads": torch.get_num_threads()}
    with torch.inference_mode():
        report["exact_stock"] = exactness(logits_by_split(target.model, vocab, context, fresh))
        report["exact_probe"] = exactness(logits_by_split(probe, vocab, context, fresh))

        cases, lms = {}, {}
        lms["stock free"] = CachedLM(target.model, vocab, PassShape())
        cases["stock free n=1"] = ("stock free", lambda: lms["stock free"].forward(
            fresh[:1], keep=1))
        for m in (int(v) for v in args.fixed.split(",")):
            key = f"stock fixed:{m}"
            lms[key] = CachedLM(target.model, vocab, PassShape(fixed=m))
            cases[f"{key} n=1"] = (key, lambda key=key: lms[key].forward(fresh[:1], keep=1))
        lms["probe"] = CachedLM(probe, vocab, PassShape(fixed=16))
        for n in (1, 2, 4, 8, 16):
            cases[f"probe n={n}"] = ("probe", lambda n=n: lms["probe"]._pass(
                fresh[:n], n, None, 0))
        for lm in lms.values():
            lm.prefill(context)
        times: dict[str, list[float]] = {k: [] for k in cases}
        for rep in range(args.repeats + 1):  # the first round warms up, untimed
            for key, (lm_key, run) in cases.items():
                start = time.perf_counter()
                run()
                if rep:
                    times[key].append(time.perf_counter() - start)
                lms[lm_key].truncate(args.context)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    report["ms"] = ms
    report["probe_step_over_stock_free_step"] = ms["probe n=1"] / ms["stock free n=1"]
    for m in args.fixed.split(","):
        report[f"probe_step_over_stock_fixed_{m}_step"] = ms["probe n=1"] / ms[
            f"stock fixed:{m} n=1"]
    report["probe_curve_over_its_step"] = {n: ms[f"probe n={n}"] / ms["probe n=1"]
                                           for n in (1, 2, 4, 8, 16)}
    write_report(report, args.out)


if __name__ == "__main__":
    main()
