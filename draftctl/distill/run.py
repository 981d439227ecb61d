"""``draftctl distill``: knowledge distillation of a small draft from a target.

Stages, each resumable from what it left in ``out``:

1. ``data/responses.jsonl``: the target's greedy and sampled responses to the prompts;
   ``data/eval.jsonl``: its greedy responses to held-out prompts (agreement is measured there).
2. ``data/teacher.pt``: head token ids and the target's top-k soft labels on every response
   position (one teacher-forced pass per sequence).
3. ``checkpoint.pt``: training state, written atomically every ``checkpoint_every`` steps.
4. ``config.json``, ``model.safetensors``, ``manifest.json``: the finished draft.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from draftctl.config import save_config
from draftctl.distill.data import (
    choose_head_ids,
    dtype_of,
    generate_responses,
    ledger,
    ranked_tokens,
    read_responses,
    read_stages,
    record_stage,
    text_rows,
)
from draftctl.distill.model import DraftLM, from_target, load_draft, save_draft, trainable_state
from draftctl.errors import DraftctlError
from draftctl.models import (
    DEFAULT_TARGET,
    LoadedModel,
    distilled_folder,
    load_model,
    model_file_sha256,
)
from draftctl.profile import batch_dtype
from draftctl.prompts import load_prompts


@dataclass
class DistillConfig:
    target: str = DEFAULT_TARGET
    out: str = "runs/distill"
    prompts: str | None = None  # JSONL prompt file; default: draftctl's own set
    split: str = "train"
    limit: int | None = None
    samples_per_prompt: int = 1  # sampled responses per prompt, besides the greedy one
    max_new_tokens: int = 192
    temperature: float = 0.8
    top_p: float = 0.95
    gen_batch: int = 16
    max_prompt_tokens: int = 384
    # Extra local text files (UTF-8), teacher-labelled at every position in chunks.
    extra_text: list[str] = field(default_factory=list)
    text_chunk_tokens: int = 512
    eval_prompts: str | None = None  # default: same file as prompts
    eval_split: str = "dev"
    eval_limit: int = 24
    # > 0: evaluate on the prompts of ``prompts`` whose question_id % holdout_every == 0 (kept
    # out of training) instead of eval_prompts / eval_split: a pool then needs no other set
    holdout_every: int = 0
    eval_max_new_tokens: int = 128
    # model: a small independent draft (the target's first n_layers layers); feature: one
    # layer reading the target's hidden states at feature_layers (EAGLE-3 style)
    kind: str = "model"
    n_layers: int = 4
    head_size: int = 8192
    # > 0: the head is the smallest of head_sizes whose most frequent training tokens cover at
    # least this share of the held-out greedy responses' tokens (head_size is then ignored)
    head_coverage: float = 0.0
    head_sizes: list[int] = field(default_factory=lambda: [8192, 12288, 16384, 24576, 32768])
    teacher_top_k: int = 32
    # the target's hidden states (output_hidden_states indices) saved at every position with
    # the labels, for feature-level drafts; () saves none
    feature_layers: list[int] = field(default_factory=list)
    unroll_steps: int = 3  # feature drafts: steps trained on the draft's own features
    unroll_decay: float = 0.8  # ... each step's loss weighted decay ** (step - 1)
    prompt_loss: bool = False  # also learn the teacher's labels on the prompts' positions
    steps: int = 3000
    batch_sequences: int = 4
    # > 0: each batch is drawn from this many sequences of neighbouring length (around one
    # picked uniformly), so it pads little; 0: from all sequences, as recipes up to v8 trained
    length_window: int = 0
    lr: float = 5e-4
    warmup_steps: int = 100
    time_budget_min: float | None = None  # stop training early when reached
    # bfloat16: the training passes run under CPU/CUDA autocast (weights and optimizer stay
    # float32); on an AMX CPU a feature-draft step took a third of its float32 time
    train_dtype: str = "float32"
    eval_every: int = 250
    checkpoint_every: int = 100
    seed: int = 0
    device: str = "cpu"
    # the target's dtype for its responses and labels; auto: the dtype of its fastest batched
    # pass (the profile's batch timing). The shipped recipe pins float32, in which it was made.
    dtype: str = "auto"
    threads: int | None = None
    # where stages 1-2 (responses, teacher labels) live; default OUT/data. Another run's data
    # folder trains a second draft (e.g. the other kind) on the same data without remaking it
    data_dir: str | None = None
    # a draft of the same kind and target (a folder or a shipped name) that training continues
    # from: its weights start training and its head ids are kept (head_size and head_coverage
    # are then ignored), so a longer recipe can run session by session, each on new data
    init_from: str | None = None
    notes: str = ""


def target_dtype(target: str, device: str, dtype: str) -> str:
    """``auto``: the dtype of the target's fastest batched pass (``profile.batch_dtype``)."""
    return dtype if dtype != "auto" else batch_dtype(target, device)


