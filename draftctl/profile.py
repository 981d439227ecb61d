"""Calibrated cost profiles: what a pass over n new tokens costs on this machine, per dtype,
and the dtypes and pass shape that follow from it.

``calibrate`` measures, with warm-up and interleaved repetitions at a realistic cache length,
the target's pass time for n = 1..N new tokens and the draft's one-token step, for every
candidate dtype. From these curves it chooses:

- the draft's dtype: the cheapest step (it does not change what the target outputs);
- per target dtype, the pass shape: the fixed shape M under which speculative decoding runs
  fastest, modelled with an i.i.d. per-token acceptance ``acceptance`` and the best static K,
  or the exact shape (row-invariant kernels, CPU) where it is checked exact here and models at
  least as fast (within ``TIE_TOLERANCE``: it also spares plain decoding the padding);
- the target's dtype: the one whose best M gives the fastest modelled decoding.

A profile is a JSON file, saved under ``profile_dir()`` keyed by the model pair, device and
thread count; ``decode``, ``collect``, ``bench`` and ``replay`` read it (``settle``), so the
modelled and the measured speed use one curve. ``--profile PATH`` names another file; a
profile made for other models, or lacking the dtype asked for, is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftctl.console import notice
from draftctl.decode import kernels
from draftctl.decode.cached_lm import CachedLM, PassShape, shape_is_exact
from draftctl.decode.features import SequenceState
from draftctl.decode.loop import synchronize
from draftctl.decode.verify import SamplingConfig
from draftctl.drafters import model_drafter
from draftctl.errors import DraftctlError
from draftctl.models import (
    DEFAULT_TARGET,
    default_draft,
    encode_prompt,
    load_model,
    model_file_sha256,
    resolve_device,
    resolve_dtype,
)

FORMAT = "draftctl-profile/1"
# what calibrate times, revised when that changes (2: a draft model steps on its packed view,
# as model_drafter drafts), so that profiles saved before are measured again
MEASUREMENT = 2
MIN_ROWS = 2  # a fixed shape of one row would verify each draft token in a pass of its own


class ProfileError(DraftctlError):
    """A profile that does not fit the models, device or dtype it is used with."""


def profile_dir() -> Path:
    """``$DRAFTCTL_PROFILES``, else ``~/.cache/draftctl/profiles``."""
    env = os.environ.get("DRAFTCTL_PROFILES")
    return Path(env) if env else Path.home() / ".cache" / "draftctl" / "profiles"


@dataclass
class CalibrateConfig:
    target: str = DEFAULT_TARGET
    draft: str | None = None  # default: the target's shipped draft; "none": no draft
    device: str = "auto"
    dtypes: list[str] = field(default_factory=list)  # default: every dtype this device runs
    max_n: int = 16
    context: int = 256  # cache length the passes run at
    repeats: int = 7
    # per-token acceptance the pass shape and dtype are chosen for: the shipped feature draft
    # with context lookup drafts its first token right 0.57 of the time and the next 0.69
    # (Spec-Bench test, 2026-12-02), and copied runs make long drafts pay more than i.i.d.
    # acceptance models
    acceptance: float = 0.7
    out: str | None = None  # default: the profile cache (profile_dir())

    def __post_init__(self) -> None:
        if self.max_n < MIN_ROWS:
            raise ProfileError(f"max_n must be >= {MIN_ROWS}, got {self.max_n}")
        if self.repeats < 1 or self.context < 1:
            raise ProfileError("repeats and context must be >= 1")
        if not 0 < self.acceptance < 1:
            raise ProfileError(f"acceptance must be in (0, 1), got {self.acceptance}")


def candidate_dtypes(device: torch.device, asked: list[str] | None = None) -> list[str]:
    """The dtypes to measure: float32 and, where the device computes it, bfloat16."""
    names = list(asked) if asked else ["float32", "bfloat16"]
    chosen = []
    for name in names:
        dtype = resolve_dtype(name, device)  # falls back (with a notice) where unsupported
        label = str(dtype).removeprefix("torch.")
        if label not in chosen:
            chosen.append(label)
    return chosen


TIE_TOLERANCE = 0.05  # modelled rates this close count as equal (timing noise)


def expected_tokens(k: int, alpha: float) -> float:
    """Tokens per round with k drafts and i.i.d. acceptance alpha (bonus included)."""
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def pass_time(t_ms: dict[int, float], shape: PassShape, n: int) -> float:
    """Milliseconds to feed n tokens under ``shape``, from a curve of raw pass times."""
    top = max(t_ms)

    def raw(rows: int) -> float:
        if rows in t_ms:
            return t_ms[rows]
        slope = (t_ms[top] - t_ms[1]) / max(1, top - 1)  # linear past the measured range
        return t_ms[top] + slope * (rows - top)

    if shape.fixed:
        return -(-n // shape.fixed) * raw(shape.fixed)
    return raw(shape.rows(n))


def best_static(t_ms: dict[int, float], shape: PassShape, t_draft: float,
                alpha: float, max_k: int) -> tuple[int, float]:
    """(K, tokens per ms) of the fastest static K <= max_k under ``shape``."""
    rates = {k: expected_tokens(k, alpha) / (pass_time(t_ms, shape, k + 1) + k * t_draft)
             for k in range(max_k + 1)}
    k = max(rates, key=rates.get)
    return k, rates[k]


def rank_rows(t_ms: dict[int, float], t_draft: float, alpha: float,
              tolerance: float = TIE_TOLERANCE) -> list[tuple[int, int, float]]:
    """(M, K, tokens per ms) for every fixed shape M and its best static K, fastest first.

    Shapes whose modelled rate is within ``tolerance`` of the fastest are ranked as tied, the
    smallest first: two calibrations of one machine differ by more than that (measured: a
    4-row pass at 101 and 124 ms in two runs), and a smaller M costs less when the draft is
    poor and for plain decoding, which every pass shape taxes."""
    ranked = []
    for rows in range(MIN_ROWS, max(t_ms) + 1):
        k, rate = best_static(t_ms, PassShape(fixed=rows), t_draft, alpha, rows - 1)
        ranked.append((rows, k, rate))
    best = max(rate for _, _, rate in ranked)
    return sorted(ranked, key=lambda item: (item[2] < best * (1 - tolerance),
                                            item[0] if item[2] >= best * (1 - tolerance)
                                            else -item[2]))


def choose_rows(t_ms: dict[int, float], t_draft: float, alpha: float,
                inexact: frozenset[int] = frozenset()) -> tuple[int, int, float]:
    """(M, K, tokens per ms): the fastest fixed shape not known to be inexact on this machine,
    and the static K under it."""
    ranked = rank_rows(t_ms, t_draft, alpha)
    return next((r for r in ranked if r[0] not in inexact), ranked[0])


EXACT = PassShape(row_invariant=True)


def choose_shape(t_ms: dict[int, float], t_draft: float, alpha: float,
                 inexact: frozenset[int] = frozenset(),
                 exact_curve: dict[int, float] | None = None) -> tuple[str, int, int, float]:
    """(pass shape, M, K, tokens per ms): the best fixed shape M (``choose_rows``; the
    fallback where the exact shape cannot run), and the shape chosen: ``fixed:M``, or the exact
    shape when its curve is given (measured and checked exact) and models within
    ``TIE_TOLERANCE`` of it or faster, with K and the rate of the shape chosen."""
    rows, k, rate = choose_rows(t_ms, t_draft, alpha, inexact)
    if exact_curve:
        k_exact, rate_exact = best_static(exact_curve, EXACT, t_draft, alpha,
                                          max(exact_curve) - 1)
        if rate_exact >= rate * (1 - TIE_TOLERANCE):
            return "exact", rows, k_exact, rate_exact
    return f"fixed:{rows}", rows, k, rate


def _inexact(entry: dict) -> frozenset[int]:
    return frozenset(int(m) for m, ok in entry.get("rows_checked", {}).items() if not ok)


def _exact_curve(entry: dict) -> dict[int, float] | None:
    """The exact shape's curve, where it was measured and checked exact."""
    shape = entry.get("exact_shape")
    return curve(shape) if shape and shape["exact"] else None


