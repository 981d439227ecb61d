"""Spec strings -> controllers.

A spec is ``name``, ``name:VALUE`` (the first parameter) or ``name:key=value,key=value``,
e.g. ``static:4``, ``svip:0.3``, ``adaedl:lam=0.4,gamma=0.2``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from draftctl.controllers import rules
from draftctl.controllers.base import Controller
from draftctl.errors import DraftctlError


class ControllerSpecError(DraftctlError):
    """An unknown controller name or a bad parameter value."""


@dataclass(frozen=True)
class Param:
    name: str
    kind: type  # int or float
    check: Callable[[float], bool]
    rule: str  # how the allowed range reads in an error message


def _prob(name: str, lo_open: bool = True) -> Param:
    if lo_open:
        return Param(name, float, lambda v: 0 < v <= 1, "in (0, 1]")
    return Param(name, float, lambda v: 0 <= v <= 1, "in [0, 1]")


_POSITIVE_INT = {"check": lambda v: v >= 1, "rule": ">= 1"}


@dataclass(frozen=True)
class Entry:
    factory: Callable[..., Controller]
    params: tuple[Param, ...]
    help: str


REGISTRY: dict[str, Entry] = {
    "none": Entry(rules.NoDraft, (), "no draft: plain autoregressive decoding"),
    "static": Entry(rules.Static, (Param("k", int, **_POSITIVE_INT),),
                    "draft exactly K tokens per round (default 4)"),
    "heuristic": Entry(rules.Heuristic, (Param("k0", int, **_POSITIVE_INT),),
                       "HF schedule: +2 after a full accept, else -1; starts at 5"),
    "confidence": Entry(rules.Confidence, (_prob("threshold"),),
                        "stop after a token with draft top-1 prob < T (default 0.4)"),
    "confidence-roc": Entry(rules.ConfidenceROC,
                            (_prob("threshold"),
                             Param("fn_weight", float, lambda v: v > 0, "> 0")),
                            "confidence with HF's online ROC refit of T (FPR + 3 FNR)"),
    "pmin": Entry(rules.PMin, (_prob("threshold", lo_open=False),
                               Param("n_max", int, **_POSITIVE_INT)),
                  "llama.cpp p-min: drop the first token with top-1 prob < T (default 0.75)"),
    "svip": Entry(rules.SVIP, (Param("threshold", float, lambda v: v > 0, "> 0"),
                               Param("h", float, lambda v: v > 0, "> 0"),
                               Param("n_max", int, **_POSITIVE_INT)),
                  "SVIP: stop after the token with sqrt(0.15 H) > T (default 0.3)"),
    "oracle": Entry(rules.ReferenceOracle, (),
                    "upper bound: drafts exactly the tokens the target accepts (bench, greedy)"),
    "adaedl": Entry(rules.AdaEDL, (_prob("lam"), Param("gamma", float, lambda v: v > 0, "> 0"),
                                   Param("step", float, lambda v: 0 <= v < 1, "in [0, 1)"),
                                   Param("n_max", int, **_POSITIVE_INT)),
                    "AdaEDL: stop when 1 - sqrt(0.2 H) < lambda, lambda adapted online"),
}


def make_controller(spec: str) -> Controller:
    """Build the controller a spec string names; ``ControllerSpecError`` if it cannot."""
    name, _, arg_text = spec.strip().partition(":")
    if name == "onnx":
        from draftctl.controllers.learned import onnx_controller

        if not arg_text:
            raise ControllerSpecError("controller spec 'onnx:' needs a path: onnx:PATH")
        controller = onnx_controller(arg_text)
        controller.spec = spec
        return controller
    if name not in REGISTRY:
        raise ControllerSpecError(
            f"unknown controller {name!r} in spec {spec!r}; known: {', '.join(REGISTRY)}, "
        "onnx:PATH")
    entry = REGISTRY[name]
    kwargs = _parse_args(spec, entry, arg_text) if arg_text else {}
    controller = entry.factory(**kwargs)
    controller.spec = spec
    return controller


def expand_specs(specs: str | list[str],
                 check: Callable[[str], object] | None = None) -> list[str]:
    """Comma-separated or listed specs with integer ranges expanded: ``static:1-4`` gives
    ``static:1`` .. ``static:4``; ``svip:0.4,n_max=2-3`` gives two specs. Every spec is
    checked by ``check`` (default ``make_controller``: ``ControllerSpecError`` names the bad
    one); unranged specs stay as written. A ``@DRAFTER`` suffix (``split_drafter``) is kept on
    every spec it expands to."""
    check = check or make_controller
    specs = _split_specs(specs) if isinstance(specs, str) \
        else [one for text in specs for one in _split_specs(text)]
    out: list[str] = []
    for full in specs:
        spec, drafter = split_drafter(full)
        suffix = f"@{drafter}" if drafter else ""
        name, _, arg_text = spec.partition(":")
        items = arg_text.split(",") if arg_text and name != "onnx" else []
        ranged = [(i, m) for i, item in enumerate(items)
                  if (m := re.fullmatch(r"(\w+[=:])?(\d+)-(\d+)", item))]
        if not ranged:
            check(spec)
            out.append(spec + suffix)
            continue
        if len(ranged) > 1:
            raise ControllerSpecError(f"controller spec {spec!r}: only one range per spec")
        i, match = ranged[0]
        key, lo, hi = match.group(1) or "", int(match.group(2)), int(match.group(3))
        if lo > hi:
            raise ControllerSpecError(f"controller spec {spec!r}: range {lo}-{hi} is empty")
        for value in range(lo, hi + 1):
            expanded = f"{name}:{','.join([*items[:i], f'{key}{value}', *items[i + 1:]])}"
            check(expanded)
            out.append(expanded + suffix)
    return out


def split_drafter(spec: str) -> tuple[str, str | None]:
    """``static:10@rest:DIR`` -> (``static:10``, ``rest:DIR``): a controller spec may name
    the drafter it runs with (``bench`` compares drafters in one run); None when it does not."""
    controller, at, drafter = spec.strip().partition("@")
    if at and not drafter:
        raise ControllerSpecError(f"controller spec {spec!r}: name a drafter after '@'")
    return controller.strip(), drafter.strip() or None


def _split_specs(text: str) -> list[str]:
    """Split ``a,b:k=1,c`` into specs: a comma starts a new spec unless ``k=v`` follows it
    (a further parameter of the same spec) or the current spec is ``onnx:PATH``."""
    specs: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if specs and ("=" in part and ":" not in part):
            specs[-1] += "," + part
        elif part:
            specs.append(part)
    return specs


def _parse_args(spec: str, entry: Entry, arg_text: str) -> dict[str, float]:
    if not entry.params:
        raise ControllerSpecError(f"controller spec {spec!r}: this controller takes no value")
    by_name = {p.name: p for p in entry.params}
    kwargs: dict[str, float] = {}
    for i, item in enumerate(arg_text.split(",")):
        key, eq, text = item.partition("=")
        if not eq:
            if i > 0:
                raise ControllerSpecError(
                    f"controller spec {spec!r}: only the first value may omit its name; "
                    f"parameters are {', '.join(by_name)}")
            key, text = entry.params[0].name, item
        if key not in by_name:
            raise ControllerSpecError(f"controller spec {spec!r}: unknown parameter {key!r}; "
                                      f"parameters are {', '.join(by_name)}")
        kwargs[key] = _value(spec, by_name[key], text)
    return kwargs


def _value(spec: str, param: Param, text: str) -> float:
    try:
        value = param.kind(text)
    except ValueError:
        kind = "an integer" if param.kind is int else "a number"
        raise ControllerSpecError(
            f"controller spec {spec!r}: {param.name} must be {kind}, got {text!r}") from None
    if not param.check(value):
        raise ControllerSpecError(
            f"controller spec {spec!r}: {param.name} must be {param.rule}, got {text}")
    return value


def describe() -> str:
    """One line per controller, for ``--help``."""
    lines = []
    for name, entry in REGISTRY.items():
        params = ",".join(p.name for p in entry.params)
        lines.append(f"  {name + (':' + params if params else ''):<36} {entry.help}")
    lines.append(f"  {'onnx:PATH':<36} a learned controller exported by draftctl export")
    return "\n".join(lines)
