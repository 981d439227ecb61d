"""Bench outputs besides ``report.json``: a Markdown table, Spec-Bench answer files, plots."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from draftctl.bench.run import Run


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def short_spec(spec: str) -> str:
    """A spec for tables: an ``onnx:`` model and a ``@rest:DIR`` drafter show their file and
    folder names only."""
    controller, at, drafter = spec.partition("@")
    if controller.startswith("onnx:"):
        controller = f"onnx:{Path(controller[len('onnx:'):]).name}"
    if drafter.startswith("rest:"):
        folder, comma, options = drafter[len("rest:"):].partition(",")
        drafter = f"rest:{Path(folder).name}{comma}{options}"
    return f"{controller}{at}{drafter}"


def setup_line(report: dict) -> str:
    """The dtypes and pass shape a bench ran with, and what 'vs fast' compares against."""
    if "target_dtype" not in report:
        return ""
    packed = ", linear layers packed for oneDNN" if report.get("kernels") == "packed" else ""
    line = (f"target {report['target_dtype']}, pass shape {report['pass_shape']}{packed} "
            f"({'bit-exact' if report['bit_exact'] else 'not bit-exact'}); draft "
            f"{report['draft_dtype']}. 'vs AR': plain decoding with the same dtype and pass "
            "shape (the lossless comparison)")
    fast = report.get("ar_fastest")
    if fast:
        line += (f"; 'vs fast': the fastest plain decoding ({fast.get('dtype', '?')}, "
                 f"{fast.get('pass_shape', '?')})")
    if report.get("ar", {}).get("modelled_tokens_per_s"):
        line += ("; 'modelled': the speedup over AR that the calibrated profile's pass costs "
                 "give each row's rounds (prefill left out), which identical decisions keep "
                 "whatever the clock did")
    repeats = report.get("config", {}).get("repeats", 1)
    if repeats > 1:
        line += f". Each time is the fastest of {repeats} interleaved passes"
    return line + "."


def format_table(report: dict) -> str:
    """Fixed-width table: AR first (and the fastest plain decoding), then each controller."""
    labels = [short_spec(r["spec"]) for r in report["controllers"]]
    w = min(40, max([22, *(len(label) + 1 for label in labels)]))
    head = (f"{'controller':<{w}}{'tok/s':>8}{'vs AR':>7}{'vs fast':>8}{'modelled':>9}"
            f"{'tau':>6}{'accept':>8}{'drafted':>9}{'wasted':>8}{'ctrl us':>9}{'mismatch':>9}")
    ar, fast = report["ar"], report.get("ar_fastest")
    fast_vs = (lambda tps: tps / fast["tokens_per_s"]) if fast else (lambda tps: None)
    ar_modelled = 1.0 if ar.get("modelled_tokens_per_s") else None
    lines = [head, "-" * len(head),
             (f"{'none (AR)':<{w}}{ar['tokens_per_s']:>8.1f}{1:>7.2f}"
              f"{_num(fast_vs(ar['tokens_per_s']), '.2f'):>8}{_num(ar_modelled, '.2f'):>9}"
              f"{ar['tau']:>6.2f}{'-':>8}{0:>9}{0:>8}{'-':>9}{'-':>9}")]
    if fast:
        lines.append(f"{'AR, fastest (' + fast.get('dtype', '?') + ')':<{w}}"
                     f"{fast['tokens_per_s']:>8.1f}{fast['speedup_vs_ar']:>7.2f}{1:>8.2f}"
                     f"{'-':>9}{fast['tau']:>6.2f}{'-':>8}{0:>9}{0:>8}{'-':>9}{'-':>9}")
    for r, label in zip(report["controllers"], labels):
        label = label if len(label) < w else "..." + label[-(w - 4):]
        lines.append(f"{label:<{w}}{r['tokens_per_s']:>8.1f}{r['speedup_vs_ar']:>7.2f}"
                     f"{_num(r.get('speedup_vs_fastest_ar'), '.2f'):>8}"
                     f"{_num(r.get('modelled_speedup_vs_ar'), '.2f'):>9}"
                     f"{r['tau']:>6.2f}{_num(r['acceptance_rate'], '.2f'):>8}{r['drafted']:>9}"
                     f"{r['wasted']:>8}{_num(r['controller_us_per_call'], '.1f'):>9}"
                     f"{_num(r['mismatches'], 'd'):>9}")
    return "\n".join(lines)


def mismatch_notice(report: dict) -> tuple[list[str], bool]:
    """What a bench's greedy outputs that differ from AR's say, and whether they fail it:
    only draftctl's chain decoder promises bit-exact output. Tree passes and transformers'
    own verification (whose passes change shape from round to round) are counted and named."""
    notices = []
    if report.get("tree_mismatches"):
        notices.append(f"{report['tree_mismatches']} outputs of retrieval (tree) drafts differ "
                       "from plain greedy decoding: tree passes are not bit-exact (see README)")
    if not report["mismatches"]:
        return notices, False
    if report.get("engine") == "transformers":
        own = sum(c["mismatches"] or 0 for c in report["controllers"]
                  if c.get("schedule") == "transformers")
        notices.append(f"{report['mismatches']} outputs differ from transformers' plain greedy "
                       f"generate(), {own} of them from transformers' own schedules: its "
                       "verification passes change shape from round to round and round "
                       f"differently in {report.get('target_dtype', 'this dtype')} (not "
                       "bit-exact; see README)")
        return notices, False
    notices.append(f"{report['mismatches']} outputs differ from plain greedy decoding: a "
                   "lossless decoder must not do that")
    return notices, True


def write_markdown(report: dict, path: Path) -> None:
    cats = sorted(report["ar"]["per_category"])
    ar = report["ar"]
    intro = (f"{report['prompts']} prompts ({report['split']} split), "
             f"{'greedy' if report['greedy'] else 'sampling'}, "
             f"{report['config']['max_new_tokens']} new tokens at most. Speedup is tokens/s "
             "over plain autoregressive decoding (AR) of the same prompts by the same decoder; "
             f"tau counts the bonus token. {setup_line(report)}")
    fast = report.get("ar_fastest")
    header = ("| controller | tok/s | speedup | vs fastest AR | modelled speedup | tau | "
              "acceptance | drafted | wasted | target fw | draft fw | controller us/call | "
              "mismatches |")
    ar_row = (f"| none (AR) | {ar['tokens_per_s']:.2f} | 1.00 | "
              f"{_num(ar['tokens_per_s'] / fast['tokens_per_s'] if fast else None, '.3f')} | "
              f"{'1.000' if ar.get('modelled_tokens_per_s') else '-'} | "
              f"{ar['tau']:.2f} | - | 0 | 0 | {ar['target_forwards']} | 0 | - | - |")
    lines = [f"# draftctl bench: {report['target']} with draft {report['draft'] or '-'}", "",
             intro, "", header, "|---" * 13 + "|", ar_row]
    if fast:
        lines.append(f"| AR, fastest ({fast.get('dtype', '?')}, {fast.get('pass_shape', '?')})"
                     f" | {fast['tokens_per_s']:.2f} | {fast['speedup_vs_ar']:.3f} | 1.000 | - | "
                     f"{fast['tau']:.2f} | - | 0 | 0 | {fast['target_forwards']} | 0 | - | - |")
    for r in report["controllers"]:
        lines.append(
            f"| `{short_spec(r['spec'])}` | {r['tokens_per_s']:.2f} | {r['speedup_vs_ar']:.3f} | "
            f"{_num(r.get('speedup_vs_fastest_ar'), '.3f')} | "
            f"{_num(r.get('modelled_speedup_vs_ar'), '.3f')} | "
            f"{r['tau']:.2f} | {_num(r['acceptance_rate'], '.3f')} | {r['drafted']} | "
            f"{r['wasted']} | {r['target_forwards']} | {r['draft_forwards']} | "
            f"{_num(r['controller_us_per_call'], '.1f')} | {_num(r['mismatches'], 'd')} |")
    lines += ["", "## Speedup over AR per category", "",
              "| controller | " + " | ".join(cats) + " |",
              "|---|" + "---|" * len(cats),
              "| AR tok/s | " + " | ".join(
                  f"{report['ar']['per_category'][c]['tokens_per_s']:.2f}" for c in cats) + " |"]
    for r in report["controllers"]:
        lines.append(f"| `{short_spec(r['spec'])}` | " + " | ".join(
            _num(r["per_category"].get(c, {}).get("speedup_vs_ar"), ".3f") for c in cats) + " |")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_answers(runs: list[Run], folder: Path, name: Callable[[str], str]) -> None:
    """One Spec-Bench answer file per method (methods.md section 5); AR is ``none.jsonl``."""
    folder.mkdir(parents=True, exist_ok=True)
    by_spec: dict[str, list[Run]] = {}
    for run in runs:
        by_spec.setdefault(run.spec, []).append(run)
    for spec, group in by_spec.items():
        lines = []
        for run in group:
            r = run.result
            lines.append(json.dumps({
                "question_id": run.question_id, "category": run.category, "model_id": spec,
                "choices": [{"index": 0, "turns": [run.text], "decoding_steps": [len(r.rounds)],
                             "new_tokens": [r.new_tokens], "wall_time": [r.wall_s],
                             "accept_lengths": [len(x.new_tokens) for x in r.rounds]}]}))
        (folder / f"{name(spec)}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _acceptance_points(runs: list[Run]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(entropy, draft position, accepted) of every verified draft token that was reached."""
    entropy, position, accepted = [], [], []
    for run in runs:
        for rnd in run.result.rounds:
            for j, record in enumerate(rnd.features[:rnd.drafted]):
                if j > rnd.n_accepted:  # an earlier token was rejected: never judged
                    break
                entropy.append(record.entropy)
                position.append(record.draft_pos)
                accepted.append(j < rnd.n_accepted)
    return np.array(entropy), np.array(position), np.array(accepted, dtype=float)