def _check(cfg: DistillConfig) -> None:
    if cfg.kind not in KINDS:
        raise DraftctlError(f"unknown draft kind {cfg.kind!r}: use {', '.join(KINDS)}")
    if cfg.train_dtype not in TRAIN_DTYPES:
        raise DraftctlError(f"train_dtype must be one of {', '.join(TRAIN_DTYPES)}, "
                            f"not {cfg.train_dtype!r}")
    if cfg.length_window and not cfg.batch_sequences <= cfg.length_window:
        raise DraftctlError(f"length_window must be 0 (off) or at least batch_sequences "
                            f"({cfg.batch_sequences}), got {cfg.length_window}")
    if cfg.kind == "feature" and not cfg.feature_layers:
        raise DraftctlError("a feature draft reads the target's hidden states: set "
                            "feature_layers (e.g. [3, 15, 28] for a 30-layer target)")


KINDS = ("model", "feature")
TRAIN_DTYPES = ("float32", "bfloat16")


def head_size_for(train_rows: list[dict], heldout_rows: list[dict], sizes: list[int],
                  coverage: float) -> dict:
    """The smallest of ``sizes`` whose most frequent training response tokens cover at least
    ``coverage`` of the held-out responses' tokens (the largest if none does), with the
    coverage of every size: {"head_size", "coverage", "curve": {size: coverage}}."""
    ranked = ranked_tokens(train_rows)
    heldout = [t for row in heldout_rows for t in row["response_ids"]]
    curve = {}
    for size in sorted(sizes):
        head = set(ranked[:size])
        curve[size] = sum(t in head for t in heldout) / max(1, len(heldout))
    chosen = next((s for s in sorted(sizes) if curve[s] >= coverage), max(sizes))
    return {"head_size": chosen, "coverage": curve[chosen], "curve": curve}


def coverage(head_ids: torch.Tensor, rows: list[dict]) -> float:
    """Share of the responses' tokens that the head can draft."""
    head = set(head_ids.tolist())
    tokens = [t for row in rows for t in row["response_ids"]]
    return sum(t in head for t in tokens) / max(1, len(tokens))


