"""Acceptance models: scikit-learn pipelines, a small MLP trained through Lightning, and
one-feature threshold rules. Each fitted model exposes ``predict(X) -> p`` (n,) float."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from draftctl.decode.features import FEATURE_NAMES

KINDS = ("logreg", "hgb", "mlp", "threshold")
THRESHOLD_RULES = ("top_prob_1", "entropy", "svip")


def _weighted(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Soft labels as two weighted copies (label 1 with weight y, label 0 with 1 - y);
    hard labels pass through with unit weights."""
    if np.all((y == 0) | (y == 1)):
        return X, y.astype(int), np.ones(len(y))
    return (np.concatenate([X, X]), np.r_[np.ones(len(y), int), np.zeros(len(y), int)],
            np.r_[y, 1 - y])


@dataclass
class SklearnModel:
    pipeline: object

    def predict(self, X: np.ndarray) -> np.ndarray:
        proba = self.pipeline.predict_proba(X)
        return proba[:, list(self.pipeline.classes_).index(1)]


def fit_sklearn(kind: str, X: np.ndarray, y: np.ndarray, seed: int) -> SklearnModel:
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if kind == "logreg":
        pipeline = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, C=1.0))
        step = "logisticregression"
    else:
        pipeline = make_pipeline(HistGradientBoostingClassifier(
            max_iter=300, learning_rate=0.05, max_leaf_nodes=31, early_stopping=True,
            validation_fraction=0.1, random_state=seed))
        step = "histgradientboostingclassifier"
    Xw, yw, w = _weighted(X, y)
    pipeline.fit(Xw, yw, **{f"{step}__sample_weight": w})
    if kind == "hgb":
        _float32_thresholds(pipeline.steps[-1][1])
    return SklearnModel(pipeline)


def _float32_thresholds(model) -> None:
    """Round a fitted HistGradientBoosting model's split thresholds to float32.

    ONNX tree ensembles compare float32 inputs with float32 thresholds; with the float64
    thresholds left as fitted, a feature value between a threshold and its float32 rounding
    goes one way natively and the other way in ONNX (seen: |p_onnx - p_native| = 0.03). Rounded,
    the native model is the deployed one exactly. (``_predictors`` is scikit-learn's private
    tree storage; no public API sets thresholds.)
    """
    for stage in model._predictors:
        for tree in stage:
            column = tree.nodes["num_threshold"]
            tree.nodes["num_threshold"] = column.astype(np.float32).astype(column.dtype)


class AcceptanceMLP(nn.Module):
    """Standardise, two hidden layers, sigmoid: (n, d) features -> (n,) acceptance prob."""

    def __init__(self, n_features: int, hidden: int = 64):
        super().__init__()
        self.register_buffer("mean", torch.zeros(n_features))
        self.register_buffer("std", torch.ones(n_features))
        self.net = nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x - self.mean) / self.std).squeeze(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logits(x))


@dataclass
class TorchModel:
    module: AcceptanceMLP

    @torch.no_grad()
    def predict(self, X: np.ndarray) -> np.ndarray:
        return self.module(torch.from_numpy(np.asarray(X, np.float32))).numpy().astype(float)


def fit_mlp(X: np.ndarray, y: np.ndarray, groups: np.ndarray, seed: int,
            max_epochs: int = 40) -> TorchModel:
    """Train through a thin LightningModule with early stopping on held-out prompts."""
    import lightning as L
    from lightning.pytorch.callbacks import EarlyStopping
    from torch.utils.data import DataLoader, TensorDataset

    L.seed_everything(seed, workers=True, verbose=False)
    rng = np.random.default_rng(seed)
    unique = np.unique(groups)
    val_groups = set(rng.choice(unique, size=max(1, len(unique) // 10), replace=False).tolist())
    is_val = np.array([g in val_groups for g in groups])
    if is_val.all() or not is_val.any():
        is_val = rng.random(len(y)) < 0.1
    module = AcceptanceMLP(X.shape[1])
    module.mean.copy_(torch.from_numpy(X[~is_val].mean(0)))
    module.std.copy_(torch.from_numpy(X[~is_val].std(0) + 1e-6))

    def loader(mask, shuffle):
        data = TensorDataset(torch.from_numpy(X[mask]), torch.from_numpy(y[mask].astype(np.float32)))
        return DataLoader(data, batch_size=256, shuffle=shuffle)

    class LitAcceptance(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = module

        def _loss(self, batch):
            x, target = batch
            return nn.functional.binary_cross_entropy_with_logits(self.model.logits(x), target)

        def training_step(self, batch, _):
            return self._loss(batch)

        def validation_step(self, batch, _):
            self.log("val_loss", self._loss(batch), prog_bar=True)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    trainer = L.Trainer(max_epochs=max_epochs, accelerator="cpu", logger=False,
                        enable_checkpointing=False, deterministic=True,
                        callbacks=[EarlyStopping("val_loss", patience=3)],
                        enable_model_summary=False)
    trainer.fit(LitAcceptance(), loader(~is_val, True), loader(is_val, False))
    module.eval()
    return TorchModel(module)


@dataclass
class ThresholdModel:
    """A one-feature score: top-1 probability, minus entropy, or SVIP's bound
    ``1 - sqrt(0.15 H)``. Thresholding it is the rule of confidence / SVIP."""

    rule: str
    column: int  # index of the rule's feature among the model's features
    h: float = 0.15

    def predict(self, X: np.ndarray) -> np.ndarray:
        x = np.asarray(X, float)[:, self.column]
        if self.rule == "top_prob_1":
            return x
        if self.rule == "entropy":
            return -x
        return 1 - np.sqrt(self.h * np.maximum(x, 0))


def fit_threshold(X: np.ndarray, y: np.ndarray, features: tuple[str, ...],
                  rule: str = "auto") -> ThresholdModel:
    """The given rule, or (``auto``) the rule whose score ranks accepted above rejected
    tokens best (AUC on train)."""
    from sklearn.metrics import roc_auc_score

    best, best_auc = None, -math.inf
    for candidate in THRESHOLD_RULES if rule == "auto" else (rule,):
        name = "entropy" if candidate == "svip" else candidate
        if name not in features:
            continue
        model = ThresholdModel(candidate, features.index(name))
        auc = roc_auc_score(y >= 0.5, model.predict(X))
        if auc > best_auc:
            best, best_auc = model, auc
    if best is None:
        raise ValueError(f"threshold models need entropy or top_prob_1 among {FEATURE_NAMES}")
    return best


def fit(kind: str, X: np.ndarray, y: np.ndarray, groups: np.ndarray, features: tuple[str, ...],
        seed: int = 0, rule: str = "auto"):
    if kind in ("logreg", "hgb"):
        return fit_sklearn(kind, X, y, seed)
    if kind == "mlp":
        return fit_mlp(X, y, groups, seed)
    if kind == "threshold":
        return fit_threshold(X, y, features, rule)
    raise ValueError(f"unknown model kind {kind!r}: use {', '.join(KINDS)}")
