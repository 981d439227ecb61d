"""Controllers driven by a scoring model: stop drafting once the scores fall below a threshold.

The score is the model's predicted probability that the token is accepted given that it was
reached (DISCO-style); the threshold is chosen by modelled speedup, not accuracy. Three stop
rules read it: ``token`` (DISCO) stops after a token whose own score is below the threshold;
``path`` (SpecDec++) stops once the product of the round's scores so far, the modelled chance
that every token drafted this round is accepted, is below it; ``cost`` compares that product
with the threshold times what one more draft would cost at this length (a draft step plus the
longer verification, from the calibrated cost curve), so it drafts on where the curve is flat
and stops early where a step of it is steep.
``onnx:PATH`` loads an exported model with onnxruntime (one thread, warm-up call) and checks
its feature schema against the decoder's before any decoding.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from draftctl.console import notice
from draftctl.controllers.base import Action, Controller
from draftctl.decode.features import FEATURE_NAMES, SCHEMA_VERSION, SchemaMismatchError
from draftctl.errors import DraftctlError

if TYPE_CHECKING:  # the decoder imports controllers; annotations only
    from draftctl.decode.features import FeatureRecord


# each stop rule, as the manifest of a model trained with it describes it
STOP_RULES = {
    "token": "stop after a token whose predicted acceptance < threshold",
    "path": "stop after the token at which the product of the round's predicted acceptances "
            "< threshold",
    "cost": "stop after the token at which the product of the round's predicted acceptances "
            "< threshold x step_costs[token's draft position], the cost of drafting one more "
            "token there (draft step + longer verification) in plain decoding steps",
}


class ScoreThreshold(Controller):
    """Stop after the token at which the ``stop`` rule's value is below its bound (that token
    is verified): its own score (``token``) or the product of the scores from the round's
    first token to it (``path``) against ``threshold``; that product against ``threshold *
    step_costs[draft_pos - 1]`` (``cost``; past the list's end, its last entry).

    score: maps a (1, n_features) float32 array to the acceptance probability.
    features: names of the model's inputs, in its input order (a subset of FEATURE_NAMES).
    step_costs: for the cost rule, the cost of drafting token ``k + 1`` after ``k`` (a draft
    step plus ``t_verify(k + 2) - t_verify(k + 1)``) over a plain decoding step, k = 1, 2, ...
    The path and cost rules find a token's predecessors by ``draft_pos``, so they need each
    token asked after its predecessors and before any other branch (a chain, or a tree walked
    depth first).
    pass_shape: the pass shape the threshold (and step costs) were chosen at, where known.
    """

    def __init__(self, score: Callable[[np.ndarray], float], features: Sequence[str],
                 threshold: float, n_max: int = 40, stop: str = "token",
                 step_costs: Sequence[float] = (), pass_shape: str | None = None):
        check_features(features)
        if stop not in STOP_RULES:
            raise DraftctlError(f"unknown stop rule {stop!r}: use {', '.join(STOP_RULES)}")
        if stop == "cost" and not step_costs:
            raise DraftctlError("the cost stop rule needs the step costs of the cost curve it "
                                "was chosen on")
        self.step_costs = tuple(float(c) for c in step_costs)
        self.score = score
        self.features = tuple(features)
        self.index = [FEATURE_NAMES.index(f) for f in features]
        self.threshold = threshold
        self.n_max = n_max
        self.stop = stop
        self.pass_shape = pass_shape
        self.path: list[float] = []  # products of scores along the current branch, by depth

    def reset(self) -> None:
        self.path.clear()

    def max_draft(self) -> int:
        return self.n_max

    def decide(self, record: FeatureRecord) -> Action:
        vector = record.to_vector()
        x = np.array([[vector[i] for i in self.index]], dtype=np.float32)
        value = self.score(x)
        bound = self.threshold
        if self.stop != "token":
            del self.path[record.draft_pos - 1:]
            value *= self.path[-1] if self.path else 1.0
            self.path.append(value)
        if self.stop == "cost":
            bound *= self.step_costs[min(record.draft_pos, len(self.step_costs)) - 1]
        return Action.STOP if value < bound else Action.CONTINUE


def check_features(features: Sequence[str], schema_version: int = SCHEMA_VERSION) -> None:
    """Refuse a model whose inputs the current feature record cannot provide."""
    if schema_version != SCHEMA_VERSION:
        raise SchemaMismatchError(f"model was trained on feature schema v{schema_version}; "
                                  f"this draftctl records v{SCHEMA_VERSION}")
    missing = [f for f in features if f not in FEATURE_NAMES]
    if missing:
        raise SchemaMismatchError(f"model needs feature(s) {', '.join(missing)} that the "
                                  f"feature record (v{SCHEMA_VERSION}) does not have; it has "
                                  f"{', '.join(FEATURE_NAMES)}")


def onnx_controller(path: str, threshold: float | None = None) -> ScoreThreshold:
    """``onnx:PATH``: a ScoreThreshold whose score runs in onnxruntime."""
    import onnxruntime as ort
    from onnxruntime.capi.onnxruntime_pybind11_state import (
        Fail,
        InvalidArgument,
        InvalidGraph,
        InvalidProtobuf,
    )

    if not Path(path).is_file():
        raise DraftctlError(f"ONNX controller file not found: {path}")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    try:
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    except (Fail, InvalidArgument, InvalidGraph, InvalidProtobuf) as err:
        raise DraftctlError(f"cannot load ONNX controller {path}: {err}") from None
    meta = session.get_modelmeta().custom_metadata_map
    for key in ("draftctl_features", "draftctl_schema_version", "draftctl_threshold",
                "draftctl_output"):
        if key not in meta:
            raise SchemaMismatchError(f"{path} has no {key} metadata: not a draftctl controller")
    stop = meta.get("draftctl_stop_rule", "token")  # files written before the path rule
    if stop not in STOP_RULES:
        raise DraftctlError(f"{path} asks for stop rule {stop!r}, which this draftctl does not "
                            f"know ({', '.join(STOP_RULES)}): upgrade draftctl")
    step_costs = json.loads(meta.get("draftctl_step_costs", "[]"))
    if stop == "cost" and not step_costs:
        raise SchemaMismatchError(f"{path} uses the cost stop rule but has no "
                                  "draftctl_step_costs metadata: export it again")
    features = json.loads(meta["draftctl_features"])
    check_features(features, int(meta["draftctl_schema_version"]))
    n_inputs = session.get_inputs()[0].shape[-1]
    if isinstance(n_inputs, int) and n_inputs != len(features):
        raise SchemaMismatchError(f"{path} takes {n_inputs} inputs but names "
                                  f"{len(features)} features")
    input_name = session.get_inputs()[0].name
    output_name = meta["draftctl_output"]
    column = int(meta.get("draftctl_output_column", "-1"))

    def score(x: np.ndarray) -> float:
        out = session.run([output_name], {input_name: x})[0]
        return float(out[0, column] if out.ndim == 2 else out[0])

    score(np.zeros((1, len(features)), dtype=np.float32))  # warm-up
    chosen = float(meta["draftctl_threshold"]) if threshold is None else threshold
    return ScoreThreshold(score, features, chosen, stop=stop, step_costs=step_costs,
                          pass_shape=meta.get("draftctl_pass_shape"))


def pass_shape_notice(spec: str, controller: Controller, shape: str) -> None:
    """Say so where a learned controller's threshold was chosen at another pass shape than
    the one it runs at: decoding stays lossless, but its stop rule was tuned for other costs."""
    made = getattr(controller, "pass_shape", None)
    if made and made != shape:
        notice(f"{spec}: its threshold was chosen for pass shape {made}, and this run's is "
               f"{shape}; output is unchanged, but draftctl train --pass-shape {shape} tunes it "
               "for these costs")
