"""``draftctl bench``: real decoding of every prompt with plain AR decoding and every
controller, interleaved, with identical-output checks and Spec-Bench metrics."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tqdm import tqdm

from draftctl.bench.report import write_answers, write_markdown, write_plots
from draftctl.config import save_config
from draftctl.controllers import expand_specs, make_controller, split_drafter
from draftctl.controllers.learned import pass_shape_notice
from draftctl.controllers.rules import ReferenceOracle
from draftctl.decode import DecodeConfig, DecodingOptions, SpeculativeDecoder, generate
from draftctl.decode.loop import GenerationResult
from draftctl.drafters import MODEL, parse_drafter
from draftctl.errors import DraftctlError
from draftctl.models import DEFAULT_TARGET, default_draft, encode_prompt, load_model
from draftctl.profile import Setup, profile_costs, settle
from draftctl.prompts import load_prompts
from draftctl.train.replay import CostModel

DEFAULT_CONTROLLERS = ("static:1-4", "heuristic", "confidence", "pmin", "svip", "oracle")
FASTEST = "ar-fastest"  # plain decoding in the fastest dtype, unpadded (not the reference)


@dataclass
class BenchConfig(DecodingOptions):
    prompts: str | None = None  # JSONL or datasets folder; default: draftctl's prompt set
    split: str = "test"
    limit: int | None = None
    per_category: int | None = None
    controllers: list[str] | None = None  # None: the engine's defaults
    target: str = DEFAULT_TARGET
    draft: str | None = None  # default: the target's shipped draft
    # a drafter (model+lookup, lookup, rest:DIR) for every controller without its own
    # @DRAFTER suffix
    drafter: str | None = None
    device: str = "auto"
    plots: bool = True
    # also time plain decoding in the profile's fastest dtype and pass shape, for the
    # speedup a user sees against the fastest decoding they could run instead
    fastest_ar: bool = True
    # draftctl: draftctl's own decoder; hf: transformers' generate() (draftctl.bench.hf_engine)
    engine: str = "draftctl"
    # --engine hf only: stock (transformers' linear kernels) or packed (every model's linear
    # layers on oneDNN with packed weights, draftctl.decode.kernels.packed_view; CPU)
    kernels: str = "stock"
    # timed passes over each prompt, each in another rotated order; a run's time is its
    # fastest pass, so a stall of the machine during one pass does not count
    repeats: int = 1
    out: str = "runs/bench"


@dataclass
class Run:
    """One prompt decoded with one controller."""

    spec: str
    question_id: int
    category: str
    result: GenerationResult
    text: str
    mismatch: bool | None  # None when sampling (outputs legitimately differ)


COUNTS = ("new_tokens", "wall_s", "modelled_s", "rounds", "drafted", "accepted", "discarded",
          "target_forwards", "draft_forwards", "controller_s", "controller_calls", "mismatches")


def modelled_seconds(result: GenerationResult, cost: CostModel, lookups: bool = False) -> float:
    """The decoding time the calibrated costs give a generation's rounds: each round's draft
    steps and its verification pass at the decoder's pass shape (``CostModel.round_time``),
    prefill left out. It depends on the decisions alone, not on the machine's clock, except
    with ``lookups`` (retrieval drafts, which have no draft step to model): each round's
    measured drafting time, its datastore lookup, is added, as ``replay`` adds the recorded
    one."""
    return sum(cost.round_time(r.drafted, r.draft_forwards, 0)
               + (r.draft_time_s if lookups else 0.0) for r in result.rounds)


def _counts(runs: list[Run], cost: CostModel | None = None, lookups: bool = False) -> dict:
    c = dict.fromkeys(COUNTS, 0)
    for run in runs:
        r = run.result
        c["new_tokens"] += r.new_tokens
        c["wall_s"] += r.wall_s
        c["modelled_s"] += modelled_seconds(r, cost, lookups) if cost is not None else 0.0
        c["rounds"] += len(r.rounds)
        c["drafted"] += sum(x.drafted for x in r.rounds)
        c["accepted"] += sum(x.n_accepted for x in r.rounds)
        c["discarded"] += sum(x.discarded for x in r.rounds)
        c["target_forwards"] += r.target_forwards
        c["draft_forwards"] += r.draft_forwards
        c["controller_s"] += sum(x.controller_time_s for x in r.rounds)
        c["controller_calls"] += sum(x.controller_calls for x in r.rounds)
        c["mismatches"] += int(bool(run.mismatch))
    return c


def summarize(runs: list[Run], ar_tokens_per_s: float | None, cost: CostModel | None = None,
              ar_modelled_tokens_per_s: float | None = None, lookups: bool = False) -> dict:
    """Spec-Bench metrics over some runs; speedup against the AR rate of the same prompts.
    With ``cost``, also the modelled rate (``modelled_seconds``, with the rounds' measured
    ``lookups`` for retrieval drafts) and its speedup against AR's modelled rate."""
    c = _counts(runs, cost, lookups)
    tps = c["new_tokens"] / c["wall_s"] if c["wall_s"] > 0 else float("nan")
    modelled = c["new_tokens"] / c["modelled_s"] if c["modelled_s"] > 0 else None
    return {
        "tokens_per_s": tps,
        "speedup_vs_ar": tps / ar_tokens_per_s if ar_tokens_per_s else None,
        "modelled_tokens_per_s": modelled,
        "modelled_speedup_vs_ar": modelled / ar_modelled_tokens_per_s
        if modelled and ar_modelled_tokens_per_s else None,
        "tau": c["new_tokens"] / c["rounds"] if c["rounds"] else 0.0,
        "acceptance_rate": c["accepted"] / c["drafted"] if c["drafted"] else None,
        "new_tokens": c["new_tokens"], "wall_s": c["wall_s"], "rounds": c["rounds"],
        "drafted": c["drafted"], "accepted": c["accepted"],
        "wasted": c["drafted"] - c["accepted"], "discarded": c["discarded"],
        "target_forwards": c["target_forwards"], "draft_forwards": c["draft_forwards"],
        "controller_us_per_call": 1e6 * c["controller_s"] / c["controller_calls"]
        if c["controller_calls"] else None,
        # sampled outputs differ from AR's by design (the distribution is what is lossless):
        # no mismatch count for them
        "mismatches": None if runs and all(run.mismatch is None for run in runs)
        else c["mismatches"],
    }


