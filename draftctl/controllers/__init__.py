"""Draft-length controllers behind one small interface, built from spec strings."""

from draftctl.controllers.base import UNBOUNDED, Action, Controller
from draftctl.controllers.registry import (
    REGISTRY,
    ControllerSpecError,
    describe,
    expand_specs,
    make_controller,
    split_drafter,
)

__all__ = [
    "REGISTRY",
    "UNBOUNDED",
    "Action",
    "Controller",
    "ControllerSpecError",
    "describe",
    "expand_specs",
    "make_controller",
    "split_drafter",
]