def pool_record(prompts: str | None) -> dict | None:
    """The recipe and hash of a prompt pool (``draftctl pool``), if ``prompts`` is one."""
    if prompts is None:
        return None
    manifest = Path(prompts).parent / "manifest.json"
    if not manifest.is_file():
        return None
    pool = json.loads(manifest.read_text())
    if "pool_sha256" not in pool:
        return None
    return {"sha256": pool["pool_sha256"], "seeds_sha256": pool["seeds_sha256"],
            "prompts": pool["prompts"], "counts": pool["counts"], "config": pool["config"]}


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def teacher_labels(model, rows: list[dict], head_ids: torch.Tensor, top_k: int, *,
                   prompt_loss: bool = False, batch_tokens: int = 2048,
                   folder: Path | None = None, feature_layers: Sequence[int] = (),
                   part_tokens: int = 100_000,
                   on_part: Callable[[dict], None] | None = None) -> dict:
    """Per labelled position: the target's top-k probabilities over the head tokens; and,
    with ``feature_layers``, the target's hidden states (``output_hidden_states`` indices) at
    every position, for feature-level drafts.

    A row's labelled positions are its response's, and also its prompt's when ``prompt_loss``
    and the row is the prompt's first response (so each prompt is labelled once). Sequences
    run through the target in batches of similar length, right-padded (the model is causal,
    so padding after a sequence does not change its logits). With ``folder``, every part of
    about ``part_tokens`` tokens is saved there atomically as it is done, and a rerun loads
    the parts it finds instead of computing them again; ``on_part`` hears the tokens and
    seconds of each part computed (not of those loaded).

    Returns {"sequences": [(tokens (L,), first labelled position)], "label_ids": [(n, k) head
    indices], "label_probs": [(n, k)], "features": [(L, layers, H) float16] or None}, in
    ``rows`` order; position j predicts token j + 1.
    """
    device = next(model.parameters()).device
    head_ids = head_ids.to(device)
    items = []
    for row in rows:
        if not row["response_ids"]:
            continue
        tokens = torch.tensor(row["prompt_ids"] + row["response_ids"])
        start = 0 if prompt_loss and row["sample"] == 0 else len(row["prompt_ids"]) - 1
        items.append((tokens, start))
    order = sorted(range(len(items)), key=lambda i: len(items[i][0]))
    batches, first = [], 0
    while first < len(order):
        last = first + 1
        while last < len(order) and (last - first + 1) * len(items[order[last]][0]) <= batch_tokens:
            last += 1
        batches.append(order[first:last])
        first = last
    parts, tokens_in_part = [[]], 0
    for group in batches:
        if tokens_in_part >= part_tokens:
            parts.append([])
            tokens_in_part = 0
        parts[-1].append(group)
        tokens_in_part += sum(len(items[i][0]) for i in group)
    labels: list = [None] * len(items)
    features: list | None = [None] * len(items) if feature_layers else None
    bar = tqdm(total=sum(len(t) for t, _ in items), desc="teacher labels", unit="tok",
               unit_scale=True)
    for number, part in enumerate(parts):
        index = [i for group in part for i in group]
        path = folder / f"part-{number:05d}.pt" if folder is not None else None
        if path is not None and path.is_file():
            saved = torch.load(path)
            if saved["index"] != index or saved["layers"] != list(feature_layers):
                raise DraftctlError(f"{path} was labelled from other responses or layers; "
                                    f"remove {folder} to label again")
        else:
            part_started = time.perf_counter()
            saved = {"index": index, "layers": list(feature_layers), "labels": [],
                     "features": []}
            for group in part:
                _label_batch(model, items, group, head_ids, top_k, feature_layers, saved)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                _atomic_save(saved, path)
            if on_part is not None:
                on_part({"tokens": sum(len(items[i][0]) for i in index),
                         "seconds": time.perf_counter() - part_started,
                         "dtype": dtype_of(model)})
        for k, i in enumerate(index):
            labels[i] = saved["labels"][k]
            if features is not None:
                features[i] = saved["features"][k]
        bar.update(sum(len(items[i][0]) for i in index))
    bar.close()
    return {"sequences": items, "label_ids": [ids for ids, _ in labels],
            "label_probs": [probs for _, probs in labels], "features": features}


