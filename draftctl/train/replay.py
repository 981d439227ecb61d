"""Offline evaluation of controllers on traces: no model calls.

Dense greedy traces replay exactly: a controller walks the target's greedy output; at each
round start ``t`` it reads the recorded continuation's features token by token and picks a
length ``L``; the round accepts ``min(L, match_len[t])`` and the walk advances by that plus
one (the correction or bonus token), as real greedy SD would.

Round traces (probe or on-policy, e.g. sampling) replay in expectation: the controller picks
``L`` from the recorded round's features; expected accepted tokens are
``sum_{i<=L} prod_{j<=i} a_j`` with ``a_j`` the recorded ``beta`` (sampling) or the realised
``accepted`` outcome (greedy). History features are the recorded ones there.

Retrieval round traces (``--drafter rest:DIR``) hold each round's trie with, per node, whether
its token is the target's argmax after its parent. A controller caps the depth and prunes the
trie node by node as the decoder does (``draftctl.retrieval.features.prune``); the round
accepts the longest path of matching kept nodes. Each recorded round is replayed on its own,
so later rounds are the recorded ones.

Time is modelled from the costs in ``run.json`` (the calibrated profile's, copied at
collection) or from another profile: a round that drafts ``L`` tokens with ``F`` draft
forwards takes ``F t_draft + t_verify(L + 1) + calls t_ctrl``, where ``t_verify(n)`` is the
pass the decoder really runs (``t(M)`` per chunk of a fixed shape M); a retrieval round takes
its recorded lookup time plus ``t_verify(nodes + 1) + calls t_ctrl``; plain decoding takes
``t_verify(1)`` per token in the same shape (the lossless comparison), and the fastest plain
decoding the profile measured gives a second speedup. ``oracle`` drafts exactly what is
accepted and, like the real one, pays for the draft step that meets the first mismatch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import numpy as np

from draftctl.collect.traces import TraceError, read_traces
from draftctl.controllers import Action, Controller, make_controller
from draftctl.decode.cached_lm import PassShape
from draftctl.decode.features import (
    FEATURE_NAMES,
    FeatureRecord,
    SequenceState,
    check_trace_schema,
)
from draftctl.profile import pass_time, profile_costs, read_profile, resolve_setup
from draftctl.prompts import task_of
from draftctl.retrieval.features import accepted_mask, prune, tried_chain


@dataclass(frozen=True)
class CostModel:
    """Seconds per draft step, per target pass, and per controller call.

    t_verify: raw pass times, ``t_verify[n - 1]`` for a pass of n rows; ``shape``: the rows a
    pass of n new tokens really runs at (a fixed shape M costs ``ceil(n / M) * t(M)``), so
    modelled time follows the curve the decoder has. t_plain: a step of the fastest plain
    decoding (another dtype or shape), when known.
    """

    t_draft: float
    t_verify: tuple[float, ...]
    t_controller: float = 0.0
    shape: PassShape = field(default_factory=PassShape)
    t_plain: float | None = None

    @classmethod
    def from_run(cls, info: dict, t_controller: float = 0.0) -> CostModel:
        """From a trace folder's ``run.json`` (traces from before pass shapes: unpadded)."""
        cost = info["cost"]
        shape = PassShape()
        if cost.get("pass_shape", "free") not in ("free", "cheapest"):
            shape = PassShape.parse(cost["pass_shape"])
        elif cost.get("pass_shape") == "cheapest":
            shape = PassShape(pad_to=tuple(cost["pad_to"]))
        return cls(cost.get("t_draft_s", 0.0), tuple(cost["t_verify_s"]), t_controller, shape,
                   cost.get("t_fastest_plain_s"))

    @classmethod
    def from_profile(cls, path: str | Path, t_controller: float = 0.0, dtype: str | None = None,
                     pass_shape: str = "auto", draft_dtype: str | None = None) -> CostModel:
        """From a calibrated profile: the curve of the target's ``dtype`` (default: the one the
        profile chose) at ``pass_shape`` (default: the one it chose for that dtype), as a
        decoding job run with that profile, dtype and shape would have; ``draft_dtype`` sets
        the draft's apart from the target's."""
        setup = resolve_setup(read_profile(path), path, dtype, pass_shape)
        if draft_dtype is not None:
            setup = replace(setup, draft_dtype=draft_dtype)
        return cls.from_run({"cost": profile_costs(setup, setup.shape)}, t_controller)

    @classmethod
    def for_traces(cls, info: dict, profile: str | Path | None = None, dtype: str | None = None,
                   pass_shape: str | None = None) -> CostModel:
        """The cost model for a trace folder's ``run.json``: the costs recorded at collection,
        or ``profile``'s. ``dtype`` or ``pass_shape`` model another dtype or pass shape; with
        no ``profile`` they are read from the profile the traces were collected with, in the
        traces' dtypes unless ``dtype`` says otherwise."""
        if profile is None and dtype is None and pass_shape is None:
            return cls.from_run(info)
        if profile is None:
            recorded = info["cost"].get("profile")
            if not recorded or not Path(recorded).is_file():
                raise TraceError(f"another dtype or pass shape is modelled from a calibrated "
                                 f"profile, and the traces' own ({recorded or 'none recorded'})"
                                 " is not here: pass --profile")
            if dtype is None:
                return cls.from_profile(recorded, dtype=info["cost"].get("target_dtype"),
                                        pass_shape=pass_shape or "auto",
                                        draft_dtype=info["cost"].get("draft_dtype"))
            profile = recorded
        return cls.from_profile(profile, dtype=dtype, pass_shape=pass_shape or "auto")

    @cached_property
    def _curve(self) -> dict[int, float]:
        return dict(enumerate(self.t_verify, 1))

    def verify(self, n: int) -> float:
        """Seconds to verify n new tokens (the round's last token and its drafts)."""
        return pass_time(self._curve, self.shape, n)

    def step_costs(self, n: int) -> list[float]:
        """What drafting token k + 1 after k tokens adds to a round (a draft step and the
        longer verification), in plain decoding steps, for k = 1..n: the cost stop rule's
        per-position scale. Negative where a longer pass is faster (a cost curve's step)."""
        return [(self.t_draft + self.verify(k + 2) - self.verify(k + 1)) / self.verify(1)
                for k in range(1, n + 1)]

    def round_time(self, drafted: int, draft_forwards: int, calls: int) -> float:
        return (draft_forwards * self.t_draft + self.verify(drafted + 1)
                + calls * self.t_controller)


