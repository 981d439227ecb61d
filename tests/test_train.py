"""Collect -> train each kind -> export to ONNX -> decode with onnx:, on a tiny pair."""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from draftctl.cli import main
from draftctl.collect.run import run_collect
from draftctl.controllers import make_controller
from draftctl.controllers.learned import SchemaMismatchError
from draftctl.decode import SCHEMA_VERSION, DecodeConfig, SpeculativeDecoder, generate
from draftctl.errors import DraftctlError
from draftctl.export.engines import export_engine
from draftctl.export.onnx import export_onnx
from draftctl.models import load_model
from draftctl.train.data import load_examples
from draftctl.train.replay import CostModel, replay
from draftctl.train.run import TrainConfig, run_train
from tests.test_collect import config, pair  # noqa: F401  (pair is a fixture)


@pytest.fixture(scope="module")
def traces(pair, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("traces") / "dense"
    run_collect(config(pair, out, mode="dense", max_new_tokens=24))
    return out


def test_examples_follow_the_disco_labels(traces):
    examples = load_examples(traces)
    assert "prev_accepted" not in examples.features  # placeholders in dense traces
    assert set(np.unique(examples.y)) <= {0.0, 1.0}
    assert set(examples.splits) == {"train", "dev", "test"}
    position = examples.X[:, examples.features.index("draft_pos")]
    assert (position >= 1).all() and examples.y[position == 1].size > 0


@pytest.mark.parametrize("kind", ["logreg", "hgb", "mlp", "threshold"])
def test_train_export_and_decode_with_onnx(pair, traces, tmp_path, kind):  # noqa: F811
    report = run_train(TrainConfig(traces=str(traces), kind=kind, out=str(tmp_path / kind),
                                   grid=8))
    assert (tmp_path / kind / "report.md").is_file()
    manifest = json.loads((tmp_path / kind / "manifest.json").read_text())
    assert manifest["schema_version"] == SCHEMA_VERSION and manifest["features"]
    specs = [r["spec"] for r in report["test_replay"]]
    assert {"static:1", "static:6", "heuristic", "oracle"} <= set(specs)
    assert report["metrics"]["test"]["auc"] is None or 0 <= report["metrics"]["test"]["auc"] <= 1

    path = tmp_path / f"{kind}.onnx"
    parity = export_onnx(tmp_path / kind, path)
    assert parity["rows"] == 1000 and parity["max_abs_diff"] < 1e-5
    meta = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert json.loads(meta["draftctl_features"]) == manifest["features"]

    target_spec, draft_spec, _ = pair
    target = load_model(target_spec, "cpu")
    draft = load_model(draft_spec, "cpu")
    decoder = SpeculativeDecoder.from_loaded(target, draft, DecodeConfig(max_new_tokens=24))
    controller = make_controller(f"onnx:{path}")
    assert controller.threshold == pytest.approx(manifest["threshold"])
    assert controller.stop == manifest["stop"] == meta["draftctl_stop_rule"] == report["stop"]
    for ids in ([5, 6, 7], [30, 2, 44, 9]):
        reference = generate(decoder, ids, make_controller("none")).output_ids
        assert generate(decoder, ids, controller).output_ids == reference


def with_metadata(path, props: dict) -> str:
    """Rewrite the ONNX file at ``path`` with ``props`` as its metadata; its ``onnx:`` spec."""
    model = onnx.load(str(path))
    del model.metadata_props[:]
    onnx.helper.set_model_props(model, props)
    onnx.save(model, str(path))
    return f"onnx:{path}"


def test_onnx_model_with_unknown_features_is_refused(pair, traces, tmp_path):  # noqa: F811
    run_train(TrainConfig(traces=str(traces), kind="threshold", out=str(tmp_path / "m"), grid=4))
    path = tmp_path / "m.onnx"
    export_onnx(tmp_path / "m", path)
    props = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    unknown = json.dumps(["entropy", "target_logit_gap"])
    with pytest.raises(SchemaMismatchError, match="needs feature\\(s\\) target_logit_gap"):
        make_controller(with_metadata(path, props | {"draftctl_features": unknown}))
    with pytest.raises(DraftctlError, match="stop rule 'sum'"):
        make_controller(with_metadata(path, props | {"draftctl_stop_rule": "sum"}))
    props.pop("draftctl_step_costs", None)  # written when dev chose the cost rule
    with pytest.raises(SchemaMismatchError, match="cost stop rule but has no "
                                                  "draftctl_step_costs"):
        make_controller(with_metadata(path, props | {"draftctl_stop_rule": "cost"}))
    del props["draftctl_stop_rule"]  # files written before the path rule existed
    assert make_controller(with_metadata(path, props)).stop == "token"
    with pytest.raises(SchemaMismatchError, match="schema v7"):
        make_controller(with_metadata(path, props | {"draftctl_schema_version": "7"}))


def test_engine_exports_of_a_top1_threshold_model(traces, tmp_path, capsys):
    run_train(TrainConfig(traces=str(traces), kind="threshold", rule="top_prob_1",
                          stop="token", out=str(tmp_path / "t"), grid=6))
    threshold = json.loads((tmp_path / "t" / "manifest.json").read_text())["threshold"]
    hf = export_engine(tmp_path / "t", "hf-confidence")
    assert hf["value"] == threshold and "assistant_confidence_threshold=" in hf["usage"]
    assert main(["export", "--model", str(tmp_path / "t"), "--format", "llamacpp-pmin",
                 "--out", str(tmp_path / "pmin.json")]) == 0
    pmin = json.loads((tmp_path / "pmin.json").read_text())
    assert 0 <= pmin["value"] <= 0.95 and "re-chosen on the dev traces" in pmin["note"][0]
    assert "--draft-p-min" in capsys.readouterr().out


def test_engine_export_refuses_other_models(traces, tmp_path):
    run_train(TrainConfig(traces=str(traces), kind="logreg", out=str(tmp_path / "l"), grid=4))
    with pytest.raises(DraftctlError, match="--kind threshold --rule top_prob_1"):
        export_engine(tmp_path / "l", "hf-confidence")
    run_train(TrainConfig(traces=str(traces), kind="threshold", rule="top_prob_1", stop="path",
                          out=str(tmp_path / "p"), grid=4))
    with pytest.raises(DraftctlError, match="'path' rule.*--stop token"):
        export_engine(tmp_path / "p", "hf-confidence")


def test_train_chooses_the_stop_rule_on_dev(pair, traces, tmp_path):  # noqa: F811
    """``stop=auto`` tries every rule on dev and keeps the fastest; a forced path or cost rule
    is what the manifest, the ONNX file and the decoder then use, and decoding stays exact."""
    auto = run_train(TrainConfig(traces=str(traces), kind="logreg", out=str(tmp_path / "a"),
                                 grid=4))
    by_stop = auto["dev_by_stop"]
    assert set(by_stop) == {"token", "path", "cost"}
    assert auto["stop"] == max(by_stop, key=lambda rule: by_stop[rule]["dev_speedup"])
    assert auto["threshold"] == by_stop[auto["stop"]]["threshold"]
    assert f"{auto['stop']}, {auto['threshold']:.4f}" in (tmp_path / "a" / "report.md").read_text()

    forced = run_train(TrainConfig(traces=str(traces), kind="logreg", stop="path",
                                   out=str(tmp_path / "p"), grid=4))
    assert forced["stop"] == "path" and list(forced["dev_by_stop"]) == ["path"]
    assert forced["dev_by_stop"]["path"] == by_stop["path"]  # same fit, same grid
    export_onnx(tmp_path / "p", tmp_path / "p.onnx")
    controller = make_controller(f"onnx:{tmp_path / 'p.onnx'}")
    assert controller.stop == "path"
    target_spec, draft_spec, _ = pair
    decoder = SpeculativeDecoder.from_loaded(load_model(target_spec, "cpu"),
                                             load_model(draft_spec, "cpu"),
                                             DecodeConfig(max_new_tokens=24))
    reference = generate(decoder, [5, 6, 7], make_controller("none")).output_ids
    assert generate(decoder, [5, 6, 7], controller).output_ids == reference

    cost = run_train(TrainConfig(traces=str(traces), kind="logreg", stop="cost",
                                 out=str(tmp_path / "c"), grid=4))
    assert cost["dev_by_stop"]["cost"] == by_stop["cost"]
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    info = json.loads((traces / "run.json").read_text())
    expected = CostModel.from_run(info).step_costs(info["k_probe"])
    assert manifest["stop"] == "cost" and manifest["step_costs"] == pytest.approx(expected)
    export_onnx(tmp_path / "c", tmp_path / "c.onnx")
    controller = make_controller(f"onnx:{tmp_path / 'c.onnx'}")
    assert controller.stop == "cost"
    assert controller.step_costs == pytest.approx(manifest["step_costs"])
    assert generate(decoder, [5, 6, 7], controller).output_ids == reference
    with pytest.raises(DraftctlError, match="unknown stop rule 'sum'"):
        TrainConfig(stop="sum")


def test_train_models_time_at_another_pass_shape(pair, traces, tmp_path, capsys):  # noqa: F811
    """``pass_shape`` (from the traces' own profile, or from ``profile``): thresholds and the
    cost rule's step costs for another deployment, not for the shape the traces were taken
    at; the ONNX file names that shape, and decoding at another one says so. A missing or
    foreign profile, a dtype it lacks and an unknown shape are refused."""
    info = json.loads((traces / "run.json").read_text())
    k_probe = info["k_probe"]
    report = run_train(TrainConfig(traces=str(traces), kind="logreg", stop="cost",
                                   pass_shape="fixed:2", out=str(tmp_path / "m"), grid=4))
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    there = CostModel.for_traces(info, pass_shape="fixed:2").step_costs(k_probe)
    assert manifest["pass_shape"] == "fixed:2" and manifest["step_costs"] == pytest.approx(there)
    assert there != pytest.approx(CostModel.from_run(info).step_costs(k_probe))
    own = run_train(TrainConfig(traces=str(traces), kind="logreg", stop="cost",
                                out=str(tmp_path / "own"), grid=4))
    assert report["dev_by_stop"]["cost"]["dev_speedup"] != own["dev_by_stop"]["cost"][
        "dev_speedup"]
    profile = json.loads(Path(info["cost"]["profile"]).read_text())
    copy = tmp_path / "copy.json"
    copy.write_text(json.dumps(profile))
    again = run_train(TrainConfig(traces=str(traces), kind="logreg", stop="cost",
                                  profile=str(copy), dtype="float32", pass_shape="fixed:2",
                                  out=str(tmp_path / "again"), grid=4))
    assert again["dev_by_stop"] == report["dev_by_stop"]
    export_onnx(tmp_path / "m", tmp_path / "m.onnx")
    assert make_controller(f"onnx:{tmp_path / 'm.onnx'}").pass_shape == "fixed:2"
    target, draft, _ = pair
    decode = ["decode", "--target", target, "--draft", draft, "--controller",
              f"onnx:{tmp_path / 'm.onnx'}", "--prompt", "w1", "--max-new-tokens", "6",
              "--device", "cpu", "--dtype", "float32", "--json"]
    assert main([*decode, "--pass-shape", "fixed:4"]) == 0
    assert "chosen for pass shape fixed:2, and this run's is fixed:4" in capsys.readouterr().err
    assert main([*decode, "--pass-shape", "fixed:2"]) == 0
    assert "chosen for pass shape" not in capsys.readouterr().err
    with pytest.raises(DraftctlError, match="profile not found: nowhere.json"):
        TrainConfig(profile="nowhere.json")
    with pytest.raises(DraftctlError, match="unknown pass shape 'fixed:1'"):
        TrainConfig(pass_shape="fixed:1")
    with pytest.raises(DraftctlError, match="not float16: run draftctl calibrate"):
        run_train(TrainConfig(traces=str(traces), kind="logreg", dtype="float16",
                              out=str(tmp_path / "f16"), grid=4))
    stranger = tmp_path / "stranger.json"
    stranger.write_text(json.dumps(profile | {"target": profile["target"] | {"spec": "gpt-x"}}))
    with pytest.raises(DraftctlError, match="measured for target 'gpt-x'.*but the traces"):
        run_train(TrainConfig(traces=str(traces), kind="logreg", profile=str(stranger),
                              out=str(tmp_path / "s"), grid=4))


def test_replay_cli_models_another_pass_shape(traces, tmp_path, capsys):
    """``draftctl replay --pass-shape``: the traces' decisions timed at another shape of their
    own profile; where that profile is gone, the error asks for --profile, and a profile of
    another draft, or of other weights under the draft's name, is refused."""
    args = ["replay", "--traces", str(traces), "--controllers", "static:1-3,oracle", "--json"]

    def speedups(*extra) -> list[float]:
        assert main([*args, *extra]) == 0
        return [r["modelled_speedup"] for r in json.loads(capsys.readouterr().out)]

    info = json.loads((traces / "run.json").read_text())
    expected = replay(traces, ["static:1", "static:2", "static:3", "oracle"],
                      cost=CostModel.for_traces(info, pass_shape="fixed:2"))
    padded = speedups("--pass-shape", "fixed:2")
    assert padded == pytest.approx([r["modelled_speedup"] for r in expected])
    assert padded != pytest.approx(speedups())
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "run.json").write_text(json.dumps(
        info | {"cost": info["cost"] | {"profile": str(tmp_path / "gone.json")}}))
    for shard in traces.iterdir():
        if shard.name != "run.json":
            (moved / shard.name).symlink_to(shard)
    assert main(["replay", "--traces", str(moved), "--controllers", "static:2",
                 "--pass-shape", "fixed:2"]) == 2
    assert "gone.json) is not here: pass --profile" in capsys.readouterr().err
    profile = json.loads(Path(info["cost"]["profile"]).read_text())
    stranger = tmp_path / "stranger.json"
    stranger.write_text(json.dumps(profile | {"draft": profile["draft"] | {"spec": "tiny-x"}}))
    assert main([*args, "--profile", str(stranger)]) == 2
    assert "for draft 'tiny-x' (sha256" in capsys.readouterr().err
    retrained = tmp_path / "retrained.json"
    retrained.write_text(json.dumps(profile | {"draft": profile["draft"] | {"sha256": "0" * 64}}))
    assert main([*args, "--profile", str(retrained)]) == 2
    assert "(sha256 000000000000), but the traces" in capsys.readouterr().err


