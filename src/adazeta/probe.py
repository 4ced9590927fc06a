"""Linear probing (the LP rows of the AdaZeta paper's and MeZO's tables): logistic regression on frozen features.

Features are the backbone's final hidden state at the last prompt token (causal: the state that predicts the
answer) or at the mask (masked). A scikit-learn logistic regression is fitted on the train split for each C of a
grid; the C with the best dev accuracy (ties: lower dev loss) is kept and reported on dev and test. Test data is
used once, after the choice.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from adazeta.errors import ConfigError
from adazeta.scoring.evaluate import EvalResult, Predictions
from adazeta.scoring import Encoded, Scorer, backbone_kwargs
from adazeta.tracking import Tracker
from adazeta.train import Outcome

log = logging.getLogger("adazeta")


@dataclass
class ProbeConfig:
    """The logistic-regression probe: C grid (selected on dev), feature scaling, solver iterations."""

    C: list[float] = field(default_factory=lambda: [0.001, 0.01, 0.1, 1.0, 10.0, 100.0])
    standardize: bool = True  # z-score with train statistics; LLM hidden states have outlier dimensions
    max_iter: int = 1000
    # project: the C grid above chosen on dev accuracy, standardised features, an intercept. mezo: MeZO's LP
    # (large_models/trainer.py): multinomial LogisticRegressionCV on train alone (10 Cs from 1e-4 to 1e4, 5-fold CV,
    # no intercept, no scaling, tol 1e-4, max_iter 5000, random_state 0); dev is not used. MeZO writes the
    # coefficients into the LM head's rows of the label tokens and scores with the LM: for one-token label words the
    # same decisions as the classifier used here. MeZO fits every option token of a multi-token answer; here the
    # feature is the prompt's last token only.
    variant: str = "project"

    def __post_init__(self) -> None:
        if self.variant not in ("project", "mezo"):
            raise ConfigError(f"method.probe.variant={self.variant!r} is not one of project, mezo")
        self.C = [float(c) for c in (self.C if isinstance(self.C, (list, tuple)) else [self.C])]
        if not self.C or any(c <= 0 for c in self.C):
            raise ConfigError(f"method.probe.C={self.C} must be a non-empty list of values > 0")
        if self.max_iter < 1:
            raise ConfigError(f"method.probe.max_iter={self.max_iter} must be >= 1")


@torch.no_grad()
def prompt_features(scorer: Scorer, items: Sequence[Encoded], batch_size: int) -> np.ndarray:
    """(N, H) float32 final hidden states at each prompt's last token (causal) or its mask (masked)."""
    model, family, device, pad_id, mask_id = scorer.model, scorer.family, scorer.device, scorer.pad_id, scorer.mask_id
    backbone, _ = scorer.parts()
    model.eval()
    order = sorted(range(len(items)), key=lambda i: len(items[i].prompt))  # similar lengths: less padding
    out = np.zeros((len(items), 0), dtype=np.float32)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        prompts = [items[i].prompt for i in chunk]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, : len(p)] = torch.tensor(p)
            attention[r, : len(p)] = 1
        at = torch.tensor([p.index(mask_id) if family.reads_mask else len(p) - 1 for p in prompts])
        hidden = backbone(input_ids=ids.to(device), attention_mask=attention.to(device),
                          **backbone_kwargs(family)).last_hidden_state
        picked = hidden[torch.arange(len(chunk), device=hidden.device), at.to(hidden.device)].float().cpu().numpy()
        if out.shape[1] == 0:
            out = np.zeros((len(items), picked.shape[1]), dtype=np.float32)
        out[chunk] = picked
    return out


@dataclass
class Probe:
    C: float
    classifier: Any
    scaler: Any | None
    num_classes: int

    def probabilities(self, x: np.ndarray) -> np.ndarray:
        """(N, num_classes) probabilities; a class never seen in training gets probability 0."""
        x = self.scaler.transform(x) if self.scaler is not None else x
        full = np.zeros((len(x), self.num_classes))
        full[:, self.classifier.classes_] = self.classifier.predict_proba(x)
        return full

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> EvalResult:
        """Mean cross-entropy and accuracy, as ``evaluate.evaluate`` reports them for scored candidates."""
        probs = self.probabilities(x)
        loss = float(-np.log(np.clip(probs[np.arange(len(y)), y], 1e-12, None)).mean())
        kept = Predictions.from_scores(np.log(np.clip(probs, 1e-12, None)), y)
        return EvalResult(loss, float((probs.argmax(axis=1) == y).mean()), len(y), predictions=kept)