@dataclass
class ReplayResult:
    spec: str
    rounds: int = 0
    tokens: float = 0.0
    drafted: int = 0
    accepted: float = 0.0
    draft_forwards: int = 0
    controller_calls: int = 0
    time_s: float = 0.0
    ar_time_s: float = 0.0
    fastest_ar_time_s: float = 0.0
    per_category: dict = field(default_factory=dict)

    def add(self, other: ReplayResult) -> None:
        for name in ("rounds", "tokens", "drafted", "accepted", "draft_forwards",
                     "controller_calls", "time_s", "ar_time_s", "fastest_ar_time_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def close(self, cost: CostModel) -> ReplayResult:
        """Set the plain-decoding times of this many tokens."""
        self.ar_time_s = self.tokens * cost.verify(1)
        self.fastest_ar_time_s = self.tokens * cost.t_plain if cost.t_plain else 0.0
        return self

    def summary(self) -> dict:
        return {"spec": self.spec, "tau": self.tokens / max(1, self.rounds),
                "rounds": self.rounds, "tokens": self.tokens, "drafted": self.drafted,
                "wasted": self.drafted - self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
                "target_forwards": self.rounds, "draft_forwards": self.draft_forwards,
                "modelled_time_s": self.time_s,
                "modelled_speedup": self.ar_time_s / self.time_s if self.time_s else None,
                "modelled_speedup_vs_fastest": self.fastest_ar_time_s / self.time_s
                if self.time_s and self.fastest_ar_time_s else None}


def _choose_length(controller: Controller | None, recorded: Sequence[FeatureRecord],
                   budget: int, oracle_len: int) -> tuple[list, int, int]:
    """Run the controller over one round's recorded records: (records kept, forwards, calls)."""
    if controller is None:  # oracle: the draft step that meets the first mismatch is spent
        length = min(budget, oracle_len)
        return [None] * length, length + (length < budget), 0
    records, calls = [], 0
    for record in recorded[:min(budget, controller.max_draft())]:
        if controller.reads_features:
            calls += 1
            action = controller.decide(record)
            if action is Action.DISCARD:
                return records, len(records) + 1, calls
            records.append(record)
            if action is Action.STOP:
                break
        else:
            records.append(record)
    return records, len(records), calls


def _prompt_groups(table) -> dict[int, dict[str, np.ndarray]]:
    columns = {name: table.column(name).to_numpy() for name in table.column_names
               if name not in ("run_id", "category")}
    categories = table.column("category").to_pylist()
    within = columns["node"] if "node" in columns else columns["position"]
    order = np.lexsort((within, columns["round"], columns["prompt_id"]))
    groups: dict[int, dict] = {}
    prompt_ids = columns["prompt_id"][order]
    bounds = np.flatnonzero(np.diff(prompt_ids)) + 1
    for chunk in np.split(order, bounds):
        if len(chunk) == 0:
            continue
        group = {name: values[chunk] for name, values in columns.items()}
        group["category"] = categories[chunk[0]]
        groups[int(group["prompt_id"][0])] = group
    return groups


def _records(group: dict) -> list[FeatureRecord]:
    """The recorded feature records of a prompt's rows, built once per trace set."""
    if "records" not in group:
        features = np.stack([group[name] for name in FEATURE_NAMES], axis=1)
        group["records"] = [FeatureRecord.from_vector(v) for v in features]
    return group["records"]


def replay_dense_prompt(group: dict, controller: Controller | None, cost: CostModel,
                        k_probe: int, max_new_tokens: int, spec: str) -> ReplayResult:
    """The walk over a dense trace: each position's recorded continuation, with the history
    features (``prev_*``, ``accept_rate``) of the walk itself."""
    recorded = _records(group)
    match = group["match_len"][::k_probe]
    context = group["seq_pos"][::k_probe].astype(int)
    total = int(group["output_len"][0])
    result = ReplayResult(spec)
    if controller is not None:
        controller.reset()
    state = SequenceState(int(context[0]))
    t = 0
    while t < total:
        budget = min(k_probe, max_new_tokens - t - 1)
        if controller is None:  # the oracle's own cap: the reference's end
            budget = min(budget, total - t - 1)
        history = {"prev_accepted": state.prev_accepted, "prev_drafted": state.prev_drafted,
                   "accept_rate": state.accept_rate}
        here = [replace(r, **history) for r in recorded[t * k_probe:(t + 1) * k_probe]]
        records, forwards, calls = _choose_length(controller, here, max(budget, 0),
                                                  int(match[t]))
        drafted = len(records)
        accepted = min(drafted, int(match[t]))
        if controller is not None:
            controller.observe(records, accepted)
        produced = min(accepted + 1, total - t)
        result.rounds += 1
        result.tokens += produced
        result.drafted += drafted
        result.accepted += accepted
        result.draft_forwards += forwards
        result.controller_calls += calls
        result.time_s += cost.round_time(drafted, forwards, calls)
        state = state.after_round(int(context[t]) + produced, drafted, accepted)
        t += produced
    return result.close(cost)


def replay_rounds_prompt(group: dict, controller: Controller | None, cost: CostModel,
                         greedy: bool, spec: str) -> ReplayResult:
    """Each recorded round on its own, its records as recorded (history features included)."""
    result = ReplayResult(spec)
    if controller is not None:
        controller.reset()
    bounds = np.flatnonzero(np.diff(group["round"])) + 1
    for idx in np.split(np.arange(len(group["round"])), bounds):
        accept = group["accepted"][idx].astype(float) if greedy else group["beta"][idx]
        realised = int(group["round_accepted"][idx[0]])
        recorded = _records(group)
        records, forwards, calls = _choose_length(controller, [recorded[k] for k in idx],
                                                  len(idx), realised)
        drafted = len(records)
        expected = float(np.cumprod(accept[:drafted]).sum()) if drafted else 0.0
        if controller is None:
            expected = float(drafted)
        if controller is not None:
            controller.observe(records, round(expected))
        result.rounds += 1
        result.tokens += expected + 1
        result.drafted += drafted
        result.accepted += expected
        result.draft_forwards += forwards
        result.controller_calls += calls
        result.time_s += cost.round_time(drafted, forwards, calls)
    return result.close(cost)


def replay_tree_prompt(group: dict, controller: Controller | None, cost: CostModel,
                       spec: str) -> ReplayResult:
    result = ReplayResult(spec)
    if controller is not None:
        controller.reset()
    records_all = _records(group)
    bounds = np.flatnonzero(np.diff(group["round"])) + 1
    for idx in np.split(np.arange(len(group["round"])), bounds):
        lookup_s = float(group["draft_time_s"][idx[0]])
        idx = idx[group["node"][idx] >= 0]  # an empty trie has a placeholder row only
        parents = group["parent"][idx].astype(int)
        match = group["target_top1_match"][idx].astype(bool)
        records = [records_all[k] for k in idx]
        calls = 0
        if controller is None:  # oracle: exactly the accepted path
            keep = accepted_mask(parents, match)
        else:
            keep = group["position"][idx] <= controller.max_draft()  # depth cap
            if controller.reads_features and keep.any():
                keep, calls = prune(records, parents, controller, eligible=keep)
        path = np.flatnonzero(accepted_mask(parents, match, keep)).tolist()
        drafted, n_accepted = int(keep.sum()), len(path)
        if controller is not None:
            controller.observe([records[k] for k in tried_chain(path, parents, keep)],
                               n_accepted)
        result.rounds += 1
        result.tokens += n_accepted + 1
        result.drafted += drafted
        result.accepted += n_accepted
        result.controller_calls += calls
        result.time_s += lookup_s + cost.verify(drafted + 1) + calls * cost.t_controller
    return result.close(cost)


class TraceSet:
    """A trace folder read once, for replaying many controllers."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        info_path = folder / "run.json"
        if not info_path.is_file():
            raise TraceError(f"{folder} has no run.json: not a trace folder")
        self.folder = folder
        self.info = json.loads(info_path.read_text())
        check_trace_schema(self.info, folder)
        self.groups = _prompt_groups(read_traces(folder))

    def cost_model(self, profile: str | Path | None = None, dtype: str | None = None,
                   pass_shape: str | None = None) -> CostModel:
        """``CostModel.for_traces`` of these traces, refusing a ``profile`` measured for
        another target or draft than theirs (by name, or by weights' hash where both record
        it)."""
        if profile is not None:
            made, info = read_profile(profile), self.info
            draft = made["draft"] or {}
            theirs = [("target", made["target"], info["target"], info.get("target_sha256"))]
            if info["draft"] is not None:
                theirs.append(("draft", draft, info["draft"], info.get("draft_sha256")))
            for role, entry, spec, sha in theirs:
                if entry.get("spec") != spec or (sha and entry.get("sha256")
                                                 and entry["sha256"] != sha):
                    raise TraceError(
                        f"profile {profile} was measured for {role} {entry.get('spec')!r} "
                        f"(sha256 {str(entry.get('sha256'))[:12]}), but the traces in "
                        f"{self.folder} are of {spec!r} (sha256 {str(sha)[:12]})")
        return CostModel.for_traces(self.info, profile, dtype, pass_shape)


def replay(traces: str | Path | TraceSet, controllers: Sequence[str | Controller],
           prompt_ids: set[int] | None = None,
           t_controller: dict[str, float] | None = None,
           cost: CostModel | None = None) -> list[dict]:
    """Replay each controller (a spec, ``oracle``, or a built controller) over traces; time
    is modelled with ``cost`` (default: the costs recorded at collection)."""
    traces = traces if isinstance(traces, TraceSet) else TraceSet(traces)
    info, groups = traces.info, traces.groups
    if prompt_ids is not None:
        groups = {k: v for k, v in groups.items() if k in prompt_ids}
    if not groups:
        raise TraceError(f"no traces of the selected prompts in {traces.folder}")
    greedy = info["decoding"]["temperature"] == 0
    base_cost = cost or CostModel.from_run(info)
    results = []
    for item in controllers:
        if isinstance(item, Controller):
            controller, spec = item, item.spec
        else:
            controller, spec = (None, "oracle") if item == "oracle" else (make_controller(item),
                                                                          item)
        spec_cost = replace(base_cost, t_controller=(t_controller or {}).get(spec, 0.0))
        total = ReplayResult(spec)
        by_category: dict[str, ReplayResult] = {}
        for group in groups.values():
            if info.get("drafter") == "retrieval":
                part = replay_tree_prompt(group, controller, spec_cost, spec)
            elif info["mode"] == "dense":
                part = replay_dense_prompt(group, controller, spec_cost, info["k_probe"],
                                           info["decoding"]["max_new_tokens"], spec)
            else:
                part = replay_rounds_prompt(group, controller, spec_cost, greedy, spec)
            total.add(part)
            by_category.setdefault(task_of(group["category"]), ReplayResult(spec)).add(part)
        summary = total.summary()
        summary["per_category"] = {c: r.summary() for c, r in sorted(by_category.items())}
        results.append(summary)
    return results