def test_train_without_test_prompts_still_chooses_on_dev(pair, tmp_path):  # noqa: F811
    """Traces of train and dev prompts only (the demo's): choices are made on dev, and the
    ablation is reported by its dev figures, in report.json and report.md."""
    out = tmp_path / "traindev"
    run_collect(config(pair, out, mode="dense", split="train,dev"))
    report = run_train(TrainConfig(traces=str(out), kind="logreg", out=str(tmp_path / "m"),
                                   grid=4, ablation=True))
    assert report["summary"] is None and report["test_replay"] == []
    assert report["dev_choices"]["static"].startswith("static:")
    text = (tmp_path / "m" / "report.md").read_text()
    assert "no test report" in text and "## Ablation" in text
    row = next(r for r in report["ablation"] if r["group"] == "position")
    assert row["test_speedup"] is None and row["dev_speedup"] > 0
    assert f"| position | {row['features']} | {row['dev_auc']:.3f} | {row['dev_speedup']:.3f} |" \
        in text


def test_a_v3_controller_refuses_v2_traces_with_the_schema_error(pair, traces, tmp_path):  # noqa: F811
    """Traces recorded under feature schema v2 (no cum_logq, target_entropy, token classes)
    are refused by training and by replay, also when the controller replayed is a model
    trained on v3 traces; a v2 model is refused by the decoder."""
    import shutil

    from draftctl.train.replay import replay

    run_train(TrainConfig(traces=str(traces), kind="logreg", out=str(tmp_path / "v3"), grid=4))
    export_onnx(tmp_path / "v3", tmp_path / "v3.onnx")
    old = tmp_path / "v2-traces"
    shutil.copytree(traces, old)
    info = json.loads((old / "run.json").read_text())
    info["feature_schema_version"] = 2
    (old / "run.json").write_text(json.dumps(info))
    with pytest.raises(SchemaMismatchError, match="recorded with feature schema v2; this "
                                                  "draftctl reads v3"):
        replay(old, [f"onnx:{tmp_path / 'v3.onnx'}"])
    with pytest.raises(SchemaMismatchError, match="feature schema v2"):
        run_train(TrainConfig(traces=str(old), kind="logreg", out=str(tmp_path / "x"), grid=4))
    assert replay(traces, [f"onnx:{tmp_path / 'v3.onnx'}"])[0]["tokens"] > 0
    props = {p.key: p.value for p in onnx.load(str(tmp_path / "v3.onnx")).metadata_props}
    with pytest.raises(SchemaMismatchError, match="trained on feature schema v2"):
        make_controller(with_metadata(tmp_path / "v3.onnx",
                                      props | {"draftctl_schema_version": "2"}))


