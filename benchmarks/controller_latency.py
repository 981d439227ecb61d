"""Time per controller call (``decide`` on one feature record), in microseconds.

    python benchmarks/controller_latency.py --onnx runs/demo/logreg.onnx runs/demo/mlp.onnx

Built-in rules are always timed; each ``--onnx`` file is loaded as ``onnx:PATH`` (onnxruntime,
one thread). Calls cycle over 1,000 varied records; the median of 20 batches is reported.
Goal: an ONNX controller call <= 20 us on the project's CPU. Prints and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from common import write_report

from draftctl.controllers import make_controller
from draftctl.decode.features import TOP_K, FeatureRecord


def records(n: int, seed: int = 0) -> list[FeatureRecord]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        probs = np.sort(rng.dirichlet(np.full(TOP_K, 0.3)))[::-1] * rng.uniform(0.5, 1)
        out.append(FeatureRecord(
            draft_pos=int(rng.integers(1, 17)), seq_pos=int(rng.integers(10, 600)),
            entropy=float(rng.uniform(0, 6)), top_probs=tuple(float(p) for p in probs),
            cum_top1=float(probs[0] ** rng.integers(1, 5)), prev_accepted=int(rng.integers(0, 8)),
            prev_drafted=int(rng.integers(0, 8)), accept_rate=float(rng.uniform(0, 1))))
    return out


def time_per_call_us(controller, batch: list[FeatureRecord], batches: int = 20) -> float:
    for record in batch[:50]:
        controller.decide(record)
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        for record in batch:
            controller.decide(record)
        times.append((time.perf_counter() - start) / len(batch) * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--onnx", nargs="*", default=[], help="exported controllers")
    parser.add_argument("--out", default="benchmarks/results/controller_latency.json")
    args = parser.parse_args()
    batch = records(1000)
    specs = ["confidence", "pmin", "svip", "adaedl", *(f"onnx:{p}" for p in args.onnx)]
    results = {spec: time_per_call_us(make_controller(spec), batch) for spec in specs}
    for spec, us in results.items():
        print(f"{spec:<50} {us:8.2f} us/call")
    write_report({"us_per_call": results, "calls_per_batch": len(batch)}, args.out, show=False)


if __name__ == "__main__":
    main()
