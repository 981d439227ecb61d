"""``draftctl train``: fit an acceptance model on train prompts, choose its stop threshold on
dev prompts by modelled speedup (replay with the measured costs), report on test prompts."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import joblib
import numpy as np
import torch

from draftctl.collect.traces import shard_files
from draftctl.config import save_config
from draftctl.controllers.learned import STOP_RULES, ScoreThreshold
from draftctl.decode.cached_lm import PassShape
from draftctl.decode.features import FEATURE_GROUPS, SCHEMA_VERSION
from draftctl.errors import DraftctlError
from draftctl.train.data import load_examples
from draftctl.train.fit import KINDS, THRESHOLD_RULES, TorchModel, fit
from draftctl.train.replay import CostModel, TraceSet, replay


@dataclass
class TrainConfig:
    traces: str = "runs/traces"
    kind: str = "logreg"
    out: str = "runs/controller"
    seed: int = 0
    grid: int = 24  # candidate thresholds (quantiles of the dev predictions)
    rule: str = "auto"  # threshold kind: top_prob_1, entropy, svip, or auto (best train AUC)
    # stop rule: token (a token's own score below the threshold), path (the product of the
    # round's scores so far below it), cost (that product below the threshold times the cost
    # of one more draft at this length), or auto (whichever gives the higher dev speedup;
    # cost only where the traces record a draft model's step cost)
    stop: str = "auto"
    # also refit without each feature group in turn (decode.features.FEATURE_GROUPS), each
    # with its own threshold chosen on dev, and report what dropping it costs on test
    ablation: bool = False
    # model time with this calibrated profile's cost curve and pass shape instead of the one
    # recorded with the traces: a controller for another deployment (say, padded passes)
    profile: str | None = None
    # model time in this target dtype or pass shape (fixed:M, exact, cheapest, free), from
    # ``profile``, or else from the profile the traces were collected with
    dtype: str | None = None
    pass_shape: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise DraftctlError(f"unknown model kind {self.kind!r}: use {', '.join(KINDS)}")
        if self.rule not in ("auto", *THRESHOLD_RULES):
            raise DraftctlError(f"unknown threshold rule {self.rule!r}: use auto, "
                                f"{', '.join(THRESHOLD_RULES)}")
        if self.stop not in ("auto", *STOP_RULES):
            raise DraftctlError(f"unknown stop rule {self.stop!r}: use auto, "
                                f"{', '.join(STOP_RULES)}")
        if self.pass_shape not in (None, "auto", "cheapest"):
            PassShape.parse(self.pass_shape)  # refuses an unknown shape before any fitting
        if self.profile is not None and not Path(self.profile).is_file():
            raise DraftctlError(f"profile not found: {self.profile} (make one with draftctl "
                                "calibrate --out PATH)")


def learned_controller(model, features, threshold: float, spec: str,
                       memo: dict[bytes, float] | None = None,
                       stop: str = "token", step_costs: tuple[float, ...] = ()) -> ScoreThreshold:
    """The model behind the stop rule, as replay runs it. ``memo`` caches scores by input
    bytes: replaying a grid of thresholds visits the same trace rows again and again, and
    one-row ``predict`` calls dominate the cost."""
    memo = {} if memo is None else memo

    def score(x) -> float:
        key = x.tobytes()
        if key not in memo:
            memo[key] = float(model.predict(x)[0])
        return memo[key]

    controller = ScoreThreshold(score, features, threshold, stop=stop, step_costs=step_costs)
    controller.spec = spec
    return controller


def best_by_speedup(traces: TraceSet, candidates: dict, prompt_ids: set[int],
                    cost: CostModel | None = None) -> tuple:
    """(key, result) of the candidate controller with the highest modelled speedup (time
    from ``cost``, by default the traces' recorded costs)."""
    results = replay(traces, list(candidates.values()), prompt_ids, cost=cost)
    best = max(range(len(results)), key=lambda i: results[i]["modelled_speedup"])
    return list(candidates)[best], results[best]


def classification_metrics(p: np.ndarray, y: np.ndarray, bins: int = 10) -> dict:
    from sklearn.metrics import brier_score_loss, roc_auc_score

    hard = y >= 0.5
    edges = np.linspace(0, 1, bins + 1)
    which = np.clip(np.digitize(p, edges) - 1, 0, bins - 1)
    calibration = [{"bin": f"{edges[b]:.1f}-{edges[b + 1]:.1f}", "n": int((which == b).sum()),
                    "mean_predicted": float(p[which == b].mean()),
                    "observed": float(y[which == b].mean())}
                   for b in range(bins) if (which == b).any()]
    return {"auc": float(roc_auc_score(hard, p)) if 0 < hard.sum() < len(hard) else None,
            "brier": float(brier_score_loss(hard, p) if np.all((y == 0) | (y == 1))
                           else np.mean((p - y) ** 2)),
            "rows": len(y), "positive_rate": float(y.mean()), "calibration": calibration}


def run_train(cfg: TrainConfig) -> dict:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "train.yaml")
    examples = load_examples(cfg.traces)
    parts = {s: examples.subset(s) for s in ("train", "dev", "test")}
    empty = [s for s in ("train", "dev") if len(parts[s].y) == 0]
    if empty:
        raise DraftctlError(f"traces in {cfg.traces} hold no {' or '.join(empty)} prompts: "
                            "collect with --split train,dev (fit, threshold) or all (and report)")
    train, dev, test = parts["train"], parts["dev"], parts["test"]
    features = examples.features
    traces = TraceSet(cfg.traces)
    cost = traces.cost_model(cfg.profile, cfg.dtype, cfg.pass_shape)
    dev_ids = {int(i) for i in np.unique(dev.prompt_ids)}
    test_ids = {int(i) for i in np.unique(test.prompt_ids)}
    name = f"learned-{cfg.kind}"
    fitted = fit_and_choose(cfg, parts, features, features, traces, dev_ids, name, cost)
    model, threshold, dev_best, memo = fitted.model, fitted.threshold, fitted.dev_best, fitted.memo
    stop, step_costs = fitted.stop, fitted.step_costs
    p_dev = model.predict(dev.X)
    svip_spec, _ = best_by_speedup(
        traces, {f"svip:{t:.2f}": f"svip:{t:.2f}" for t in np.arange(0.1, 1.01, 0.05)}, dev_ids,
        cost)
    conf_spec, _ = best_by_speedup(
        traces, {f"confidence:{t:.2f}": f"confidence:{t:.2f}"
                 for t in np.arange(0.05, 0.96, 0.05)}, dev_ids, cost)

    k_probe = traces.info["k_probe"]
    statics = [f"static:{k}" for k in range(1, k_probe + 1)]
    static_spec, _ = best_by_speedup(traces, dict(zip(statics, statics)), dev_ids, cost)
    dev_choices = {"static": static_spec, "svip": svip_spec, "confidence": conf_spec}
    baselines = [*statics, "heuristic", "confidence", conf_spec, svip_spec, "oracle"]
    learned = learned_controller(model, features, threshold, name, memo, stop, step_costs)
    test_results = replay(traces, [learned, *baselines], test_ids,
                          cost=cost) if test_ids else []
    summary = _test_summary(test_results, name, svip_spec) if test_results else None
    recorded = traces.info["cost"]
    data_hash = hashlib.sha256()
    for path in shard_files(cfg.traces):
        data_hash.update(path.read_bytes())
    manifest = {
        "kind": cfg.kind, "features": list(features), "schema_version": SCHEMA_VERSION,
        "threshold": threshold, "stop": stop, "rule": STOP_RULES[stop],
        "step_costs": list(step_costs) if stop == "cost" else None,
        # None for retrieval traces: no draft model (lookup times are per round, in the rows)
        "cost_ratio": recorded["t_draft_s"] / recorded["t_target_s"]
        if "t_draft_s" in recorded else None,
        "traces": str(cfg.traces), "profile": cfg.profile, "dtype": cfg.dtype,
        "pass_shape": cost.shape.describe(),
        "data_sha256": data_hash.hexdigest(), "target": traces.info["target"],
        "draft": traces.info["draft"], "seed": cfg.seed,
        "metrics": {"train": classification_metrics(model.predict(train.X), train.y),
                    "dev": classification_metrics(p_dev, dev.y),
                    "test": classification_metrics(model.predict(test.X), test.y)
                    if len(test.y) else None},
        "dev_replay": dev_best, "dev_choices": dev_choices,
    }
    _save_model(model, cfg.kind, features, out)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    report = {"config": asdict(cfg), "summary": summary, "metrics": manifest["metrics"],
              "threshold": threshold, "stop": stop, "dev_by_stop": fitted.by_stop,
              "dev_choices": dev_choices, "test_replay": test_results}
    if cfg.ablation:
        full = next((r["modelled_speedup"] for r in test_results if r["spec"] == name), None)
        report["ablation"] = ablation(cfg, parts, features, traces, dev_ids, test_ids, full,
                                      cost)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(_markdown(report))
    return report