def test_the_ablation_report_lists_every_feature_group(traces, tmp_path):
    """``--ablation`` refits without each feature group in turn, each with its own dev
    threshold; groups dense traces do not carry (history, retrieval) are listed as absent."""
    from draftctl.decode.features import FEATURE_GROUPS

    report = run_train(TrainConfig(traces=str(traces), kind="logreg", out=str(tmp_path / "a"),
                                   grid=4, ablation=True))
    rows = {r["group"]: r for r in report["ablation"]}
    assert list(rows) == list(FEATURE_GROUPS)
    assert rows["history"]["absent"] and rows["retrieval"]["absent"]
    examples = load_examples(traces)
    for group in ("position", "draft_distribution", "draft_path", "target", "token_class"):
        row = rows[group]
        assert not row["absent"] and set(row["dropped"]) == set(FEATURE_GROUPS[group])
        assert row["features"] == len(examples.features) - len(row["dropped"])
        assert row["test_speedup"] > 0 and row["vs_full"] > 0 and row["dev_speedup"] > 0
        assert row["dev_auc"] is None or 0 <= row["dev_auc"] <= 1
    text = (tmp_path / "a" / "report.md").read_text()
    assert "## Ablation" in text and all(f"| {g} |" in text for g in FEATURE_GROUPS)