def _by_category(runs: list[Run]) -> dict[str, list[Run]]:
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.category, []).append(run)
    return groups


def build_report(cfg: BenchConfig, specs: list[str], runs: list[Run], draft_spec: str,
                 drafter_of: dict[str, str] | None = None, setup: Setup | None = None) -> dict:
    """Metrics per controller, with speedups against AR in the target's own dtype and pass
    shape (the lossless comparison) and against the fastest plain decoding (``FASTEST``: what
    a user could run instead), when it was run. For draftctl's decoder with a calibrated
    profile in ``setup``, each row also gets its modelled rate and speedup
    (``modelled_seconds``): what its decisions are worth at the profile's costs, free of the
    clock's noise."""
    cost = CostModel.from_run({"cost": profile_costs(setup, setup.shape)}) \
        if cfg.engine == "draftctl" and setup is not None and setup.profile is not None \
        else None
    ar_runs = [r for r in runs if r.spec == "none"]
    ar = summarize(ar_runs, None, cost)
    ar_by_cat = {cat: summarize(group, None, cost)
                 for cat, group in _by_category(ar_runs).items()}
    ar["per_category"] = ar_by_cat
    fast_runs = [r for r in runs if r.spec == FASTEST]
    fastest = summarize(fast_runs, ar["tokens_per_s"]) if fast_runs else None
    if fastest is not None:
        fastest["speedup_vs_ar"] = fastest["tokens_per_s"] / ar["tokens_per_s"]
        fastest["differs_from_ar"] = fastest.pop("mismatches")
        fastest.update(setup.fastest_plain_describe() if setup else {})
    controllers = []
    for spec in specs:
        mine = [r for r in runs if r.spec == spec]
        drafter = (drafter_of or {}).get(spec, MODEL)
        tree = parse_drafter(drafter).tree
        row = {"spec": spec, "drafter": drafter.replace(MODEL, draft_spec, 1)
               if parse_drafter(drafter).uses_model else drafter,
               "verify": "tree" if tree else "chain",
               "bit_exact": not tree and (setup is None or setup.shape.exact),
               **summarize(mine, ar["tokens_per_s"], cost, ar["modelled_tokens_per_s"], tree)}
        row["speedup_vs_fastest_ar"] = row["tokens_per_s"] / fastest["tokens_per_s"] \
            if fastest else None
        row["per_category"] = {
            cat: summarize(group, ar_by_cat[cat]["tokens_per_s"], cost,
                           ar_by_cat[cat]["modelled_tokens_per_s"], tree)
            for cat, group in _by_category(mine).items()}
        controllers.append(row)
    greedy = cfg.temperature == 0
    sampling = None if greedy else {
        "temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p,
        "seed": cfg.seed, "note": "every controller decodes every prompt from this seed; "
        "outputs differ from AR's by design, so no mismatches are counted"}
    return {"target": cfg.target, "draft": draft_spec,
            **(setup.describe() if setup else {}),
            "prompts": len(ar_runs), "split": cfg.split, "greedy": greedy, "sampling": sampling,
            "ar": ar, "ar_fastest": fastest, "controllers": controllers,
            # outputs that differ from AR: chain drafts (the exit code), tree drafts apart
            "mismatches": sum(c["mismatches"] for c in controllers if c["verify"] == "chain")
            if greedy else None,
            "tree_mismatches": sum(c["mismatches"] for c in controllers if c["verify"] == "tree")
            if greedy else None,
            "config": asdict(cfg)}


