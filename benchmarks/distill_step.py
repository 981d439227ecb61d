"""A distill recipe's training step with and without length windows, timed in one run.

Training draws ``batch_sequences`` sequences per step and pads them to the longest; with
prompts of very different lengths (the prose pool: 54 to 1,152 tokens) most of a batch is
padding. ``length_window`` draws each batch from sequences of neighbouring length instead.
This script loads a distill run's data folder (its teacher labels and, for feature drafts, the
target's states) and config, builds the draft as training does, and times loss and backward
of batches drawn with each window, alternating from step to step so that machine noise hits
both alike. It reports seconds per step, padded and real tokens per batch and labelled
positions per batch, each window's step time over window 0's, and the padded tokens per real
token over 10,000 batches drawn without running them (a few timed steps draw few of the long
sequences).

    python benchmarks/distill_step.py --run runs/distill-pool-v8 --windows 0,32 --steps 20
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
from common import write_report

from draftctl.config import load_config
from draftctl.distill.run import DistillConfig, batch_picker, make_trainee, target_dtype
from draftctl.models import load_model

DRAWS = 10_000  # batches drawn (not run) per window for the expected padding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="a distill output folder (its data)")
    parser.add_argument("--windows", default="0,32", help="length windows, comma-separated")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per window")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/distill_step.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    run = Path(args.run)
    cfg = load_config(DistillConfig, run / "distill.yaml")
    data = Path(cfg.data_dir) if cfg.data_dir else run / "data"
    target = load_model(cfg.target, cfg.device, target_dtype(cfg.target, cfg.device, cfg.dtype))
    teacher = torch.load(data / "teacher.pt")
    trainee = make_trainee(cfg, target, teacher, [], data / "teacher")
    trainee.draft.train()
    lengths = [len(sequence[0]) for sequence in teacher["sequences"]]
    windows = [int(w) for w in args.windows.split(",")]
    random.seed(cfg.seed)
    pickers = {w: batch_picker(lengths, cfg.batch_sequences, w) for w in windows}
    runs: dict[int, list[dict]] = {w: [] for w in windows}
    for step in range(args.steps + 1):  # step 0 warms up, untimed
        for w in windows[step % len(windows):] + windows[:step % len(windows)]:
            batch = pickers[w]()
            started = time.perf_counter()
            with torch.autocast(device_type=torch.device(cfg.device).type, dtype=torch.bfloat16,
                                enabled=cfg.train_dtype == "bfloat16"):
                loss, labelled = trainee.batch_loss(batch)
            loss.backward()
            seconds = time.perf_counter() - started
            trainee.draft.zero_grad(set_to_none=True)
            if step:
                runs[w].append({"s": seconds, "labelled": labelled,
                                "padded": len(batch) * max(lengths[i] for i in batch),
                                "real": sum(lengths[i] for i in batch)})
    drawn = {w: [pickers[w]() for _ in range(DRAWS)] for w in windows}
    base = statistics.mean(r["s"] for r in runs[windows[0]])
    report = {"run": str(run), "kind": cfg.kind, "batch_sequences": cfg.batch_sequences,
              "train_dtype": cfg.train_dtype, "threads": args.threads, "steps": args.steps,
              "sequences": len(lengths), "windows": {}}
    for w, timed in runs.items():
        mean = statistics.mean(r["s"] for r in timed)
        report["windows"][str(w)] = {
            "s_per_step": round(mean, 3),
            "s_per_step_median": round(statistics.median(r["s"] for r in timed), 3),
            "padded_tokens_per_batch": round(statistics.mean(r["padded"] for r in timed)),
            "real_tokens_per_batch": round(statistics.mean(r["real"] for r in timed)),
            "labelled_per_batch": round(statistics.mean(r["labelled"] for r in timed)),
            "ms_per_real_token": round(1000 * mean / statistics.mean(r["real"] for r in timed), 3),
            "expected_padded_per_real": round(
                sum(len(b) * max(lengths[i] for i in b) for b in drawn[w])
                / sum(lengths[i] for b in drawn[w] for i in b), 3),
            "step_time_vs_first": round(mean / base, 3)}
    write_report(report, args.out)


if __name__ == "__main__":
    main()
