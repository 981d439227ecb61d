"""``draftctl bench --engine hf``: the same prompts through transformers' ``generate()``.

Plain ``generate()`` (AR), transformers' own schedules (``hf:constant:K``,
``hf:heuristic[:K0]``, ``hf:confidence[:T]``, ``hf:lookup[:N]``, see
``draftctl.hf.own_schedule``) and draftctl controllers (through ``draftctl.hf``). A spec may
name a draft of its own (``hf:heuristic@DRAFT``) or, for a draftctl controller, mix a feature
draft with context lookup (``svip@model+lookup``: ``--draft`` if given, else the target's
shipped feature draft). Each prompt is run by all of them in a rotated order after an untimed
warm-up, ``repeats`` times with each run's fastest pass kept, as ``draftctl bench`` does.
Verification is transformers' own in every run; the passes are transformers' (unpadded), so
greedy outputs are compared with plain ``generate()``, not with draftctl's bit-exact shapes.
``kernels="packed"`` runs every row, plain ``generate()`` included, on the models' packed views
(``draftctl.decode.kernels.packed_view``).
Under sampling every run of a prompt starts from the same seed."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from draftctl import hf
from draftctl.bench.run import BenchConfig, Run, build_report, keep_fastest, rotated, write_report
from draftctl.config import save_config
from draftctl.controllers import expand_specs, make_controller, split_drafter
from draftctl.decode import kernels
from draftctl.decode.loop import GenerationResult
from draftctl.drafters.lookup import MODEL_LOOKUP, is_lookup, lookup_kind
from draftctl.errors import DraftctlError
from draftctl.models import default_draft, encode_prompt, load_model
from draftctl.profile import settle
from draftctl.prompts import load_prompts

DEFAULT_HF_CONTROLLERS = ("hf:heuristic", "hf:confidence:0.4", "hf:constant:4", "static:4",
                          "svip")


def _mixes_lookup(drafter: str | None) -> bool:
    return lookup_kind(drafter) == MODEL_LOOKUP


def _check_controller(controller: str) -> None:
    """A controller ``generate()`` can run: one of transformers' schedules or a draftctl
    controller that needs no reference output."""
    if controller.startswith(hf.OWN):
        hf.own_schedule(controller)
    elif make_controller(controller).reads_tokens:
        raise DraftctlError(f"{controller}: the oracle needs the reference output, which "
                            "generate() does not have")


def _check_drafter(spec: str) -> None:
    """A spec's ``@DRAFTER`` that ``generate()`` can draft with: a draft model of its own, or
    for a draftctl controller a feature draft mixed with context lookup (``model+lookup``)."""
    controller, drafter = split_drafter(spec)
    if drafter is None or not (drafter.startswith("rest:") or is_lookup(drafter)):
        return
    if not _mixes_lookup(drafter) or controller.startswith(hf.OWN):
        raise DraftctlError(f"{spec}: transformers' generate() drafts with an assistant model, "
                            f"not with {drafter}; a draftctl controller takes @model+lookup "
                            "(a feature draft mixed with context lookup), and hf:lookup:N is "
                            "transformers' own prompt lookup")


def _result(ids: list[int], output: torch.Tensor, rounds, wall_s: float,
            eos: frozenset[int]) -> GenerationResult:
    new = output[0, len(ids):].tolist()
    end = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
    return GenerationResult(
        prompt_ids=ids, output_ids=new[:end], rounds=rounds, wall_s=wall_s,
        target_forwards=len(rounds) if rounds else end,
        draft_forwards=sum(r.draft_forwards for r in rounds),
        stop_reason="eos" if end < len(new) or (new and new[-1] in eos) else "max_new_tokens")


def run_bench_hf(cfg: BenchConfig, progress: bool = True) -> dict:
    """Decode every prompt with plain ``generate()`` and each spec inside ``generate()``;
    write the same report files as ``run_bench``."""
    hf.check_transformers()
    specs = [s for s in expand_specs(cfg.controllers or list(DEFAULT_HF_CONTROLLERS),
                                     check=_check_controller) if s != "none"]
    for spec in specs:
        _check_drafter(spec)
    if not specs:
        raise DraftctlError("no controllers to benchmark: pass --controllers SPEC,...")
    if len(set(specs)) != len(specs):
        raise DraftctlError(f"a controller is listed twice in {', '.join(specs)}")
    if cfg.kernels not in ("stock", "packed"):
        raise DraftctlError(f"unknown kernels {cfg.kernels!r}: use stock or packed")
    if cfg.drafter is not None:
        raise DraftctlError("--engine hf drafts with the draft model; --drafter applies to "
                            "draftctl's own engine")
    draft_spec = cfg.draft or default_draft(cfg.target, assistant=True)
    if draft_spec is None:
        raise DraftctlError(f"no draft model for {cfg.target!r}: pass --draft SPEC")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "bench.yaml")
    setup = settle(cfg.target, draft_spec, cfg.device, cfg.dtype, "free", cfg.profile, progress)
    target = load_model(cfg.target, cfg.device, setup.target_dtype)
    named = {spec: split_drafter(spec)[1] for spec in specs}  # each spec's @DRAFTER, or None
    lookup_of = {spec: drafter for spec, drafter in named.items() if _mixes_lookup(drafter)}
    feature_spec = cfg.draft or default_draft(cfg.target)  # what @model+lookup mixes with
    if lookup_of and feature_spec is None:
        raise DraftctlError(f"{', '.join(lookup_of)}: no feature draft for {cfg.target!r} to "
                            "mix with context lookup: pass --draft SPEC")
    drafter_of = {spec: feature_spec if spec in lookup_of else drafter or draft_spec
                  for spec, drafter in named.items()}
    drafts = {name: load_model(name, target.device, setup.draft_dtype, target=target)
              for name in dict.fromkeys([draft_spec, *drafter_of.values()])}
    model, assistants = target.model, {name: d.model for name, d in drafts.items()}
    if cfg.kernels == "packed":  # a model that cannot be packed is refused, naming why
        model = kernels.packed_view(model)
        assistants = {name: kernels.packed_view(m) for name, m in assistants.items()}
    greedy = cfg.temperature == 0
    eos = frozenset(target.eos_token_ids)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else \
        min(eos)
    kwargs = {"max_new_tokens": cfg.max_new_tokens, "do_sample": not greedy,
              "eos_token_id": sorted(eos), "pad_token_id": pad, "tokenizer": target.tokenizer}
    if not greedy:
        kwargs |= {"temperature": cfg.temperature, "top_k": cfg.top_k or None,
                   "top_p": cfg.top_p}
    prompts = load_prompts(cfg.prompts, cfg.split, cfg.limit, cfg.per_category)
    encoded = [encode_prompt(target.tokenizer, p.text) for p in prompts]

    def decode(spec: str, ids: list[int], seed: int,
               max_new: int | None = None) -> tuple[torch.Tensor, list, float]:
        """(generate()'s output, its rounds, wall seconds) for one spec on one prompt."""
        tensor = torch.tensor([ids], device=target.device)
        call = kwargs | ({"max_new_tokens": max_new} if max_new else {})
        torch.manual_seed(seed)
        if spec == "none":
            start = time.perf_counter()
            output = model.generate(tensor, attention_mask=torch.ones_like(tensor), **call)
            if target.device.type == "cuda":
                torch.cuda.synchronize()
            return output, [], time.perf_counter() - start
        result = hf.run(model, tensor, assistants[drafter_of[spec]],
                        controller=split_drafter(spec)[0], max_draft=cfg.max_draft,
                        lookup=lookup_of.get(spec), beta=False, features=False,
                        attention_mask=torch.ones_like(tensor), **call)
        return result.output, result.rounds, result.wall_s

    warm_ups = ["none", *{drafter_of[s]: f"static:1@{drafter_of[s]}" for s in specs}.values()]
    drafter_of |= {spec: spec.partition("@")[2] for spec in warm_ups[1:]}
    for ids in tqdm(encoded, desc="warm-up", unit="prompt", disable=not progress):
        for spec in warm_ups:  # each draft's kernels set up once, untimed
            decode(spec, ids, cfg.seed, max_new=2)

    runs: list[Run] = []
    bar = tqdm(total=len(prompts) * (len(specs) + 1) * cfg.repeats, desc="bench hf",
               unit="run", disable=not progress)
    for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
        seed, best = cfg.seed + i, {}
        for p in range(cfg.repeats):
            results = {}
            for spec in rotated(["none", *specs], i * cfg.repeats + p):
                output, rounds, wall = decode(spec, ids, seed)
                results[spec] = _result(ids, output, rounds, wall, eos)
                bar.update()
            reference = results["none"].output_ids
            keep_fastest(best, [Run(
                spec, prompt.question_id, prompt.task, results[spec],
                target.tokenizer.decode(results[spec].output_ids, skip_special_tokens=True),
                (results[spec].output_ids != reference) if greedy and spec != "none" else None)
                for spec in ["none", *specs]])
        runs.extend(best.values())
    bar.close()

    report = build_report(cfg, specs, runs, draft_spec, None, setup)  # every draft: a chain
    report["engine"] = "transformers"
    report["pass_shape"], report["bit_exact"] = "free", False
    report["transformers"] = hf.transformers.__version__
    report["kernels"] = cfg.kernels
    for row in report["controllers"]:
        spec = row["spec"]
        if hf.own_schedule_is_lookup(split_drafter(spec)[0]):
            row["drafter"] = "transformers' prompt lookup"
        else:
            row["drafter"] = drafter_of[spec] + (f" with {lookup_of[spec]}"
                                                 if spec in lookup_of else "")
        row["bit_exact"] = False
        row["schedule"] = "transformers" if spec.startswith(hf.OWN) else "draftctl"
    return write_report(report, runs, out, cfg.plots)