@dataclass
class Fitted:
    """A model fitted on train prompts with the stop rule and threshold chosen for it on dev;
    ``by_stop``: each candidate rule's best threshold and dev modelled speedup;
    ``step_costs``: the cost curve (the traces' or the profile's) as the cost rule reads it
    (empty without one)."""

    model: object
    threshold: float
    stop: str
    dev_best: dict
    memo: dict
    by_stop: dict
    step_costs: tuple[float, ...]


def stop_rules(cfg: TrainConfig, traces: TraceSet,
               cost: CostModel) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """The stop rules to try on dev, and the step costs the cost rule reads: ``cost``'s draft
    step and verification curve per draft position up to the traces' cap. Retrieval and lookup-only traces record no draft step cost, so ``auto``
    leaves the cost rule out there."""
    info = traces.info
    has_costs = "t_draft_s" in info["cost"] and info.get("drafter") != "retrieval"
    if cfg.stop == "cost" and not has_costs:
        raise DraftctlError(f"the cost stop rule needs a draft model's step cost, which the "
                            f"traces in {traces.folder} do not record (retrieval or lookup "
                            "drafts): use --stop token or path")
    rules = tuple(STOP_RULES) if cfg.stop == "auto" else (cfg.stop,)
    if not has_costs:
        return tuple(r for r in rules if r != "cost"), ()
    return rules, tuple(cost.step_costs(info["k_probe"]))