def shape_curve(entry: dict, shape: PassShape) -> dict[int, float]:
    """The raw pass times a target dtype's entry gives for ``shape``: the exact shape runs
    other kernels, with a curve of its own."""
    if not shape.row_invariant:
        return curve(entry)
    if not entry.get("exact_shape"):
        raise ProfileError("the profile has no curve for the exact pass shape (measured only "
                           "where the CPU supports it): run draftctl calibrate, or use fixed:M")
    return curve(entry["exact_shape"])


def cheapest_pad(t_ms: dict[int, float]) -> dict[int, int]:
    """For each n, the cheapest measured m >= n (the opt-in, not bit-exact ``cheapest`` shape)."""
    return {n: min((m for m in t_ms if m >= n), key=lambda m: (t_ms[m], m)) for n in t_ms}


def _context_ids(tokenizer, length: int) -> list[int]:
    """Real text (draftctl's own prompts) repeated to ``length`` tokens."""
    from draftctl.prompts import load_prompts

    ids: list[int] = []
    for prompt in load_prompts(None, "train"):
        ids += encode_prompt(tokenizer, prompt.text)
        if len(ids) >= length:
            break
    return (ids * (1 + length // max(1, len(ids))))[:length]


def _median_ms(times: list[float]) -> float:
    return round(1e3 * statistics.median(times), 3)


@torch.inference_mode()
def measure(cfg: CalibrateConfig, progress: bool = True) -> dict:
    """Load the pair in every candidate dtype and time their passes, interleaved: the target's
    pass over n new tokens, and the drafter's proposal of one token (its step with the work
    around it: the distribution, its features), both with a warm cache of ``context``."""
    device = resolve_device(cfg.device)
    dtypes = candidate_dtypes(device, cfg.dtypes)
    draft_spec = None if cfg.draft == "none" else cfg.draft or default_draft(cfg.target)
    every, lms, checks = {}, {}, {}
    for dtype in dtypes:
        target = load_model(cfg.target, device, dtype)
        vocab = len(target.tokenizer)
        ids = torch.tensor(_context_ids(target.tokenizer, cfg.context + cfg.max_n),
                           device=device)
        context, fresh = ids[:cfg.context], ids[cfg.context:]
        lm = CachedLM(target.model, vocab)
        lm.prefill(context)
        lms[dtype] = lm
        checks[dtype] = torch.tensor(_context_ids(target.tokenizer, 64), device=device)
        for n in range(1, cfg.max_n + 1):
            every["target", dtype, n] = _target_pass(lm, fresh[:n], cfg.context)
        if kernels.supported(target.model) is None:
            exact_lm = CachedLM(target.model, vocab, EXACT)
            exact_lm.prefill(context)
            for n in range(1, cfg.max_n + 1):
                every["exact", dtype, n] = _target_pass(exact_lm, fresh[:n], cfg.context)
        if draft_spec:
            draft = load_model(draft_spec, device, dtype, target=target)
            every["draft", dtype, 1] = _draft_step(model_drafter(draft, vocab, SamplingConfig()),
                                                   target.model, context)
        every["batch", dtype, 1] = _batch_pass(target.model, ids[:BATCH_SHAPE[1]])
    times: dict[tuple, list[float]] = {}

    def timed(key) -> None:
        synchronize(device)
        start = time.perf_counter()
        every[key]()
        synchronize(device)
        times.setdefault(key, []).append(time.perf_counter() - start)

    for key in every:  # warm-up: kernel set-up for every shape, untimed
        timed(key)
    times.clear()
    models = list(dict.fromkeys(key[:2] for key in every))
    from tqdm import tqdm

    for rep in tqdm(range(cfg.repeats), desc="calibrate", unit="round", disable=not progress):
        # each model's sweep runs back to back, as its passes do in decoding; models and
        # pass sizes take turns in a rotating order, so that machine noise hits all alike
        for model in models[rep % len(models):] + models[:rep % len(models)]:
            keys = [key for key in every if key[:2] == model]
            for key in keys[rep % len(keys):] + keys[:rep % len(keys)]:
                timed(key)
    curves: dict[tuple, dict[int, float]] = {}
    for (kind, dtype, n), values in times.items():
        curves.setdefault((kind, dtype), {})[n] = _median_ms(values)
    curves = {key: dict(sorted(c.items())) for key, c in curves.items()}
    drafts = [d for d in dtypes if ("draft", d) in curves]
    exact = {}
    for dtype, lm in lms.items():  # check shapes from the fastest down until one is exact
        t_draft = min(curves["draft", d][1] for d in drafts) if drafts else 0.1 * curves[
            "target", dtype][1]
        exact[dtype] = {}
        for rows, _, _ in rank_rows(curves["target", dtype], t_draft, cfg.acceptance):
            exact[dtype][rows] = shape_is_exact(lm.model, lm.vocab_size, PassShape(fixed=rows),
                                                checks[dtype])
            if exact[dtype][rows]:
                break
        if ("exact", dtype) in curves:
            exact[dtype]["exact"] = shape_is_exact(lm.model, lm.vocab_size, EXACT, checks[dtype])
    return {"device": device, "draft_spec": draft_spec, "curves": curves, "dtypes": dtypes,
            "exact": exact}


BATCH_SHAPE = (16, 64)  # sequences x tokens of the batched pass batch jobs are timed by


def _batch_pass(model: torch.nn.Module, tokens: torch.Tensor):
    """One forward over ``BATCH_SHAPE[0]`` copies of ``tokens``, no cache: the work of batch
    jobs (batched generation's prefill and steps, teacher-forced labelling)."""
    batch = tokens[None].expand(BATCH_SHAPE[0], -1)

    @torch.inference_mode()
    def run() -> None:
        model(input_ids=batch, use_cache=False, logits_to_keep=1)
    return run


def _target_pass(lm: CachedLM, tokens: torch.Tensor, context: int):
    """One target pass over ``tokens`` after ``context`` cached tokens, undone after."""
    def run() -> None:
        lm.forward(tokens, keep=len(tokens))
        lm.truncate(context)
    return run


def _draft_step(drafter, target: torch.nn.Module, context: torch.Tensor):
    """One proposal of one token after ``context``, as a round's first step (the drafter has
    seen all but the last token), undone after."""
    from draftctl.controllers import make_controller

    seen = len(context) - 1
    hidden = None
    if drafter.hidden_layers:  # the target's states, as the verification pass hands them over
        states = target(context[None], output_hidden_states=True).hidden_states
        hidden = torch.stack([states[k][0] for k in drafter.hidden_layers], dim=1)
        drafter.accepted(seen - 1, hidden[:seen - 1])
    else:
        drafter.lm.prefill(context[:seen])
    controller = make_controller("static:1")
    generator = torch.Generator(context.device)
    state = SequenceState(len(context))

    def run() -> None:
        drafter.accepted(seen, hidden[seen - 1:seen] if hidden is not None else None)
        drafter.propose(context, 1, controller, state, generator)
    return run


def build_profile(cfg: CalibrateConfig, measured: dict) -> dict:
    """The profile's choices from measured curves (pure: no model calls)."""
    curves, dtypes, device = measured["curves"], measured["dtypes"], measured["device"]
    draft_spec = measured["draft_spec"]
    if draft_spec:
        draft_dtype = min(dtypes, key=lambda d: curves["draft", d][1])
        t_draft = curves["draft", draft_dtype][1]
    else:  # no draft: shapes are chosen for one that costs a tenth of a target step
        draft_dtype = None
    by_dtype = {}
    for dtype in dtypes:
        t_ms = curves["target", dtype]
        td = t_draft if draft_spec else 0.1 * t_ms[1]
        checked = measured["exact"][dtype]
        fixed = {m: ok for m, ok in checked.items() if m != "exact"}
        entry = {"t_ms": _keyed(t_ms)}
        if ("exact", dtype) in curves:
            entry["exact_shape"] = {"t_ms": _keyed(curves["exact", dtype]),
                                    "exact": checked["exact"],
                                    "plain_tokens_per_s": round(1e3 / curves["exact", dtype][1],
                                                                2)}
        shape, rows, k, rate = choose_shape(t_ms, td, cfg.acceptance,
                                            frozenset(m for m, ok in fixed.items() if not ok),
                                            _exact_curve(entry))
        by_dtype[dtype] = entry | {
            "pass_shape": shape, "rows": rows,
            "exact": checked["exact"] if shape == "exact" else fixed.get(rows, False),
            "rows_checked": {str(m): ok for m, ok in fixed.items()},
            "static_k": k,
            "modelled_tokens_per_s": round(1e3 * rate, 2),
            "plain_fixed_tokens_per_s": round(1e3 / t_ms[rows], 2),
            "plain_free_tokens_per_s": round(1e3 / t_ms[1], 2)}
    target_dtype = max(dtypes, key=lambda d: by_dtype[d]["modelled_tokens_per_s"])
    fastest = min(dtypes, key=lambda d: curves["target", d][1])
    chosen = by_dtype[target_dtype]
    shape = PassShape.parse(chosen["pass_shape"])
    return {
        "format": FORMAT,
        "target": {"spec": cfg.target, "sha256": model_file_sha256(cfg.target),
                   "dtype": target_dtype, "t_ms": _keyed(shape_curve(chosen, shape)),
                   "by_dtype": by_dtype},
        "draft": None if not draft_spec else {
            "spec": draft_spec, "sha256": model_file_sha256(draft_spec), "dtype": draft_dtype,
            "t_ms": _keyed(curves["draft", draft_dtype]),
            "by_dtype": {d: {"t_ms": _keyed(curves["draft", d])} for d in dtypes}},
        "pass_shape": chosen["pass_shape"],
        "pad_to": {str(n): shape.rows(n) for n in range(1, cfg.max_n + 1)},
        # batch jobs (distill's responses and labels, the chat corpus, the prompt pool) run
        # the target in the dtype of the fastest batched pass, whatever decoding chose
        "batch": {"dtype": min(dtypes, key=lambda d: curves["batch", d][1]),
                  "shape": list(BATCH_SHAPE),
                  "ms": {d: curves["batch", d][1] for d in dtypes}},
        "fastest_plain": {"dtype": fastest, "pass_shape": "free",
                          "t_ms": curves["target", fastest][1]},
        "acceptance": cfg.acceptance, "context": cfg.context, "repeats": cfg.repeats,
        "device": str(device), "device_name": device_name(device),
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "made": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _keyed(curve: dict[int, float]) -> dict[str, float]:
    return {str(n): t for n, t in sorted(curve.items())}


def curve(entry: dict) -> dict[int, float]:
    """A profile's ``t_ms`` mapping with integer keys."""
    return {int(n): float(t) for n, t in entry["t_ms"].items()}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def default_path(target: str, draft: str | None, device: torch.device) -> Path:
    """Where the profile of this pair on this device and thread count lives (measured by
    this ``MEASUREMENT``)."""
    key = "|".join(str(x) for x in (target, model_file_sha256(target), draft,
                                    draft and model_file_sha256(draft), device_name(device),
                                    device.type, torch.get_num_threads(), torch.__version__,
                                    MEASUREMENT))
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    name = f"{_slug(target)}--{_slug(draft or 'none')}--{device.type}-" \
           f"{torch.get_num_threads()}t-{digest}.json"
    return profile_dir() / name


def _slug(spec: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(spec).name)[:40]


def calibrate(cfg: CalibrateConfig, progress: bool = True) -> tuple[dict, Path]:
    """Measure, choose, and save; returns (profile, path)."""
    profile = build_profile(cfg, measure(cfg, progress))
    draft = profile["draft"]["spec"] if profile["draft"] else None
    path = Path(cfg.out) if cfg.out else default_path(cfg.target, draft,
                                                       resolve_device(cfg.device))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(profile, indent=2))
    os.replace(tmp, path)
    return profile, path


def read_profile(path: str | Path) -> dict:
    path = Path(path)
    try:
        profile = json.loads(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"profile not found: {path} (make one with draftctl calibrate)") \
            from None
    except json.JSONDecodeError as err:
        raise ProfileError(f"profile {path} is not valid JSON: {err}") from None
    if not isinstance(profile, dict) or profile.get("format") != FORMAT:
        raise ProfileError(f"{path} is not a draftctl profile (format {FORMAT})")
    return profile


def check_profile(profile: dict, path: str | Path, target: str, draft: str | None,
                  device: torch.device) -> None:
    """Refuse a profile measured for other models or another device."""
    made = profile["target"]
    if made["spec"] != target or made["sha256"] != model_file_sha256(target):
        raise ProfileError(f"profile {path} was measured for target {made['spec']!r}, not "
                           f"{target!r} (or its weights changed): run draftctl calibrate")
    made_draft = profile["draft"]["spec"] if profile["draft"] else None
    if draft is not None and made_draft != draft:
        raise ProfileError(f"profile {path} was measured with draft {made_draft!r}, not "
                           f"{draft!r}: run draftctl calibrate --draft {draft}")
    if torch.device(profile["device"]).type != device.type:
        raise ProfileError(f"profile {path} was measured on {profile['device']}, not "
                           f"{device.type}")


@dataclass(frozen=True)
class Setup:
    """What a decoding job runs with: the target's and the draft's dtype, the target's pass
    shape, and the profile these came from (None when nothing needed one)."""

    target_dtype: str
    draft_dtype: str
    shape: PassShape
    profile: dict | None = None
    profile_path: str | None = None

    def describe(self) -> dict:
        return {"target_dtype": self.target_dtype, "draft_dtype": self.draft_dtype,
                "pass_shape": self.shape.describe(), "bit_exact": self.shape.exact,
                "profile": self.profile_path}

    def fastest_plain(self) -> tuple[str, PassShape]:
        """(dtype, shape) of the fastest plain decoding the profile measured (without a
        profile: the target's dtype, unpadded)."""
        if self.profile is None:
            return self.target_dtype, PassShape()
        return self.profile["fastest_plain"]["dtype"], PassShape()

    def fastest_plain_describe(self) -> dict:
        dtype, shape = self.fastest_plain()
        return {"dtype": dtype, "pass_shape": shape.describe()}


def settle(target: str, draft: str | None, device: str | torch.device = "auto",
           dtype: str = "auto", pass_shape: str = "auto", profile: str | None = None,
           progress: bool = True, need_profile: bool = False) -> Setup:
    """Resolve dtypes and the pass shape for a job, reading (or making, once) the profile.

    A profile is needed for ``dtype`` auto, for ``pass_shape`` auto or cheapest, and when
    ``need_profile`` (a job that models time); if none exists for this pair, device and thread
    count, one is calibrated now and saved.
    """
    dev = resolve_device(device)
    explicit = None if dtype == "auto" else str(resolve_dtype(dtype, dev)).removeprefix("torch.")
    needed = need_profile or profile is not None or explicit is None or pass_shape in (
        "auto", "cheapest")
    if not needed:
        return Setup(explicit, explicit, PassShape.parse(pass_shape))
    if profile is not None:
        path = Path(profile)
        data = read_profile(path)
    else:
        path = default_path(target, draft, dev)
        if path.is_file():
            data = read_profile(path)
        else:
            notice(f"no calibrated profile for {target} with draft {draft} on this {dev.type} "
                   f"({torch.get_num_threads()} threads): measuring it now, once "
                   f"(draftctl calibrate redoes it)")
            data, path = calibrate(CalibrateConfig(target=target, draft=draft or "none",
                                                   device=str(dev)), progress)
    check_profile(data, path, target, draft, dev)
    return resolve_setup(data, path, explicit, pass_shape)


def resolve_setup(data: dict, path: str | Path, dtype: str | None = None,
                  pass_shape: str = "auto") -> Setup:
    """What a profile gives a job asking for ``dtype`` (a dtype name; None: the profile's
    choice, and the draft's own) and ``pass_shape`` (``auto``: the one chosen for that dtype;
    ``cheapest``: each pass padded to its cheapest measured size; else ``PassShape.parse``'s)."""
    made = data["target"]["by_dtype"]
    if dtype is not None and dtype not in made:
        raise ProfileError(f"profile {path} was measured in {', '.join(made)}, not {dtype}: "
                           f"run draftctl calibrate --dtypes {dtype}")
    target_dtype = dtype or data["target"]["dtype"]
    if dtype is not None:
        draft_dtype = dtype
    elif data["draft"] is not None:
        draft_dtype = data["draft"]["dtype"]
    else:
        draft_dtype = target_dtype
    entry = made[target_dtype]
    if pass_shape == "auto":
        shape = PassShape.parse(entry.get("pass_shape", f"fixed:{entry['rows']}"))
    elif pass_shape == "cheapest":
        pad = cheapest_pad(curve(entry))
        shape = PassShape(pad_to=tuple(pad[n] for n in sorted(pad)))
    else:
        shape = PassShape.parse(pass_shape)
    if shape.row_invariant:
        shape_curve(entry, shape)  # refuses a profile without the exact shape's curve
        if not entry["exact_shape"]["exact"]:
            notice(f"the exact pass shape gave other logits for other splits when {path} was "
                   "calibrated: greedy SD may differ from plain decoding here (use fixed:M)")
    return Setup(target_dtype, draft_dtype, shape, data, str(path))


def profile_costs(setup: Setup, shape: PassShape) -> dict:
    """The costs ``replay`` models time with, from the calibrated profile: the target's raw
    pass times (seconds, n = 1..N new tokens) in its dtype, the pass shape it runs at, a draft
    step, and the fastest plain decoding's step."""
    profile = setup.profile
    target = shape_curve(profile["target"]["by_dtype"][setup.target_dtype], shape)
    costs = {"t_verify_s": [target[n] / 1e3 for n in sorted(target)],
             "t_target_s": target[1] / 1e3, "pass_shape": shape.describe(),
             "pad_to": [shape.rows(n) for n in sorted(target)],
             "t_fastest_plain_s": profile["fastest_plain"]["t_ms"] / 1e3,
             "target_dtype": setup.target_dtype, "draft_dtype": setup.draft_dtype,
             "profile": setup.profile_path}
    draft = profile["draft"]
    if draft is not None and setup.draft_dtype in draft["by_dtype"]:
        costs["t_draft_s"] = curve(draft["by_dtype"][setup.draft_dtype])[1] / 1e3
    return costs


def batch_dtype(target: str, device: str | torch.device = "auto") -> str:
    """The dtype batch jobs run ``target`` in: the one whose batched pass the target's profile
    measured fastest (calibrated once if missing or older than batch timing); where the device
    computes only one dtype natively, that one, without calibrating."""
    dev = resolve_device(device)
    native = candidate_dtypes(dev)
    if len(native) == 1:
        return native[0]
    profile = settle(target, None, dev).profile
    if "batch" not in profile:
        notice(f"the profile of {target} predates batch timing: measuring it again, once")
        profile, _ = calibrate(CalibrateConfig(target=target, draft="none", device=str(dev)))
    return profile["batch"]["dtype"]


def format_profile(profile: dict) -> str:
    """The measured curves and the choices, as a table for the terminal."""
    target = profile["target"]
    dtypes = list(target["by_dtype"])
    ns = sorted(int(n) for n in target["t_ms"])
    lines = [(f"{target['spec']} on {profile['device']} ({profile['device_name']}, "
              f"{profile['threads']} threads), cache {profile['context']} tokens: ms per pass "
              "over n new tokens")]
    lines.append(f"{'n':<10}" + "".join(f"{n:>7}" for n in ns))
    for dtype in dtypes:
        entry = target["by_dtype"][dtype]
        t = curve(entry)
        lines.append(f"{dtype:<10}" + "".join(f"{t[n]:>7.1f}" for n in ns))
        if entry.get("exact_shape"):
            t = curve(entry["exact_shape"])
            lines.append(f"{'  exact':<10}" + "".join(f"{t[n]:>7.1f}" for n in ns))
    if profile["draft"]:
        steps = ", ".join(f"{d} {e['t_ms']['1']:.2f} ms"
                          for d, e in profile["draft"]["by_dtype"].items())
        lines.append(f"draft {profile['draft']['spec']}: one step {steps}")
    lines.append(f"for per-token acceptance {profile['acceptance']}:")
    for dtype in dtypes:
        e = target["by_dtype"][dtype]
        shape = e.get("pass_shape", f"fixed:{e['rows']}")
        plain = [f"{e['plain_fixed_tokens_per_s']:.1f} at fixed:{e['rows']}"]
        if e.get("exact_shape"):
            verdict = "" if e["exact_shape"]["exact"] else ", NOT bit-exact here"
            plain.append(f"{e['exact_shape']['plain_tokens_per_s']:.1f} exact{verdict}")
        plain.append(f"{e['plain_free_tokens_per_s']:.1f} unpadded")
        lines.append(f"  {dtype:<9} {shape:<8} static:{e['static_k']:<3} modelled "
                     f"{e['modelled_tokens_per_s']:.1f} tok/s (plain: {', '.join(plain)})")
    draft_dtype = profile["draft"]["dtype"] if profile["draft"] else "-"
    lines.append(f"chosen: target {target['dtype']}, draft {draft_dtype}, pass shape "
                 f"{profile['pass_shape']}; fastest plain decoding: "
                 f"{profile['fastest_plain']['dtype']} unpadded")
    if "batch" in profile:
        batch = profile["batch"]
        times = ", ".join(f"{d} {ms:.0f} ms" for d, ms in batch["ms"].items())
        lines.append(f"batched pass of {batch['shape'][0]}x{batch['shape'][1]} tokens: {times}; "
                     f"batch jobs run in {batch['dtype']}")
    return "\n".join(lines)


def sensitivity(profile: dict, alphas=(0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)) -> list[dict]:
    """For each acceptance: the best (dtype, M, K) and its modelled speedup over the fastest
    plain decoding, from the profile's curves."""
    draft = profile["draft"]
    rows = []
    fastest_ms = profile["fastest_plain"]["t_ms"]
    for alpha in alphas:
        best = None
        for dtype, entry in profile["target"]["by_dtype"].items():
            t_ms = curve(entry)
            t_draft = curve(draft)[1] if draft else 0.1 * t_ms[1]
            shape, _, k, rate = choose_shape(t_ms, t_draft, alpha, _inexact(entry),
                                             _exact_curve(entry))
            if best is None or rate > best["rate"]:
                best = {"acceptance": alpha, "dtype": dtype, "pass_shape": shape,
                        "static_k": k, "rate": rate}
        best["speedup_vs_fastest_plain"] = round(best.pop("rate") * fastest_ms, 3)
        rows.append(best)
    return rows