@torch.inference_mode()
def _label_batch(model, items: list, group: list[int], head_ids: torch.Tensor, top_k: int,
                 feature_layers: Sequence[int], saved: dict) -> None:
    """One right-padded teacher pass over ``group``; appends to ``saved``."""
    device = head_ids.device
    width = len(items[group[-1]][0])
    batch = torch.zeros((len(group), width), dtype=torch.long)
    for r, i in enumerate(group):
        batch[r, :len(items[i][0])] = items[i][0]
    out = model(batch.to(device), output_hidden_states=bool(feature_layers))
    logits = out.logits.float()
    for r, i in enumerate(group):
        tokens, start = items[i]
        probs = torch.softmax(logits[r, start:len(tokens) - 1], -1)[:, head_ids]
        top = probs.topk(top_k, dim=-1)
        saved["labels"].append((top.indices.to(torch.int16).cpu(),
                                top.values.to(torch.float16).cpu()))
        if feature_layers:
            saved["features"].append(torch.stack(
                [out.hidden_states[k][r, :len(tokens)] for k in feature_layers], dim=1)
                .to(torch.float16).cpu())


def distill_loss(draft: DraftLM, items: list[tuple]) -> tuple[torch.Tensor, int]:
    """Cross-entropy of the draft's head distribution against the teacher's top-k labels
    (renormalised), summed over the labelled positions of a batch of sequences, in one
    forward pass (right padding: the draft is causal, so padding changes no labelled
    position). items: (tokens (L,), first labelled position, label ids (n, k), label probs
    (n, k)). Returns (summed loss, labelled positions)."""
    width = max(len(tokens) for tokens, *_ in items)
    batch = torch.zeros((len(items), width), dtype=torch.long)
    for row, (tokens, *_) in enumerate(items):
        batch[row, :len(tokens)] = tokens
    hidden = draft.model(input_ids=batch, use_cache=False).last_hidden_state
    rows = torch.cat([hidden[row, start:len(tokens) - 1]
                      for row, (tokens, start, *_) in enumerate(items)])
    log_q = torch.log_softmax(draft.head_logits(rows).float(), dim=-1)
    target = torch.cat([probs.float() for *_, probs in items])
    target = target / target.sum(-1, keepdim=True)
    label_ids = torch.cat([ids for *_, ids, _ in items]).long()
    return -(target * log_q.gather(-1, label_ids)).sum(), len(rows)


@torch.inference_mode()
def agreement(draft: DraftLM, rows: list[dict]) -> float:
    """Greedy top-1 agreement of the draft with the target along the target's greedy output."""
    hits = total = 0
    for row in rows:
        if not row["response_ids"]:
            continue
        tokens = torch.tensor(row["prompt_ids"] + row["response_ids"])
        start = len(row["prompt_ids"]) - 1
        hidden = draft.model(input_ids=tokens[None], use_cache=False).last_hidden_state
        hidden = hidden[0, start:-1]
        guess = draft.head_ids[draft.head_logits(hidden).argmax(-1)]
        hits += int((guess == tokens[start + 1:]).sum())
        total += len(row["response_ids"])
    return hits / total if total else float("nan")