def answer_name(spec: str) -> str:
    """A file name for a spec: ``static:4`` -> ``static-4``."""
    return re.sub(r"[^A-Za-z0-9._=-]+", "-", Path(spec).name if spec.startswith("onnx:")
                  else spec).strip("-") or "controller"


def keep_fastest(best: dict[str, Run], runs: list[Run]) -> None:
    """Keep in ``best`` each spec's fastest run of a prompt over repeated passes; a greedy
    output that differed from the reference in any pass stays counted as a mismatch."""
    for run in runs:
        kept = best.get(run.spec)
        if kept is not None:
            mismatch = None if run.mismatch is None else bool(run.mismatch or kept.mismatch)
            run = replace(min(kept, run, key=lambda r: r.result.wall_s), mismatch=mismatch)
        best[run.spec] = run


def rotated(specs: list[str], shift: int) -> list[str]:
    """``specs`` rotated by ``shift``, so that noise hits every spec alike over the prompts."""
    shift %= len(specs)
    return specs[shift:] + specs[:shift]


def run_bench(cfg: BenchConfig, progress: bool = True) -> dict:
    """Decode, compare, and write ``report.json``, ``report.md``, plots and answers."""
    if cfg.repeats < 1:
        raise DraftctlError(f"repeats must be at least 1, got {cfg.repeats}")
    if cfg.engine == "hf":
        from draftctl.bench.hf_engine import run_bench_hf

        return run_bench_hf(cfg, progress)
    if cfg.engine != "draftctl":
        raise DraftctlError(f"unknown engine {cfg.engine!r}: use draftctl or hf")
    if cfg.kernels != "stock":
        raise DraftctlError(f"--kernels {cfg.kernels} applies to --engine hf; draftctl's "
                            "decoder chooses its kernels with --pass-shape (exact: "
                            "row-invariant packed kernels)")
    specs = expand_specs(cfg.controllers or list(DEFAULT_CONTROLLERS))
    if not specs:
        raise DraftctlError("no controllers to benchmark: pass --controllers SPEC,...")
    if len(set(specs)) != len(specs):
        raise DraftctlError(f"a controller is listed twice in {', '.join(specs)}")
    decode_config = cfg.decode_config()
    if "oracle" in specs and not decode_config.sampling.greedy:
        raise DraftctlError("the oracle needs greedy decoding (temperature 0): under sampling "
                            "the target's continuation is random")
    specs = [s for s in specs if s != "none"]
    parse_drafter(cfg.drafter)
    drafter_of, controllers, parsed = {}, {}, {}
    for spec in specs:
        controller_spec, drafter = split_drafter(spec)
        drafter = drafter or cfg.drafter or MODEL
        try:
            parsed[drafter] = parse_drafter(drafter)
        except DraftctlError as err:
            raise DraftctlError(f"{spec}: {err}") from None
        drafter_of[spec], controllers[spec] = drafter, make_controller(controller_spec)
        if parsed[drafter].tree and isinstance(controllers[spec], ReferenceOracle):
            raise DraftctlError(f"{spec}: the oracle follows a chain; it does not apply to "
                                "retrieval drafts")
    prompts = load_prompts(cfg.prompts, cfg.split, cfg.limit, cfg.per_category)
    uses_model = [s for s, d in drafter_of.items() if parsed[d].uses_model and (
        isinstance(controllers[s], ReferenceOracle) or controllers[s].max_draft() > 0)]
    draft_spec = cfg.draft or default_draft(cfg.target) if uses_model else None
    if uses_model and draft_spec is None:
        raise DraftctlError(f"no draft model for {cfg.target!r}: pass --draft SPEC")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "bench.yaml")

    setup = settle(cfg.target, draft_spec, cfg.device, cfg.dtype, cfg.pass_shape, cfg.profile,
                   progress)
    for spec, controller in controllers.items():
        pass_shape_notice(spec, controller,
                          parsed[drafter_of[spec]].pass_shape(setup.shape).describe())
    decode_config = cfg.decode_config(setup.shape)
    target = load_model(cfg.target, cfg.device, setup.target_dtype)
    draft = load_model(draft_spec, target.device, setup.draft_dtype, target=target) \
        if draft_spec else None
    fast_dtype, fast_shape = setup.fastest_plain()
    fast_decoder = None
    if cfg.fastest_ar:
        fast_target = target if fast_dtype == setup.target_dtype else load_model(
            cfg.target, cfg.device, fast_dtype)
        fast_decoder = SpeculativeDecoder.from_loaded(
            fast_target, None, replace(decode_config, pass_shape=fast_shape))
    parsed.setdefault(MODEL, parse_drafter(MODEL))
    sources = {d: spec.source(target, draft) for d, spec in parsed.items()}

    def make_decoder(drafter: str, config: DecodeConfig) -> SpeculativeDecoder:
        return SpeculativeDecoder.from_loaded(target, sources[drafter], config,
                                              parsed[drafter].lookup)

    drafters = list(dict.fromkeys([MODEL, *drafter_of.values()]))
    decoders = {d: make_decoder(d, decode_config) for d in drafters}
    warm = {d: make_decoder(d, replace(decode_config, max_new_tokens=2)) for d in drafters}
    encoded = [encode_prompt(target.tokenizer, p.text) for p in prompts]
    for ids in tqdm(encoded, desc="warm-up", unit="prompt", disable=not progress):
        for drafter, decoder in warm.items():  # per-shape kernel set-up, untimed
            usable = sources[drafter] is not None
            generate(decoder, ids, make_controller("static:1" if usable else "none"))
        if fast_decoder is not None:
            generate(fast_decoder, ids, make_controller("none"))

    runs: list[Run] = []
    timed = [*specs, *([FASTEST] if fast_decoder is not None else [])]
    bar = tqdm(total=len(prompts) * (len(timed) + 1) * cfg.repeats, desc="bench", unit="run",
               disable=not progress)
    greedy = decode_config.sampling.greedy
    for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
        best: dict[str, Run] = {}
        for p in range(cfg.repeats):
            reference = _run(decoders[MODEL], target.tokenizer, prompt, ids, "none",
                             make_controller("none"), None, greedy=greedy)
            done = [reference]
            bar.update()
            for spec in rotated(timed, i * cfg.repeats + p):
                if spec == FASTEST:
                    decoder, controller = fast_decoder, make_controller("none")
                else:
                    decoder, controller = decoders[drafter_of[spec]], controllers[spec]
                    if isinstance(controller, ReferenceOracle):
                        controller.set_reference(reference.result.output_ids)
                done.append(_run(decoder, target.tokenizer, prompt, ids, spec, controller,
                                 reference.result.output_ids, greedy))
                bar.update()
            keep_fastest(best, done)
        runs.extend(best.values())
        ar_tps = sum(r.result.new_tokens for r in runs if r.spec == "none") / sum(
            r.result.wall_s for r in runs if r.spec == "none")
        bar.set_postfix(ar_tok_s=f"{ar_tps:.1f}")
    bar.close()

    report = build_report(cfg, specs, runs, draft.spec if draft is not None else
                          cfg.drafter or "", drafter_of, setup)
    return write_report(report, runs, out, cfg.plots)


def write_report(report: dict, runs: list[Run], out: Path, plots: bool) -> dict:
    """``report.json``, ``report.md``, Spec-Bench answers and (with ``plots``) the plots."""
    (out / "report.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    write_markdown(report, out / "report.md")
    write_answers(runs, out / "answers", answer_name)
    if plots:
        write_plots(report, runs, out)
    return report


def _run(decoder: SpeculativeDecoder, tokenizer, prompt, ids: list[int], spec: str, controller,
         reference: list[int] | None, greedy: bool) -> Run:
    result = generate(decoder, ids, controller)
    mismatch = (result.output_ids != reference) if greedy and reference is not None else None
    return Run(spec, prompt.question_id, prompt.task, result,
               tokenizer.decode(result.output_ids, skip_special_tokens=True), mismatch)
