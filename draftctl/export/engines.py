"""``draftctl export --format hf-confidence|llamacpp-pmin``: a threshold model on the draft's
top-1 probability, as the one number an inference engine takes.

- transformers (assisted generation) stops drafting after a token whose draft probability is
  below ``assistant_confidence_threshold``; that token is still verified. This is exactly
  draftctl's rule for a ``top_prob_1`` threshold model, so the value carries over as is.
- llama.cpp drops the first draft token whose top-1 probability is below ``--draft-p-min``;
  that token is never verified. Same feature, other action: the value is re-chosen for the
  dropping rule on the dev traces (replay by modelled speedup, as ``train`` chose its own),
  or, without the traces, the model's own threshold is passed on with a warning.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from draftctl.errors import DraftctlError
from draftctl.train.fit import ThresholdModel

FORMATS = ("hf-confidence", "llamacpp-pmin")


def export_engine(model_dir: str | Path, fmt: str) -> dict:
    """The engine setting for ``fmt`` with what is lost in translation."""
    from draftctl.train.run import load_model_dir

    if fmt not in FORMATS:
        raise DraftctlError(f"unknown export format {fmt!r}: use onnx, {', '.join(FORMATS)}")
    model, manifest = load_model_dir(model_dir)
    if not (isinstance(model, ThresholdModel) and model.rule == "top_prob_1"):
        rule = model.rule if isinstance(model, ThresholdModel) else manifest["kind"]
        raise DraftctlError(
            f"{model_dir} holds a {rule!r} model; --format {fmt} needs a threshold on the "
            "draft's top-1 probability: train one with --kind threshold --rule top_prob_1 "
            "--stop token")
    if manifest.get("stop", "token") != "token":
        raise DraftctlError(
            f"{model_dir} stops on the product of a round's scores ({manifest['stop']!r} rule); "
            f"--format {fmt} takes one per-token threshold: train with --stop token")
    threshold = float(manifest["threshold"])
    lost = [("draftctl's cap on draft length (the trace's k_probe) is the engine's own "
             "setting (num_assistant_tokens / --draft-max)")]
    if fmt == "hf-confidence":
        return {"format": fmt, "value": threshold,
                "usage": f"model.generate(..., assistant_model=draft, "
                         f"assistant_confidence_threshold={threshold:.4f}, "
                         "num_assistant_tokens_schedule='constant')",
                "note": ["same rule: stop after the token below the threshold, verify it",
                         ("transformers checks the probability of the drafted token, which "
                          "under greedy drafting is the top-1 probability; under sampled "
                          "drafting it is lower, so drafts end earlier"), *lost]}
    value, how = _pmin_value(model, manifest, threshold)
    return {"format": fmt, "value": value, "usage": f"llama-server ... --draft-p-min {value:.4f}",
            "note": [how, ("llama.cpp never verifies the token below p-min, so a round that "
                           "stops verifies one token fewer than under draftctl's rule"), *lost]}


def _pmin_value(model: ThresholdModel, manifest: dict, threshold: float) -> tuple[float, str]:
    from draftctl.prompts import split_of
    from draftctl.train.replay import TraceSet, replay
    from draftctl.train.run import best_by_speedup, learned_controller

    traces = Path(manifest["traces"])
    if not (traces / "run.json").is_file():
        return threshold, (f"WARNING: traces {traces} not found, so p-min was not re-chosen "
                           "for llama.cpp's dropping rule; the model's threshold is passed on")
    trace_set = TraceSet(traces)
    dev = {pid for pid in trace_set.groups if split_of(int(pid)) == "dev"}
    grid = {f"pmin:{t:.2f}": f"pmin:{t:.2f}" for t in np.arange(0.0, 0.96, 0.05)}
    best, result = best_by_speedup(trace_set, grid, dev)
    own = learned_controller(model, tuple(manifest["features"]), threshold, "threshold")
    ours = replay(trace_set, [own], dev)[0]
    return float(best.split(":")[1]), (
        f"p-min re-chosen on the dev traces for the dropping rule: modelled speedup "
        f"{result['modelled_speedup']:.3f}, vs {ours['modelled_speedup']:.3f} for the model's "
        "own rule (verify the token below the threshold)")


def write_engine(result: dict, out: str | Path) -> None:
    Path(out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