def run_distill(cfg: DistillConfig, stated: set[str] | None = None) -> dict:
    """Run (or resume) every stage; returns the manifest of the finished draft. ``stated``:
    the settings the recipe's file and flags set (None: all); a run on another folder's data
    takes the data settings it does not state from that folder's ``recipe.json``."""
    started = time.time()
    out = Path(cfg.out)
    data = Path(cfg.data_dir) if cfg.data_dir else out / "data"
    cfg = check_data_recipe(cfg, data, stated)
    _check(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    for folder in (out, data):
        folder.mkdir(parents=True, exist_ok=True)
    if not (data / "recipe.json").is_file():
        (data / "recipe.json").write_text(json.dumps({k: getattr(cfg, k) for k in DATA_KEYS},
                                                     indent=2))
    save_config(cfg, out / "distill.yaml")
    target = load_model(cfg.target, cfg.device, target_dtype(cfg.target, cfg.device, cfg.dtype))
    prompts = load_prompts(cfg.prompts, cfg.split, cfg.limit)
    if cfg.holdout_every > 0:
        eval_prompts = [p for p in prompts if p.question_id % cfg.holdout_every == 0]
        eval_prompts = eval_prompts[:cfg.eval_limit]
        prompts = [p for p in prompts if p.question_id % cfg.holdout_every != 0]
    else:
        eval_prompts = load_prompts(cfg.eval_prompts or cfg.prompts, cfg.eval_split,
                                    cfg.eval_limit)
    if {p.question_id for p in prompts} & {p.question_id for p in eval_prompts}:
        raise DraftctlError("training and evaluation prompts overlap; use distinct splits")

    common = {"max_prompt_tokens": cfg.max_prompt_tokens, "temperature": cfg.temperature,
              "top_p": cfg.top_p, "batch_size": cfg.gen_batch, "seed": cfg.seed,
              "eos_ids": target.eos_token_ids}
    generate_responses(
        target.model, target.tokenizer, prompts, data / "responses.jsonl",
        samples_per_prompt=cfg.samples_per_prompt, max_new_tokens=cfg.max_new_tokens,
        on_batch=ledger(data, "responses"), **common)
    generate_responses(
        target.model, target.tokenizer, eval_prompts, data / "eval.jsonl",
        samples_per_prompt=0, max_new_tokens=cfg.eval_max_new_tokens,
        on_batch=ledger(data, "eval_responses"), **common)
    rows = read_responses(data / "responses.jsonl")
    texts = text_rows(target.tokenizer, cfg.extra_text, cfg.text_chunk_tokens)
    eval_rows = read_responses(data / "eval.jsonl")

    init = initial_draft(cfg, target)
    teacher_path = data / "teacher.pt"
    if teacher_path.is_file():
        teacher = torch.load(teacher_path)
    else:
        if init is not None:
            head_ids = init.head_ids.cpu()
        else:
            head_size = cfg.head_size
            if cfg.head_coverage > 0:
                head_size = head_size_for(rows + texts["rows"], eval_rows, cfg.head_sizes,
                                          cfg.head_coverage)["head_size"]
            head_ids = choose_head_ids(rows + texts["rows"], head_size, target.eos_token_ids,
                                       len(target.tokenizer))
        labelled = teacher_labels(target.model, rows + texts["rows"], head_ids,
                                  cfg.teacher_top_k, prompt_loss=cfg.prompt_loss,
                                  folder=data / "teacher",
                                  feature_layers=cfg.feature_layers,
                                  on_part=ledger(data, "teacher_labels"))
        labelled.pop("features")  # they stay in the parts; feature drafts load them there
        teacher = {"head_ids": head_ids, **labelled}
        _atomic_save(teacher, teacher_path)
    if init is not None and not torch.equal(init.head_ids.cpu(), teacher["head_ids"]):
        raise DraftctlError(f"init_from {cfg.init_from!r} has another head ({init.head_ids.numel()}"
                            f" ids) than the one {data}'s labels were made for "
                            f"({len(teacher['head_ids'])} ids); use another data folder")

    trainee = make_trainee(cfg, target, teacher, eval_rows, data / "teacher")
    if init is not None:  # same kind and shape, checked: every tensor must fit
        trainee.draft.load_state_dict(init.state_dict())
    train_started = time.perf_counter()
    history, step = _train(cfg, trainee, [len(s[0]) for s in teacher["sequences"]], out)
    stages = {**read_stages(data),
              **record_stage(out, "training", {"seconds": time.perf_counter() - train_started})}
    final = trainee.evaluate(trainee.draft)
    data_tokens = sum(len(r["response_ids"]) for r in rows)
    manifest = {
        "format": "draftctl-distilled-draft/1",
        "teacher": {"spec": cfg.target, "sha256": model_file_sha256(cfg.target)},
        "data": {"prompt_file": str(cfg.prompts or "draftctl built-in prompts"),
                 "pool": pool_record(cfg.prompts),
                 "split": cfg.split, "prompts": len(prompts), "responses": len(rows),
                 "response_tokens": data_tokens,
                 "eval_split": f"question_id % {cfg.holdout_every} == 0 of the same file"
                 if cfg.holdout_every > 0 else cfg.eval_split,
                 "eval_prompts": len(eval_prompts),
                 "responses_sha256": _sha256(data / "responses.jsonl"),
                 "prompt_loss": cfg.prompt_loss, "extra_text": texts["files"],
                 "labelled_positions": sum(len(ids) for ids in teacher["label_ids"])},
        "architecture": {"kind": cfg.kind,
                         "n_layers": 1 if cfg.kind == "feature" else cfg.n_layers,
                         "feature_layers": cfg.feature_layers if cfg.kind == "feature" else None,
                         "head_size": len(teacher["head_ids"]),
                         "head_coverage_heldout": coverage(teacher["head_ids"], eval_rows),
                         "embedding": "target's, frozen, not stored",
                         "head": "trained, initialised from the head tokens' embedding rows"
                         if init is None else "trained, continued from init_from's head"},
        "training": {"steps": step, "history": history,
                     "init_from": init_record(cfg.init_from) if init is not None else None},
        "agreement_eval_float32": final["agreement"],
        "eval_float32": final,
        "config": asdict(cfg),
        "made_on": {"device": str(target.device), "target_dtype": str(target.dtype),
                    "threads": torch.get_num_threads(),
                    "machine": platform.machine(), "torch": torch.__version__},
        "stages": stages,
        "wall_minutes_this_run": (time.time() - started) / 60,
    }
    trainee.save(out, manifest)
    # What ships is int8: measure the agreement of the weights as saved, too.
    saved = trainee.evaluate(trainee.load(out))
    manifest["agreement_eval_int8"], manifest["eval_int8"] = saved["agreement"], saved
    trainee.save(out, manifest)
    return manifest


# the settings stages 1-2 depend on: a data folder made with other values is refused. The
# labels' head ids are saved with them; a run whose init_from has another head is refused
# by comparing the ids themselves, so a fresh draft (of either kind) may train on labels
# that were made for a continued one.
DATA_KEYS = ("target", "prompts", "split", "limit", "samples_per_prompt", "max_new_tokens",
             "temperature", "top_p", "max_prompt_tokens", "extra_text", "text_chunk_tokens",
             "eval_prompts", "eval_split", "eval_limit", "holdout_every", "eval_max_new_tokens",
             "head_size", "head_coverage", "head_sizes", "teacher_top_k", "feature_layers",
             "prompt_loss", "seed", "dtype")


def initial_draft(cfg: DistillConfig, target: LoadedModel) -> torch.nn.Module | None:
    """The draft ``init_from`` names, checked against the recipe (same target, same kind,
    same feature layers or depth), or None."""
    if not cfg.init_from:
        return None
    from draftctl.distill.feature import FeatureDraftLM
    from draftctl.distill.model import read_draft_config

    folder = distilled_folder(cfg.init_from)
    if folder is None:
        raise DraftctlError(f"init_from {cfg.init_from!r} is not a draft distilled by draftctl "
                            f"(a shipped draft's name or a folder that distill wrote)")
    base = read_draft_config(folder)["target"]
    if base != cfg.target:
        raise DraftctlError(f"init_from {cfg.init_from!r} was distilled from {base!r}, not from "
                            f"this recipe's target {cfg.target!r}")
    model = load_model(cfg.init_from, "cpu", torch.float32, target=target).model
    kind = "feature" if isinstance(model, FeatureDraftLM) else "model"
    if kind != cfg.kind:
        raise DraftctlError(f"init_from {cfg.init_from!r} is a {kind} draft; this recipe trains "
                            f"a {cfg.kind} draft")
    if kind == "feature" and list(model.feature_layers) != list(cfg.feature_layers):
        raise DraftctlError(f"init_from {cfg.init_from!r} reads feature_layers "
                            f"{list(model.feature_layers)}, this recipe {cfg.feature_layers}")
    if kind == "model" and model.config.num_hidden_layers != cfg.n_layers:
        raise DraftctlError(f"init_from {cfg.init_from!r} has {model.config.num_hidden_layers} "
                            f"layers, this recipe n_layers {cfg.n_layers}")
    return model


def init_record(spec: str) -> dict:
    """What the manifest says of the draft a run continued from."""
    manifest = json.loads((distilled_folder(spec) / "manifest.json").read_text())
    return {"spec": spec, "weights_sha256": manifest.get("weights_sha256"),
            "steps": manifest.get("training", {}).get("steps"),
            "data": {k: manifest.get("data", {}).get(k) for k in
                     ("prompt_file", "prompts", "response_tokens", "responses_sha256")},
            "agreement_eval_int8": manifest.get("agreement_eval_int8")}


def check_data_recipe(cfg: DistillConfig, data: Path,
                      stated: set[str] | None = None) -> DistillConfig:
    """``cfg`` with the data settings of ``data/recipe.json``, where the folder has one, that
    the recipe does not state (``stated``: the keys its file and flags set; None: all); a
    run that states other values than the folder was made with is refused, naming the keys."""
    path = data / "recipe.json"
    if not path.is_file():
        return cfg
    made = json.loads(path.read_text())
    fixed = DATA_KEYS if stated is None else stated
    taken = {k: made[k] for k in DATA_KEYS if k in made and k not in fixed}
    cfg = replace(cfg, **taken)
    changed = [k for k in DATA_KEYS if made.get(k) != getattr(cfg, k)]
    if changed:
        raise DraftctlError(f"{data} was made with other data settings ({', '.join(changed)}"
                            f"); use those, or another data folder")
    return cfg


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class Trainee:
    """What training needs of a draft kind: the model, the loss of a batch (sequence indices
    -> summed loss, labelled positions), an evaluation ({"agreement": ...}), its learned
    state, and how it is saved and read back."""

    draft: torch.nn.Module
    batch_loss: Callable[[list[int]], tuple[torch.Tensor, int]]
    evaluate: Callable[[torch.nn.Module], dict]
    state: Callable[[], dict]
    save: Callable[[Path, dict], None]
    load: Callable[[Path], torch.nn.Module]


def make_trainee(cfg: DistillConfig, target: LoadedModel, teacher: dict,
                 eval_rows: list[dict], parts: Path) -> Trainee:
    torch.manual_seed(cfg.seed)
    sequences, ids, probs = teacher["sequences"], teacher["label_ids"], teacher["label_probs"]
    if cfg.kind == "feature":
        from draftctl.distill import feature

        draft = feature.from_target(target.model, teacher["head_ids"],
                                    tuple(cfg.feature_layers)).float()
        states = teacher_features(parts, len(sequences))
        embedding = draft.embed.detach()
        return Trainee(
            draft,
            lambda batch: feature.training_loss(
                draft, [(*sequences[i], ids[i], probs[i], states[i]) for i in batch],
                cfg.unroll_steps, cfg.unroll_decay),
            lambda model: _named(feature.agreement(model, eval_rows, target.model)),
            lambda: feature.trainable_state(draft),
            lambda folder, manifest: feature.save_feature_draft(draft, folder, cfg.target,
                                                                manifest),
            lambda folder: feature.load_feature_draft(folder, embedding))
    draft = from_target(target.model, cfg.n_layers, teacher["head_ids"]).float()
    embedding = draft.model.embed_tokens.weight.detach()
    return Trainee(
        draft,
        lambda batch: distill_loss(draft, [(*sequences[i], ids[i], probs[i]) for i in batch]),
        lambda model: {"agreement": agreement(model, eval_rows)},
        lambda: trainable_state(draft),
        lambda folder, manifest: save_draft(draft, folder, cfg.target, manifest),
        lambda folder: load_draft(folder, embedding))


def _named(by_step: list[float]) -> dict:
    """Agreement at step 1 (the target's features) and at later steps (the draft's own)."""
    return {"agreement": by_step[0],
            **{f"agreement_step{j}": a for j, a in enumerate(by_step[1:], start=2)}}


def teacher_features(folder: Path, n: int) -> list[torch.Tensor]:
    """The target's hidden states saved with the teacher labels, in sequence order."""
    features: list = [None] * n
    for path in sorted(folder.glob("part-*.pt")):
        saved = torch.load(path)
        if not saved["layers"]:
            raise DraftctlError(f"{path} holds no hidden states: label again with "
                                f"feature_layers set (remove {folder} and teacher.pt)")
        for k, i in enumerate(saved["index"]):
            features[i] = saved["features"][k]
    missing = sum(f is None for f in features)
    if missing:
        raise DraftctlError(f"{folder} lacks the hidden states of {missing} sequences")
    return features


def batch_picker(lengths: list[int], size: int, window: int) -> Callable[[], list[int]]:
    """Draws a training batch of ``size`` sequence indices from ``random`` (whose state the
    checkpoint keeps). ``window`` 0: any ``size`` sequences. ``window`` > 0: one sequence
    picked uniformly and ``size - 1`` others from the ``window`` (>= ``size``) sequences
    nearest to it in length order, so that a batch padded to its longest sequence wastes
    little."""
    n = len(lengths)
    if window <= 0:
        everything = list(range(n))
        return lambda: random.sample(everything, min(size, n))
    by_length = sorted(range(n), key=lambda i: (lengths[i], i))
    width = min(window, n)

    def pick() -> list[int]:
        rank = random.randrange(n)
        start = min(max(0, rank - width // 2), n - width)
        others = [by_length[r] for r in range(start, start + width) if r != rank]
        return [by_length[rank], *random.sample(others, min(size, n) - 1)]

    return pick


def _train(cfg: DistillConfig, trainee: Trainee, lengths: list[int],
           out: Path) -> tuple[list, int]:
    draft = trainee.draft
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(
        1, cfg.warmup_steps)) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / cfg.steps))))
    step, history, spent = 0, [], 0.0
    ckpt = out / "checkpoint.pt"
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        draft.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        step, history, spent = state["step"], state["history"], state["spent_s"]
        random.setstate(state["python_rng"])
    else:
        random.seed(cfg.seed)
        draft.eval()
        history.append({"step": 0, **trainee.evaluate(draft)})
    pick = batch_picker(lengths, cfg.batch_sequences, cfg.length_window)
    budget_s = cfg.time_budget_min * 60 if cfg.time_budget_min else math.inf
    bar = tqdm(total=cfg.steps, initial=step, desc="distill", unit="step")
    draft.train()
    mark = time.time()

    def _checkpoint() -> None:
        _atomic_save({"model": trainee.state(), "optimizer": optimizer.state_dict(),
                      "schedule": schedule.state_dict(), "step": step, "history": history,
                      "spent_s": spent + time.time() - mark,
                      "python_rng": random.getstate()}, ckpt)

    while step < cfg.steps and spent + (time.time() - mark) < budget_s:
        batch = pick()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type=torch.device(cfg.device).type, dtype=torch.bfloat16,
                            enabled=cfg.train_dtype == "bfloat16"):
            loss, count = trainee.batch_loss(batch)
        loss.backward()
        loss_sum = float(loss.detach())
        for p in params:
            p.grad /= max(count, 1)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        step += 1
        bar.update()
        bar.set_postfix(loss=f"{loss_sum / max(count, 1):.3f}")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            draft.eval()
            history.append({"step": step, "loss": loss_sum / max(count, 1),
                            **trainee.evaluate(draft)})
            draft.train()
            bar.write(f"step {step}: eval agreement {history[-1]['agreement']:.3f}")
        if step % cfg.checkpoint_every == 0:
            _checkpoint()
    if step % cfg.checkpoint_every:
        _checkpoint()  # the final state, so a rerun reproduces this draft without training
    bar.close()
    draft.eval()
    return history, step
