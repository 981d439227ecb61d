"""Jobs behind the CLI: a config dataclass and one function that runs it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from draftctl.config import save_config
from draftctl.controllers import make_controller
from draftctl.decode import (
    DecodeConfig,
    GenerationResult,
    SamplingConfig,
    SpeculativeDecoder,
    generate,
)
from draftctl.errors import DraftctlError
from draftctl.models import (
    DEFAULT_TARGET,
    LoadedModel,
    default_draft,
    encode_prompt,
    load_model,
    perturbed_copy,
)
from draftctl.prompts import load_prompts


class JobError(DraftctlError):
    """A job that cannot run as configured."""


@dataclass
class DecodeJob:
    prompt: str = ""
    target: str = DEFAULT_TARGET
    draft: str | None = None
    controller: str = "static:4"
    max_new_tokens: int = 128
    max_draft: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    chat: bool = True

    def decode_config(self) -> DecodeConfig:
        return DecodeConfig(max_new_tokens=self.max_new_tokens, max_draft=self.max_draft,
                            sampling=SamplingConfig(self.temperature, self.top_k, self.top_p),
                            seed=self.seed)


def run_decode(job: DecodeJob) -> tuple[GenerationResult, str]:
    """Decode one prompt; returns the result and the generated text."""
    config = job.decode_config()  # validates numbers before any model loads
    controller = make_controller(job.controller)
    if not job.prompt.strip():
        raise JobError("the prompt is empty: pass --prompt TEXT")
    draft_spec = job.draft or default_draft(job.target)
    if controller.max_draft() > 0 and draft_spec is None:
        raise JobError(f"controller {job.controller!r} drafts tokens, so it needs a draft "
                       "model: pass --draft SPEC (a model sharing the target's tokenizer), "
                       "or --controller none for plain decoding")
    target = load_model(job.target, job.device, job.dtype)
    draft = load_model(draft_spec, target.device, job.dtype, target=target) if draft_spec \
        else None
    decoder = SpeculativeDecoder.from_loaded(target, draft, config)
    prompt_ids = encode_prompt(target.tokenizer, job.prompt, chat=job.chat)
    result = generate(decoder, prompt_ids, controller)
    return result, target.tokenizer.decode(result.output_ids, skip_special_tokens=True)


DEMO_CONTROLLERS = ("static:2", "static:4", "heuristic", "confidence", "pmin", "svip", "adaedl")


@dataclass
class DemoJob:
    """End-to-end run on the built-in target: plain decoding vs every controller.

    The draft is the target's shipped distilled draft. Where there is none, it is a stand-in:
    a copy of the target with 2% multiplicative weight noise, which shares the vocabulary and
    agrees partly with the target but costs as much as the target (losslessness and
    acceptance, not speed).
    """

    prompts: str | None = None
    split: str = "test"
    limit: int = 8
    max_new_tokens: int = 96
    controllers: list[str] = field(default_factory=lambda: list(DEMO_CONTROLLERS))
    target: str = DEFAULT_TARGET
    noise: float = 0.02
    seed: int = 0
    device: str = "auto"
    out: str = "runs/demo"


def quick_demo() -> DemoJob:
    return DemoJob(limit=2, max_new_tokens=32, controllers=["static:4", "heuristic", "svip"])


def run_demo(job: DemoJob) -> dict:
    """Decode each prompt with ``none`` and every controller, check outputs are identical
    (greedy is lossless), and write ``report.json``. Returns the report."""
    controllers = [make_controller(spec) for spec in ["none", *job.controllers]]
    prompts = load_prompts(job.prompts, job.split, job.limit)
    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    save_config(job, out / "config.yaml")
    target = load_model(job.target, job.device)
    draft_spec = default_draft(job.target)
    if draft_spec is not None:
        draft = load_model(draft_spec, target.device, target=target)
    else:
        draft = LoadedModel(f"{job.target}+noise{job.noise}",
                            perturbed_copy(target.model, job.noise, 1), target.tokenizer,
                            target.device, target.dtype)
    decoder = SpeculativeDecoder.from_loaded(
        target, draft, DecodeConfig(max_new_tokens=job.max_new_tokens, seed=job.seed))
    encoded = [encode_prompt(target.tokenizer, p.text) for p in prompts]
    # Warm-up: CPU kernels are set up per input shape on first use, so each prompt's prefill
    # runs once, untimed, through both models before any timed run sees it.
    warm = SpeculativeDecoder.from_loaded(target, draft, DecodeConfig(max_new_tokens=2))
    for ids in encoded:
        generate(warm, ids, make_controller("static:1"))

    totals = {c.spec: {"new_tokens": 0, "wall_s": 0.0, "rounds": 0, "drafted": 0, "accepted": 0,
                       "mismatches": 0} for c in controllers}
    bar = tqdm(total=len(prompts) * len(controllers), desc="demo", unit="run")
    for ids in encoded:
        reference = None
        for controller in controllers:  # interleaved, so machine noise hits all alike
            result = generate(decoder, ids, controller)
            reference = reference if reference is not None else result.output_ids
            row = totals[controller.spec]
            row["new_tokens"] += result.new_tokens
            row["wall_s"] += result.wall_s
            row["rounds"] += len(result.rounds)
            row["drafted"] += sum(r.drafted for r in result.rounds)
            row["accepted"] += sum(r.n_accepted for r in result.rounds)
            row["mismatches"] += int(result.output_ids != reference)
            bar.update()
    bar.close()
    ar_tps = totals["none"]["new_tokens"] / totals["none"]["wall_s"]
    rows = []
    for spec, row in totals.items():
        tps = row["new_tokens"] / row["wall_s"]
        rows.append({"spec": spec, "tokens_per_s": tps, "speedup_vs_ar": tps / ar_tps,
                     "tau": row["new_tokens"] / row["rounds"],
                     "acceptance_rate": row["accepted"] / row["drafted"] if row["drafted"] else None,
                     **row})
    report = {"target": job.target, "draft": draft.spec, "prompts": len(prompts),
              "split": job.split, "config": asdict(job), "controllers": rows}
    (out / "report.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    return report


def format_table(rows: list[dict]) -> str:
    """A fixed-width table of the demo's per-controller rows."""
    head = f"{'controller':<14}{'tok/s':>8}{'vs AR':>8}{'tau':>7}{'accept':>8}{'mismatch':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        acc = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
        lines.append(f"{r['spec']:<14}{r['tokens_per_s']:>8.1f}{r['speedup_vs_ar']:>8.2f}"
                     f"{r['tau']:>7.2f}{acc:>8}{r['mismatches']:>10}")
    return "\n".join(lines)