def write_plots(report: dict, runs: list[Run], out: Path) -> list[Path]:
    """speedup.png, acceptance.png and accepted_lengths.png; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = [r["spec"] for r in report["controllers"]]
    cats = sorted(report["ar"]["per_category"])
    paths = []

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * (len(cats) + 1) * max(1, len(specs)) / 3), 4))
    groups = ["overall", *cats]
    width = 0.8 / max(1, len(specs))
    for i, r in enumerate(report["controllers"]):
        values = [r["speedup_vs_ar"]] + [
            r["per_category"].get(c, {}).get("speedup_vs_ar") or 0 for c in cats]
        ax.bar(np.arange(len(groups)) + i * width, values, width, label=short_spec(r["spec"]))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2, groups, rotation=20)
    ax.set_ylabel("speedup over AR (tokens/s)")
    ax.set_title("Speedup per controller and category")
    ax.legend(fontsize=7, ncol=2)
    paths.append(_save(fig, out / "speedup.png"))

    drafted = [run for run in runs if run.spec != "none"]
    entropy, position, accepted = _acceptance_points(drafted)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    if len(entropy):
        edges = np.unique(np.quantile(entropy, np.linspace(0, 1, 11)))
        which = np.clip(np.digitize(entropy, edges) - 1, 0, max(0, len(edges) - 2))
        bins = [b for b in range(len(edges) - 1) if (which == b).any()]
        left.plot([entropy[which == b].mean() for b in bins],
                  [accepted[which == b].mean() for b in bins], marker="o")
        positions = np.unique(position)
        right.plot(positions, [accepted[position == k].mean() for k in positions], marker="o")
    left.set_xlabel("draft entropy (nats), decile bins")
    right.set_xlabel("position in the draft")
    for ax in (left, right):
        ax.set_ylabel("P(accepted | earlier tokens accepted)")
        ax.set_ylim(0, 1)
    fig.suptitle("Acceptance of drafted tokens, all controllers pooled")
    paths.append(_save(fig, out / "acceptance.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for spec in specs:
        lengths = [rnd.n_accepted for run in runs if run.spec == spec
                   for rnd in run.result.rounds]
        if lengths:
            counts = np.bincount(lengths)
            ax.step(np.arange(len(counts)), counts / counts.sum(), where="mid",
                    label=short_spec(spec))
    ax.set_xlabel("accepted draft tokens in a round")
    ax.set_ylabel("share of rounds")
    ax.set_title("Accepted lengths")
    ax.legend(fontsize=7, ncol=2)
    paths.append(_save(fig, out / "accepted_lengths.png"))
    return paths


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
