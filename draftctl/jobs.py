"""Jobs behind the CLI: a config dataclass and one function that runs it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from draftctl.config import save_config
from draftctl.controllers import make_controller
from draftctl.controllers.learned import pass_shape_notice
from draftctl.decode import DecodingOptions, GenerationResult, SpeculativeDecoder, generate
from draftctl.drafters import parse_drafter
from draftctl.errors import DraftctlError
from draftctl.models import DEFAULT_TARGET, default_draft, encode_prompt, load_model
from draftctl.profile import Setup, settle


class JobError(DraftctlError):
    """A job that cannot run as configured."""


@dataclass
class DecodeJob(DecodingOptions):
    prompt: str = ""
    target: str = DEFAULT_TARGET
    draft: str | None = None
    # model (the draft model), model+lookup, lookup or rest:DIR (``draftctl.drafters``)
    drafter: str | None = None
    controller: str = "static:4"
    device: str = "auto"
    chat: bool = True


@dataclass
class Decoded:
    """A finished ``decode`` job: the generation, its text, and what it ran with."""

    result: GenerationResult
    text: str
    setup: Setup

    def summary(self) -> dict:
        return {"text": self.text, **self.result.summary(), **self.setup.describe()}


def run_decode(job: DecodeJob) -> Decoded:
    """Decode one prompt with the dtypes and pass shape the profile (or the job) sets."""
    job.decode_config()  # validates numbers before any model loads
    controller = make_controller(job.controller)
    if not job.prompt.strip():
        raise JobError("the prompt is empty: pass --prompt TEXT")
    drafter = parse_drafter(job.drafter)
    draft_spec = job.draft or default_draft(job.target) if drafter.uses_model else None
    if controller.max_draft() > 0 and draft_spec is None and drafter.uses_model:
        raise JobError(f"controller {job.controller!r} drafts tokens, so it needs a draft "
                       "model: pass --draft SPEC (a model sharing the target's tokenizer), "
                       "--drafter lookup, or --controller none for plain decoding")
    setup = settle(job.target, draft_spec, job.device, job.dtype, job.pass_shape, job.profile)
    pass_shape_notice(job.controller, controller, drafter.pass_shape(setup.shape).describe())
    config = job.decode_config(setup.shape)
    target = load_model(job.target, job.device, setup.target_dtype)
    draft = load_model(draft_spec, target.device, setup.draft_dtype, target=target) \
        if draft_spec else None
    decoder = SpeculativeDecoder.from_loaded(target, drafter.source(target, draft), config,
                                             drafter.lookup)
    result = generate(decoder, encode_prompt(target.tokenizer, job.prompt, chat=job.chat),
                      controller)
    return Decoded(result, target.tokenizer.decode(result.output_ids, skip_special_tokens=True),
                   setup)


@dataclass
class DemoJob:
    """The whole toolkit on the built-in pair, offline: collect dense traces on the train and
    dev prompts (probe traces, ``k_probe`` tokens a round, for a drafter whose rounds end
    where lookup matches do: ``model+lookup,alone=N``, ``lookup``), train learned
    controllers, export them to ONNX, then ``bench`` them on the test prompts against the
    best static K, heuristic, confidence and SVIP (the last three values chosen on dev by
    replay), and the oracle."""

    prompts: str | None = None  # default: draftctl's own prompt set
    # traces on many prompts, each followed for fewer tokens than the bench decodes: at one
    # collection cost, 36 prompts a group x 32 tokens trained better controllers on Spec-Bench
    # than 12 x 96 (README, *how many traces*)
    collect_per_category: int | None = 36
    collect_max_new_tokens: int | None = 32  # None: max_new_tokens
    collect_limit: int | None = None
    bench_per_category: int | None = 3
    bench_limit: int | None = None
    # timed passes over each test prompt; a run's time is its fastest (``BenchConfig.repeats``)
    bench_repeats: int = 2
    max_new_tokens: int = 96
    k_probe: int = 8
    # hgb and mlp gained from more traces on Spec-Bench, logreg did not (README)
    kinds: list[str] = field(default_factory=lambda: ["hgb", "mlp"])
    target: str = DEFAULT_TARGET
    draft: str | None = None  # default: the target's shipped draft
    # model+lookup: the draft mixed with context lookup (``draftctl.drafters``); model: alone
    drafter: str | None = "model+lookup"
    device: str = "cpu"
    seed: int = 0
    out: str = "runs/demo"


def quick_demo() -> DemoJob:
    return DemoJob(collect_per_category=None, collect_max_new_tokens=None, collect_limit=5,
                   bench_per_category=None, bench_limit=2, max_new_tokens=24, k_probe=6)


def run_demo(job: DemoJob) -> dict:
    """Run the four stages into ``job.out``; returns the bench report plus what was chosen."""
    from draftctl.bench.run import BenchConfig, run_bench
    from draftctl.collect.run import CollectConfig, run_collect
    from draftctl.export.onnx import export_onnx
    from draftctl.train.fit import KINDS
    from draftctl.train.run import TrainConfig, run_train

    if job.draft is None and default_draft(job.target) is None:
        raise JobError(f"the demo runs the built-in pair; {job.target!r} has no shipped draft: "
                       "pass --draft SPEC")
    if not job.kinds or len(set(job.kinds)) < len(job.kinds):
        raise JobError(f"demo kinds {','.join(job.kinds) or '(none)'}: give one or more "
                       f"distinct kinds among {', '.join(KINDS)}")
    if job.collect_max_new_tokens is not None and job.collect_max_new_tokens < 1:
        raise JobError(f"demo collect_max_new_tokens must be >= 1, got "
                       f"{job.collect_max_new_tokens}")
    out = Path(job.out)
    traces = out / "traces"
    # built before any trace is collected: each config checks its kind
    train_configs = {kind: TrainConfig(traces=str(traces), kind=kind,
                                       out=str(out / "controllers" / kind), seed=job.seed)
                     for kind in job.kinds}
    out.mkdir(parents=True, exist_ok=True)
    save_config(job, out / "demo.yaml")
    stages = 3 + len(job.kinds)

    mode = "dense" if parse_drafter(job.drafter).dense else "probe"
    traced_tokens = job.max_new_tokens if job.collect_max_new_tokens is None \
        else job.collect_max_new_tokens
    _stage(1, stages, f"collect {mode} traces on the train and dev prompts")
    run_collect(CollectConfig(
        target=job.target, draft=job.draft, drafter=job.drafter, prompts=job.prompts,
        split="train,dev",
        limit=job.collect_limit, per_category=job.collect_per_category, mode=mode,
        k_probe=job.k_probe, max_new_tokens=traced_tokens, seed=job.seed,
        device=job.device, out=str(traces)))

    learned, trained = [], {}
    for i, (kind, config) in enumerate(train_configs.items()):
        _stage(2 + i, stages, f"train {kind}, choose its threshold on dev, export to ONNX")
        report = run_train(config)
        onnx_path = out / "controllers" / f"{kind}.onnx"
        export_onnx(config.out, onnx_path)
        learned.append(f"onnx:{onnx_path}")
        trained[kind] = {"threshold": report["threshold"], "stop": report["stop"],
                         "onnx": str(onnx_path),
                         "dev_replay": report["dev_choices"]}
    choices = report["dev_choices"]

    _stage(stages - 1, stages, "bench on the test prompts: AR, baselines, oracle, learned")
    controllers = [choices["static"], "heuristic", choices["confidence"], choices["svip"],
                   "oracle", *learned]
    bench = run_bench(BenchConfig(
        prompts=job.prompts, split="test", limit=job.bench_limit,
        per_category=job.bench_per_category, controllers=controllers, target=job.target,
        draft=job.draft, drafter=job.drafter, max_new_tokens=job.max_new_tokens,
        max_draft=job.k_probe, seed=job.seed, repeats=job.bench_repeats,
        device=job.device, out=str(out / "bench")))
    _stage(stages, stages, "done")
    summary = {"bench": bench, "dev_choices": choices, "trained": trained,
               "report": str(out / "bench" / "report.md")}
    (out / "demo.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    return summary


def _stage(i: int, n: int, what: str) -> None:
    tqdm.write(f"[demo {i}/{n}] {what}")
