"""``draftctl export``: a trained controller -> ONNX, with its feature schema as metadata.

scikit-learn pipelines go through skl2onnx (``zipmap=False``: a plain probability matrix),
the MLP through ``torch.onnx.export``, threshold rules through a three-node graph. The ONNX
file carries ``draftctl_features`` (input order), ``draftctl_schema_version``,
``draftctl_threshold``, ``draftctl_stop_rule`` (token, path or cost; the cost rule's
``draftctl_step_costs`` too), ``draftctl_pass_shape`` (the pass shape its threshold was
chosen at) and which output holds the acceptance probability;
``onnx:PATH`` reads them back. Every export is checked against the native model on 1,000
rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from draftctl.errors import DraftctlError
from draftctl.train.fit import SklearnModel, ThresholdModel, TorchModel

PARITY_TOLERANCE = 1e-5


def _sklearn_onnx(model: SklearnModel, n_features: int):
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType

    classifier = model.pipeline.steps[-1][1]
    onnx_model = convert_sklearn(model.pipeline, initial_types=[("input", FloatTensorType(
        [None, n_features]))], options={id(classifier): {"zipmap": False}}, target_opset=17)
    column = list(model.pipeline.classes_).index(1)
    return onnx_model, "probabilities", column


def _torch_onnx(model: TorchModel, n_features: int, path: Path):
    import onnx
    import torch

    torch.onnx.export(model.module, (torch.zeros(1, n_features),), str(path), dynamo=False,
                      input_names=["input"], output_names=["probability"],
                      dynamic_axes={"input": {0: "n"}, "probability": {0: "n"}},
                      opset_version=17)
    return onnx.load(str(path)), "probability", -1


def _threshold_onnx(model: ThresholdModel, n_features: int):
    """score = f(x[:, column]): identity (top-1), negation (entropy), 1 - sqrt(h H) (svip)."""
    from onnx import TensorProto, helper

    def const(name, value, dtype=TensorProto.FLOAT):
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(
            name, dtype, [len(value)] if isinstance(value, list) else [], value
            if isinstance(value, list) else [value]))

    nodes = [const("column", [model.column], TensorProto.INT64),
             const("axis", [1], TensorProto.INT64),
             helper.make_node("Gather", ["input", "column"], ["picked"], axis=1),
             helper.make_node("Squeeze", ["picked", "axis"], ["x"])]
    if model.rule == "top_prob_1":
        nodes.append(helper.make_node("Identity", ["x"], ["probability"]))
    elif model.rule == "entropy":
        nodes.append(helper.make_node("Neg", ["x"], ["probability"]))
    else:
        nodes += [const("h", model.h), const("zero", 0.0), const("one", 1.0),
                  helper.make_node("Max", ["x", "zero"], ["pos"]),
                  helper.make_node("Mul", ["pos", "h"], ["hx"]),
                  helper.make_node("Sqrt", ["hx"], ["root"]),
                  helper.make_node("Sub", ["one", "root"], ["probability"])]
    graph = helper.make_graph(
        nodes, "draftctl_threshold",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [None, n_features])],
        [helper.make_tensor_value_info("probability", TensorProto.FLOAT, [None])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), "probability", -1


def parity_rows(manifest: dict, n: int = 1000, seed: int = 0) -> np.ndarray:
    """Rows to compare native and ONNX outputs on: real trace rows when the traces are at
    hand, else draws spread like feature values."""
    from draftctl.train.data import load_examples

    features = tuple(manifest["features"])
    rng = np.random.default_rng(seed)
    traces = Path(manifest["traces"])
    if (traces / "run.json").is_file():
        X = load_examples(traces, features).X
        return X[rng.choice(len(X), size=n, replace=len(X) < n)]
    return rng.uniform(0, 1, size=(n, len(features))).astype(np.float32)


def export_onnx(model_dir: str | Path, out: str | Path) -> dict:
    """Write ``out`` (.onnx) and check it; returns the parity report."""
    import onnx
    import onnxruntime as ort

    from draftctl.train.run import load_model_dir

    model, manifest = load_model_dir(model_dir)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    n_features = len(manifest["features"])
    if isinstance(model, SklearnModel):
        onnx_model, output, column = _sklearn_onnx(model, n_features)
    elif isinstance(model, TorchModel):
        onnx_model, output, column = _torch_onnx(model, n_features, out)
    elif isinstance(model, ThresholdModel):
        onnx_model, output, column = _threshold_onnx(model, n_features)
    else:
        raise DraftctlError(f"cannot export a {type(model).__name__}")
    metadata = {"draftctl_features": json.dumps(manifest["features"]),
                "draftctl_schema_version": str(manifest["schema_version"]),
                "draftctl_threshold": repr(float(manifest["threshold"])),
                "draftctl_stop_rule": manifest.get("stop", "token"),
                "draftctl_output": output, "draftctl_output_column": str(column),
                "draftctl_kind": manifest["kind"]}
    if manifest.get("stop") == "cost":
        metadata["draftctl_step_costs"] = json.dumps(manifest["step_costs"])
    if manifest.get("pass_shape"):  # the shape its threshold was chosen at
        metadata["draftctl_pass_shape"] = manifest["pass_shape"]
    onnx.helper.set_model_props(onnx_model, metadata)
    onnx.save(onnx_model, str(out))

    X = parity_rows(manifest)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = session.run([output], {session.get_inputs()[0].name: X})[0]
    got = got[:, column] if got.ndim == 2 else got
    expected = model.predict(X)
    worst = float(np.max(np.abs(got.astype(float) - expected)))
    if worst >= PARITY_TOLERANCE:
        raise DraftctlError(f"ONNX export of {model_dir} disagrees with the native model: "
                            f"max |p_onnx - p_native| = {worst:.2e} on {len(X)} rows")
    return {"out": str(out), "rows": len(X), "max_abs_diff": worst, "kind": manifest["kind"]}
