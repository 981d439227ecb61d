"""Prompt sets: Spec-Bench-style JSONL (``turns``), JSONL with a ``prompt`` field, and the
train/dev/test split rule by question id.

draftctl ships its own prompt set (``draftctl/data/prompts.jsonl``, written for draftctl, 278
prompts in Spec-Bench's format and six task groups); pass ``--prompts PATH`` for Spec-Bench's
``question.jsonl`` or any other set. A folder saved with ``datasets``' ``save_to_disk`` reads
the same way (records with ``turns`` or ``prompt``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from draftctl.errors import DraftctlError

DEFAULT_PROMPTS = Path(__file__).parent / "data" / "prompts.jsonl"

SPLITS = ("train", "dev", "test", "all")

# Spec-Bench stores its MT-Bench part under eight sub-categories and reports them as one.
MT_BENCH_CATEGORIES = frozenset({"writing", "roleplay", "reasoning", "math", "coding",
                                 "extraction", "stem", "humanities"})


class PromptFileError(DraftctlError):
    """A prompt file that cannot be read as a prompt set."""


@dataclass(frozen=True)
class Prompt:
    question_id: int
    category: str
    turns: tuple[str, ...]

    @property
    def text(self) -> str:
        """The first turn, which draftctl decodes."""
        return self.turns[0]

    @property
    def task(self) -> str:
        """Spec-Bench task group: the eight MT-Bench categories report as ``mt_bench``."""
        return task_of(self.category)

    @property
    def split(self) -> str:
        return split_of(self.question_id)


def task_of(category: str) -> str:
    """Spec-Bench task group of a category: the eight MT-Bench ones are ``mt_bench``."""
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category


def split_of(question_id: int) -> str:
    """train: ``id % 5 in (0, 1, 2)``, dev: ``id % 5 == 3``, test: ``id % 5 == 4``."""
    rest = question_id % 5
    return "train" if rest <= 2 else ("dev" if rest == 3 else "test")


def load_prompts(path: str | Path | None = None, split: str = "all",
                 limit: int | None = None, per_category: int | None = None) -> list[Prompt]:
    """Read a JSONL prompt file; keep the prompts of ``split`` (one of train, dev, test, all,
    or several joined by commas, e.g. ``train,dev``); then keep the first ``per_category``
    prompts of each task group (``Prompt.task``); then the first ``limit`` prompts."""
    splits = set(split.split(","))
    unknown = sorted(splits - set(SPLITS))
    if unknown or not split:
        raise PromptFileError(f"unknown split {split!r}: use one of {', '.join(SPLITS)}, "
                              "or several joined by commas")
    for name, value in (("limit", limit), ("per_category", per_category)):
        if value is not None and value <= 0:
            raise PromptFileError(f"{name} must be > 0, got {value}")
    path = Path(path) if path is not None else DEFAULT_PROMPTS
    if path.is_dir():
        lines = _dataset_lines(path)
    elif path.is_file():
        lines = path.read_text(encoding="utf-8").split("\n")
    else:
        raise PromptFileError(f"prompt file not found: {path}")
    prompts: list[Prompt] = []
    seen: set[int] = set()
    for line_no, line in enumerate(lines, 1):
        if line.strip():
            prompt = _parse(line, line_no, path)
            if prompt.question_id in seen:
                raise PromptFileError(f"{path}:{line_no}: duplicate question_id "
                                      f"{prompt.question_id}")
            seen.add(prompt.question_id)
            prompts.append(prompt)
    if not prompts:
        raise PromptFileError(f"{path} holds no prompts")
    return first_of(prompts=[p for p in prompts if "all" in splits or p.split in splits],
                    per_category=per_category, limit=limit)


def first_of(prompts: list[Prompt], per_category: int | None = None,
             limit: int | None = None) -> list[Prompt]:
    """The first ``per_category`` prompts of each task group, then the first ``limit``."""
    if per_category is not None:
        taken: dict[str, int] = {}
        kept = []
        for p in prompts:
            taken[p.task] = taken.get(p.task, 0) + 1
            if taken[p.task] <= per_category:
                kept.append(p)
        prompts = kept
    return prompts[:limit] if limit is not None else prompts


def _dataset_lines(path: Path) -> list[str]:
    """Records of a datasets folder (``save_to_disk`` output), as JSON lines."""
    import datasets

    try:
        data = datasets.load_from_disk(str(path))
    except FileNotFoundError as err:
        raise PromptFileError(f"{path} is a folder but not a saved datasets dataset: {err}") from None
    if isinstance(data, datasets.DatasetDict):
        data = data["train"] if "train" in data else next(iter(data.values()))
    return [json.dumps(row) for row in data]


def _parse(line: str, line_no: int, path: Path) -> Prompt:
    where = f"{path}:{line_no}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise PromptFileError(f"{where}: not valid JSON ({err.msg})") from None
    if not isinstance(record, dict):
        raise PromptFileError(f"{where}: expected a JSON object")
    if "turns" in record:
        turns = record["turns"]
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
            raise PromptFileError(f"{where}: 'turns' must be a non-empty list of strings")
    elif isinstance(record.get("prompt"), str):
        turns = [record["prompt"]]
    else:
        raise PromptFileError(f"{where}: needs a 'turns' list or a 'prompt' string")
    if not turns[0].strip():
        raise PromptFileError(f"{where}: the first turn is empty")
    qid = record.get("question_id", record.get("id", line_no))
    if not isinstance(qid, int):
        raise PromptFileError(f"{where}: question_id must be an integer, got {qid!r}")
    return Prompt(qid, str(record.get("category", "default")), tuple(turns))