def fit_probe(
    x_train: np.ndarray, y_train: np.ndarray, x_dev: np.ndarray, y_dev: np.ndarray, cfg: ProbeConfig,
    num_classes: int, seed: int = 0,
) -> tuple[Probe, dict[float, float]]:
    """Fit one logistic regression per C on train; keep the best dev accuracy (ties: lower dev loss)."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    if len(np.unique(y_train)) < 2:
        raise ConfigError("lp: the train split holds a single class; raise data.num_train or change data.seed")
    if cfg.variant == "mezo":
        return _fit_mezo(x_train, y_train, num_classes)
    scaler = StandardScaler().fit(x_train) if cfg.standardize else None
    x = scaler.transform(x_train) if scaler is not None else x_train
    best: tuple[Probe, EvalResult] | None = None
    grid: dict[float, float] = {}
    for c in cfg.C:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConvergenceWarning)
            clf = LogisticRegression(C=c, max_iter=cfg.max_iter, random_state=seed).fit(x, y_train)
        if any(issubclass(w.category, ConvergenceWarning) for w in caught):
            log.warning("lp: C=%g did not converge in probe.max_iter=%d iterations", c, cfg.max_iter)
        probe = Probe(c, clf, scaler, num_classes)
        dev = probe.evaluate(x_dev, y_dev)
        grid[c] = dev.score
        if best is None or (dev.score, -dev.loss) > (best[1].score, -best[1].loss):
            best = (probe, dev)
    assert best is not None
    return best[0], grid


def _fit_mezo(x_train: np.ndarray, y_train: np.ndarray, num_classes: int) -> tuple[Probe, dict[float, float]]:
    """MeZO's probe: ``LogisticRegressionCV(max_iter=5000, fit_intercept=False, multi_class="multinomial",
    random_state=0, tol=1e-4)`` with sklearn's other defaults (Cs=10, 5-fold stratified CV, lbfgs, accuracy), on
    unscaled train features.

    scikit-learn >= 1.8 has no ``multi_class``: on two classes it fits a binary model. A two-class multinomial
    (W = [w0, w1], penalty ||W||^2 / 2C) has w0 = -w1 at its optimum, so its decision w1 - w0 = 2 w1 is the binary
    model's at 2C. The binary fit therefore runs on the doubled grid, and C and the grid are reported in the
    reference's (multinomial) terms.
    """
    from sklearn.linear_model import LogisticRegressionCV

    scale = 2.0 if len(np.unique(y_train)) == 2 else 1.0
    cs = np.logspace(-4, 4, 10)  # sklearn's Cs=10
    clf = LogisticRegressionCV(Cs=scale * cs, max_iter=5000, fit_intercept=False, random_state=0,
                               tol=1e-4).fit(x_train, y_train)
    c = float(np.ravel(clf.C_)[0]) / scale
    scores = np.mean(next(iter(clf.scores_.values())), axis=0)  # mean CV accuracy per C
    return Probe(c, clf, None, num_classes), {float(k): float(v) for k, v in zip(cs, scores)}


def linear_probe(
    scorer: Scorer, encoded: dict[str, Sequence[Encoded]], cfg: ProbeConfig, batch_size: int, tracker: Tracker,
    seed: int,
) -> tuple[Outcome, dict[str, Any]]:
    """Features of train/dev/eval, the probe fitted and selected on dev, dev and test logged; no training steps."""
    counts = {len(e.candidates) for split in encoded.values() for e in split}
    if len(counts) != 1:
        raise ConfigError("lp needs the same candidate set for every example (a classification task); this task varies")
    num_classes = counts.pop()
    feats = {s: prompt_features(scorer, encoded[s], batch_size) for s in encoded}
    labels = {s: np.array([e.gold for e in encoded[s]]) for s in encoded}
    probe, grid = fit_probe(feats["train"], labels["train"], feats["dev"], labels["dev"], cfg, num_classes, seed)
    dev = probe.evaluate(feats["dev"], labels["dev"])
    test = probe.evaluate(feats["eval"], labels["eval"])
    tracker.log_eval(0, "dev", dev.loss, dev.score)
    tracker.log_eval(0, "test", test.loss, test.score)
    log.info("lp: C=%g chosen (%s, accuracy per C: %s)", probe.C,
             "5-fold CV on train, MeZO's probe" if cfg.variant == "mezo" else "on dev", grid)
    # Nothing precedes the fit, so the "initial" dev result is the probe's own.
    outcome = Outcome("finished", None, 0, 0, dev, dev, test, 0)
    chosen_by = "cv_accuracy_per_C" if cfg.variant == "mezo" else "dev_accuracy_per_C"
    info = {"C": probe.C, "variant": cfg.variant, chosen_by: {str(c): a for c, a in grid.items()},
            "features": feats["train"].shape[1]}
    return outcome, info
