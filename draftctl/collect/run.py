"""``draftctl collect``: run real SD over a prompt set and write one row per drafted token."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path

import torch
from tqdm import tqdm

from draftctl import __version__
from draftctl.collect.traces import (
    prompt_digest,
    round_rows,
    shard_prompt_digest,
    write_shard,
)
from draftctl.config import save_config
from draftctl.controllers import make_controller
from draftctl.decode import DecodeConfig, SamplingConfig, SpeculativeDecoder, generate
from draftctl.decode.cached_lm import PassShape
from draftctl.decode.features import (
    FEATURE_NAMES,
    SCHEMA_VERSION,
    SequenceState,
    entropy,
    make_record,
)
from draftctl.drafters import DrafterSpec, parse_drafter
from draftctl.errors import DraftctlError
from draftctl.models import (
    DEFAULT_TARGET,
    default_draft,
    encode_prompt,
    load_model,
    model_file_sha256,
)
from draftctl.profile import profile_costs, settle
from draftctl.prompts import load_prompts

MODES = ("probe", "policy", "dense")


@dataclass
class CollectConfig:
    target: str = DEFAULT_TARGET
    draft: str | None = None  # default: the target's shipped draft
    # model (default), model+lookup; lookup or rest:DIR (probe or policy mode only)
    drafter: str | None = None
    prompts: str | None = None  # JSONL or datasets folder; default: draftctl's prompt set
    split: str = "train"
    limit: int | None = None
    per_category: int | None = None  # first N prompts of each task group (after the split)
    mode: str = "dense"  # probe: always K_probe; policy: `controller`; dense: see traces.py
    controller: str = "svip"
    k_probe: int = 16
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    device: str = "cpu"
    dtype: str = "auto"  # auto: the calibrated dtypes (profile)
    pass_shape: str = "auto"  # auto: the profile's fixed shape (bit-exact), see decode
    profile: str | None = None
    out: str = "runs/traces"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise DraftctlError(f"unknown collect mode {self.mode!r}: use {', '.join(MODES)}")
        if self.k_probe < 1:
            raise DraftctlError(f"k_probe must be >= 1, got {self.k_probe}")
        if self.mode == "dense" and self.temperature != 0:
            raise DraftctlError("dense mode replays greedy decoding: set temperature 0")
        drafter = parse_drafter(self.drafter)
        if self.mode == "dense" and not drafter.dense:
            raise DraftctlError("dense mode follows a draft model's greedy chain; with "
                                f"--drafter {drafter.text} use --mode probe or policy")

    def decode_config(self, shape: PassShape) -> DecodeConfig:
        return DecodeConfig(max_new_tokens=self.max_new_tokens, max_draft=self.k_probe,
                            sampling=SamplingConfig(self.temperature, self.top_k, self.top_p),
                            seed=self.seed, pass_shape=shape)


def rank_slice() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment; (0, 1) when run alone."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if not 0 <= rank < world:
        raise DraftctlError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return rank, world


@torch.inference_mode()
def dense_rows(decoder: SpeculativeDecoder, prompt_ids: list[int], k_probe: int, run_id: str,
               prompt_id: int, category: str) -> list[dict]:
    """The draft's greedy ``k_probe``-token continuation at every position of the target's
    greedy output.

    The target's output comes from plain decoding (greedy SD would give the same tokens); one
    teacher-forced target pass over it gives the target's entropy at each round start (and,
    for a feature draft, the target's states it drafts from). The drafter computes the
    continuations of all T positions batched (``continuations``: ``k_probe`` draft passes of
    T tokens instead of T * k_probe single steps).
    """
    output = generate(decoder, prompt_ids, make_controller("none")).output_ids
    if not output:
        return []
    seq = torch.tensor(prompt_ids + output, device=decoder.device)
    n_prompt, n_out = len(prompt_ids), len(output)
    target, drafter = decoder.target, decoder.drafter
    keep = min(n_out + 1, len(seq) - 1)  # logits of positions first .. len(seq) - 2
    first = len(seq) - 1 - keep
    target.reset()
    if drafter.hidden_layers:
        logits, hidden = target.prefill_hidden(seq[:-1], drafter.hidden_layers, keep=keep)
    else:
        logits, hidden = target.prefill(seq[:-1], keep=keep), None
    target.reset()
    # the target's entropy over each round's first input token (the last prompt token, then
    # the output's): position n_prompt + t - 2 predicts it
    entropies = entropy(logits).tolist()
    target_entropy = [entropies[n_prompt + t - 2 - first] if n_prompt + t - 2 >= first else 0.0
                      for t in range(n_out)]
    tokens, stats = drafter.continuations(seq, n_prompt, k_probe, hidden)
    drafted = tokens.tolist()  # (T, k_probe)
    stats = stats.tolist()  # (T, k_probe, STATS)
    seq = seq.tolist()
    rows = []
    for t in range(n_out):
        truth = seq[n_prompt + t:n_prompt + t + k_probe]
        match = next((j for j, (a, b) in enumerate(zip(drafted[t], truth)) if a != b),
                     min(len(truth), k_probe))
        # history features are rebuilt at replay
        state = SequenceState(n_prompt + t, target_entropy=target_entropy[t])
        record = None
        for j in range(k_probe):
            record = make_record(stats[t][j], j + 1, record, state)
            rows.append({"run_id": run_id, "prompt_id": prompt_id, "category": category,
                         "round": t, "position": j + 1, **record.as_row(),
                         "draft_token": drafted[t][j],
                         "target_token": truth[j] if j < len(truth) else -1,
                         "match_len": match, "output_len": n_out})
    return rows


def _run_info(cfg: CollectConfig, drafter: DrafterSpec, draft_spec: str | None, costs: dict,
              world: int) -> dict:
    return {
        "mode": "dense" if cfg.mode == "dense" else "rounds",
        # retrieval (trie rounds), model, model+lookup or lookup (chains)
        "drafter": "retrieval" if drafter.tree else drafter.kind,
        "lookup": asdict(drafter.lookup) if drafter.lookup else None,
        "policy": {"probe": f"static:{cfg.k_probe}", "policy": cfg.controller,
                   "dense": "dense"}[cfg.mode],
        "target": cfg.target, "target_sha256": model_file_sha256(cfg.target),
        "draft": draft_spec if drafter.uses_model else drafter.text,
        "draft_sha256": model_file_sha256(draft_spec) if draft_spec else None,
        "decoding": {"temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p,
                     "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed},
        "k_probe": cfg.k_probe, "prompts": cfg.prompts or "draftctl built-in prompts",
        "split": cfg.split, "world_size": world,
        "feature_schema_version": SCHEMA_VERSION, "feature_names": list(FEATURE_NAMES),
        "packages": {name: version(name) for name in ("torch", "transformers", "pyarrow")}
        | {"draftctl": __version__},
        "cost": costs,
    }


_COMPATIBLE = ("mode", "drafter", "lookup", "policy", "target", "draft", "decoding", "k_probe", "prompts", "split",
               "feature_schema_version")


def open_run_info(out: Path, fresh: dict, write: bool = True) -> dict:
    """The ``run.json`` of a trace folder: the one there, if it describes the same run as
    ``fresh`` (else a clear error naming what differs), or ``fresh``, written atomically."""
    path = out / "run.json"
    if path.is_file():
        info = json.loads(path.read_text())
        changed = [k for k in _COMPATIBLE if info.get(k) != fresh.get(k)]
        if changed:
            raise DraftctlError(f"{out} holds traces of another run (differs in "
                                f"{', '.join(changed)}); use a new --out")
        return info
    if write:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(fresh, indent=2))
        os.replace(tmp, path)
    return fresh


def run_collect(cfg: CollectConfig) -> dict:
    """Collect traces into ``cfg.out``; resumes, skipping prompts whose shard exists."""
    rank, world = rank_slice()
    out = Path(cfg.out)
    (out / "shards").mkdir(parents=True, exist_ok=True)
    if world > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    drafter = parse_drafter(cfg.drafter)
    draft_spec = cfg.draft or default_draft(cfg.target) if drafter.uses_model else None
    if drafter.uses_model and draft_spec is None:
        raise DraftctlError(f"no draft for {cfg.target!r}: pass --draft SPEC")
    prompts = load_prompts(cfg.prompts, cfg.split, cfg.limit,
                           cfg.per_category)[rank::world]
    setup = settle(cfg.target, draft_spec, cfg.device, cfg.dtype, cfg.pass_shape, cfg.profile,
                   need_profile=True)
    target = load_model(cfg.target, cfg.device, setup.target_dtype)
    draft = load_model(draft_spec, target.device, setup.draft_dtype, target=target) \
        if draft_spec else None
    decoder = SpeculativeDecoder.from_loaded(target, drafter.source(target, draft),
                                             cfg.decode_config(setup.shape), drafter.lookup)
    encoded = {p.question_id: encode_prompt(target.tokenizer, p.text) for p in prompts}

    if (out / "run.json").is_file():
        info = open_run_info(out, _run_info(cfg, drafter, draft_spec, None, world))
    else:
        shape = drafter.pass_shape(decoder.target.shape)
        info = open_run_info(out, _run_info(cfg, drafter, draft_spec,
                                            profile_costs(setup, shape), world),
                             write=rank == 0)
        if rank == 0:
            save_config(cfg, out / "collect.yaml")
    run_id = f"{info['policy']}-{info['target_sha256'] or cfg.target}"[:48]

    controller = make_controller(f"static:{cfg.k_probe}" if cfg.mode == "probe"
                                 else cfg.controller)
    digests = {qid: prompt_digest(ids) for qid, ids in encoded.items()}
    todo = []
    for prompt in prompts:
        shard = out / "shards" / f"q{prompt.question_id}.parquet"
        if not shard.exists():
            todo.append(prompt)
        elif shard_prompt_digest(shard) not in (None, digests[prompt.question_id]):
            raise DraftctlError(f"{shard} was collected from another text of prompt "
                                f"{prompt.question_id} (the prompt or the chat template has "
                                "changed since): use a new --out, or delete that shard")
    bar = tqdm(todo, desc=f"collect rank {rank}/{world}", unit="prompt")
    tokens = drafted = accepted = 0
    started = time.perf_counter()
    for prompt in bar:
        ids = encoded[prompt.question_id]
        if cfg.mode == "dense":
            rows = dense_rows(decoder, ids, cfg.k_probe, run_id, prompt.question_id,
                              prompt.category)
            tokens += rows[0]["output_len"] if rows else 0
            drafted += sum(r["position"] == 1 for r in rows)  # first-token agreement
            accepted += sum(r["position"] == 1 and r["match_len"] > 0 for r in rows)
        else:
            rows = []
            for record in decoder.rounds(ids, controller):
                rows += round_rows(record, run_id, prompt.question_id, prompt.category,
                                   drafter.tree)
                tokens += len(record.new_tokens)
                drafted += record.drafted
                accepted += record.n_accepted
        write_shard(rows, out / "shards" / f"q{prompt.question_id}.parquet", info["mode"],
                    digests[prompt.question_id])
        rate = f"{accepted / drafted:.2f}" if drafted else "-"
        bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - started):.1f}", accept=rate)
    return {"rank": rank, "world_size": world, "prompts": len(prompts), "collected": len(todo),
            "out": str(out), "config": asdict(cfg)}
