"""The recipes shipped in configs/ load into the options of the command they document."""

from pathlib import Path

import pytest

from draftctl.collect.run import CollectConfig
from draftctl.config import load_config
from draftctl.distill.pool import PoolConfig
from draftctl.distill.run import DistillConfig, _check
from draftctl.jobs import DecodeJob

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
COMMANDS = {"pool": PoolConfig, "distill": DistillConfig, "collect": CollectConfig,
            "decode": DecodeJob}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.name)
def test_every_shipped_recipe_loads(path):
    """Each file names only keys its command knows, with values it accepts: a renamed or
    removed option would otherwise break a command the README and the file's header give."""
    cls = COMMANDS[path.stem.split("-")[0]]
    config = load_config(cls, path)
    if cls is DistillConfig:
        _check(config)


def test_every_config_file_has_a_command():
    assert CONFIGS and {path.stem.split("-")[0] for path in CONFIGS} <= set(COMMANDS)