def fit_and_choose(cfg: TrainConfig, parts: dict, features: tuple[str, ...],
                   columns: tuple[str, ...], traces: TraceSet, dev_ids: set[int],
                   name: str, cost: CostModel) -> Fitted:
    """Fit ``cfg.kind`` on the train examples' ``features`` (``columns`` names the examples'
    own columns), then choose its stop rule (``cfg.stop``) and threshold on dev by modelled
    speedup: the candidate thresholds are quantiles of its dev predictions (for the cost rule,
    over the mean step cost, so the bounds it sets span the same range)."""
    index = [columns.index(f) for f in features]
    train, dev = parts["train"], parts["dev"]
    model = fit(cfg.kind, train.X[:, index], train.y, train.prompt_ids, features, cfg.seed,
                cfg.rule)
    p_dev = model.predict(dev.X[:, index])
    grid = np.unique(np.r_[0.0, np.quantile(p_dev, np.linspace(0.0, 0.9, cfg.grid))])
    memo: dict[bytes, float] = {}  # one model's scores: never shared between models
    rules, step_costs = stop_rules(cfg, traces, cost)
    by_stop, best = {}, {}
    for stop in rules:
        scale = 1 / (float(np.mean(np.abs(step_costs))) or 1.0) if stop == "cost" else 1.0
        threshold, best[stop] = best_by_speedup(
            traces, {float(t * scale): learned_controller(model, features, float(t * scale),
                                                          name, memo, stop, step_costs)
                     for t in grid},
            dev_ids, cost)
        by_stop[stop] = {"threshold": threshold,
                         "dev_speedup": best[stop]["modelled_speedup"]}
    stop = max(by_stop, key=lambda rule: by_stop[rule]["dev_speedup"])
    return Fitted(model, by_stop[stop]["threshold"], stop, best[stop], memo, by_stop,
                  step_costs)


def ablation(cfg: TrainConfig, parts: dict, features: tuple[str, ...], traces: TraceSet,
             dev_ids: set[int], test_ids: set[int], full_speedup: float | None,
             cost: CostModel) -> list[dict]:
    """One row per feature group: the model refitted without it (its stop rule and threshold
    chosen on dev again), its dev and test AUC, its dev and test modelled speedup, and the
    test speedup over the full model's. Groups the traces do not carry are listed as
    absent."""
    rows = []
    for group, names in FEATURE_GROUPS.items():
        present = [f for f in names if f in features]
        if not present:
            rows.append({"group": group, "dropped": [], "absent": True})
            continue
        kept = tuple(f for f in features if f not in present)
        row = {"group": group, "dropped": present, "absent": False, "features": len(kept)}
        if not kept:
            rows.append(row | {"note": "no feature left"})
            continue
        name = f"learned-{cfg.kind}-without-{group}"
        fitted = fit_and_choose(cfg, parts, kept, features, traces, dev_ids, name, cost)
        index = [features.index(f) for f in kept]
        for split in ("dev", "test"):
            part = parts[split]
            row[f"{split}_auc"] = classification_metrics(
                fitted.model.predict(part.X[:, index]), part.y)["auc"] if len(part.y) else None
        speedup = None
        if test_ids:
            [result] = replay(traces, [learned_controller(fitted.model, kept, fitted.threshold,
                                                          name, fitted.memo, fitted.stop,
                                                          fitted.step_costs)],
                              test_ids, cost=cost)
            speedup = result["modelled_speedup"]
        row["threshold"], row["stop"], row["test_speedup"] = fitted.threshold, fitted.stop, speedup
        row["dev_speedup"] = fitted.by_stop[fitted.stop]["dev_speedup"]
        row["vs_full"] = speedup / full_speedup if speedup and full_speedup else None
        rows.append(row)
    return rows


def _test_summary(results: list[dict], name: str, svip_spec: str) -> dict:
    """The learned controller against the best static K, tuned SVIP and the oracle."""
    statics = [r for r in results if r["spec"].startswith("static:")]
    best_static = max(statics, key=lambda r: r["modelled_speedup"])
    by_spec = {r["spec"]: r for r in results}
    ours, svip, oracle = by_spec[name], by_spec[svip_spec], by_spec["oracle"]
    gap = oracle["modelled_speedup"] - best_static["modelled_speedup"]
    return {
        "learned_vs_best_static": ours["modelled_speedup"] / best_static["modelled_speedup"],
        "learned_vs_svip_tuned": ours["modelled_speedup"] / svip["modelled_speedup"],
        "gap_closed": (ours["modelled_speedup"] - best_static["modelled_speedup"]) / gap
        if gap > 0 else None,
        "best_static": best_static["spec"], "svip_tuned_on_dev": svip_spec,
    }


def _save_model(model, kind: str, features, out: Path) -> None:
    if isinstance(model, TorchModel):
        torch.save({"state_dict": model.module.state_dict(), "n_features": len(features)},
                   out / "model.pt")
    else:
        joblib.dump(model, out / "model.joblib")


def load_model_dir(folder: str | Path):
    """(model, manifest) of a folder written by ``run_train``."""
    from draftctl.train.fit import AcceptanceMLP

    folder = Path(folder)
    manifest_path = folder / "manifest.json"
    if not manifest_path.is_file():
        raise DraftctlError(f"{folder} has no manifest.json: not a trained controller folder")
    manifest = json.loads(manifest_path.read_text())
    if manifest["kind"] == "mlp":
        state = torch.load(folder / "model.pt")
        module = AcceptanceMLP(state["n_features"])
        module.load_state_dict(state["state_dict"])
        return TorchModel(module.eval()), manifest
    return joblib.load(folder / "model.joblib"), manifest


def _markdown(report: dict) -> str:
    s, choices = report["summary"], report["dev_choices"]
    lines = [f"# Controller report: {report['config']['kind']}", "",
             (f"Stop rule and threshold (chosen on dev by modelled speedup): "
              f"{report['stop']}, {report['threshold']:.4f}"), "",
             *[f"- {rule} rule: best threshold {v['threshold']:.4f}, dev modelled speedup "
               f"{v['dev_speedup']:.3f}" for rule, v in report["dev_by_stop"].items()], "",
             (f"Chosen on dev: {choices['static']}, {choices['svip']}, "
              f"{choices['confidence']}"), ""]
    if s is None:
        lines.append("No test prompts in the traces: no test report.")
        return "\n".join(lines + _ablation_lines(report)) + "\n"
    test = report["metrics"]["test"]
    lines += [f"- test AUC {test['auc']}, Brier {test['brier']:.4f}",
             f"- learned / best static ({s['best_static']}): {s['learned_vs_best_static']:.3f}",
             (f"- learned / SVIP tuned on dev ({s['svip_tuned_on_dev']}): "
             f"{s['learned_vs_svip_tuned']:.3f}"),
             f"- share of the best-static-to-oracle gap closed: {s['gap_closed']}", "",
             "| controller | tau | drafted | wasted | target fw | draft fw | modelled speedup |",
             "|---|---|---|---|---|---|---|"]
    for r in report["test_replay"]:
        lines.append(f"| {r['spec']} | {r['tau']:.2f} | {r['drafted']} | {r['wasted']:.0f} | "
                     f"{r['target_forwards']} | {r['draft_forwards']} | "
                     f"{r['modelled_speedup']:.3f} |")
    return "\n".join(lines + _ablation_lines(report)) + "\n"


def _ablation_lines(report: dict) -> list[str]:
    if "ablation" not in report:
        return []
    full = report["dev_by_stop"][report["stop"]]["dev_speedup"]
    lines = ["", "## Ablation: the model refitted without one feature group", "",
             (f"All features: dev AUC {_fmt(report['metrics']['dev']['auc'])}, dev modelled "
              f"speedup {full:.3f}."), "",
             ("| group dropped | features left | dev AUC | dev modelled speedup | test AUC | "
              "test modelled speedup | vs all features (test) |"), "|---|---|---|---|---|---|---|"]
    for r in report["ablation"]:
        if r["absent"]:
            lines.append(f"| {r['group']} | (not in these traces) | | | | | |")
            continue
        lines.append(f"| {r['group']} | {r.get('features', 0)} | {_fmt(r.get('dev_auc'))} | "
                     f"{_fmt(r.get('dev_speedup'))} | {_fmt(r.get('test_auc'))} | "
                     f"{_fmt(r.get('test_speedup'))} | {_fmt(r.get('vs_full'))} |")
    return lines


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}"
