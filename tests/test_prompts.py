import json
from collections import Counter
from pathlib import Path

import pytest

from draftctl.distill.pool import near_duplicates
from draftctl.prompts import PromptFileError, load_prompts, split_of, task_of

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


def test_builtin_prompt_set_has_every_task_in_every_split():
    prompts = load_prompts()
    assert len(prompts) == 278
    assert [p.question_id for p in prompts] == list(range(1, 279))
    tasks = {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}
    for split in ("train", "dev", "test"):
        chosen = load_prompts(split=split)
        assert {p.task for p in chosen} == tasks
        assert all(p.split == split for p in chosen)
    assert sum(len(load_prompts(split=s)) for s in ("train", "dev", "test")) == 278
    # enough train and dev prompts per group for the learned controllers' traces (36)
    fit = Counter(p.task for p in load_prompts(split="train,dev"))
    assert min(fit.values()) >= 36
    assert min(Counter(p.task for p in load_prompts(split="test")).values()) >= 9


def test_builtin_prompts_are_distinct_and_none_is_near_a_spec_bench_prompt():
    texts = [t for p in load_prompts() for t in p.turns]
    assert not near_duplicates(texts, 0.5).any()
    if SPEC_BENCH.is_file():
        theirs = [t for p in load_prompts(SPEC_BENCH) for t in p.turns]
        assert not near_duplicates(texts, 0.5, against=theirs).any()


def test_split_rule():
    assert [split_of(i) for i in range(10, 15)] == ["train", "train", "train", "dev", "test"]


def test_limit_and_prompt_field(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"q{i}", "question_id": i}) for i in range(9)))
    prompts = load_prompts(path, split="train", limit=4)
    assert [p.question_id for p in prompts] == [0, 1, 2, 5]
    assert prompts[0].text == "q0" and prompts[0].category == "default"


@pytest.mark.parametrize("lines, message", [
    (['{"turns": ["a"]', ], "p.jsonl:1: not valid JSON"),
    (['{"turns": ["a"], "question_id": 1}', '{"turns": [], "question_id": 2}'],
     "p.jsonl:2: 'turns' must be a non-empty list"),
    (['{"text": "a"}'], "needs a 'turns' list or a 'prompt' string"),
    (['{"prompt": "a", "question_id": 1}', '{"prompt": "b", "question_id": 1}'],
     "duplicate question_id 1"),
    (['{"prompt": " "}'], "the first turn is empty"),
    ([], "holds no prompts"),
])
def test_bad_prompt_files_name_the_line_and_problem(tmp_path, lines, message):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines))
    with pytest.raises(PromptFileError, match=message):
        load_prompts(path)


def test_bad_arguments(tmp_path):
    with pytest.raises(PromptFileError, match="prompt file not found"):
        load_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(PromptFileError, match="unknown split 'val'"):
        load_prompts(split="val")
    with pytest.raises(PromptFileError, match="limit must be > 0"):
        load_prompts(limit=0)


@pytest.mark.skipif(not SPEC_BENCH.is_file(), reason="Spec-Bench prompts not beside the checkout")
def test_reads_spec_bench_and_groups_mt_bench():
    prompts = load_prompts(SPEC_BENCH)
    assert len(prompts) == 480
    by_task = {}
    for p in prompts:
        by_task[p.task] = by_task.get(p.task, 0) + 1
    assert by_task == {"mt_bench": 80, "translation": 80, "summarization": 80, "qa": 80,
                       "math_reasoning": 80, "rag": 80}
    assert len(load_prompts(SPEC_BENCH, split="test")) == 96


def test_reads_a_saved_datasets_folder(tmp_path):
    import datasets

    rows = [{"question_id": i, "category": "qa", "turns": [f"question {i}"]} for i in range(6)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    prompts = load_prompts(tmp_path / "ds", split="train")
    assert [p.question_id for p in prompts] == [0, 1, 2, 5]
    assert prompts[-1].text == "question 5"
    (tmp_path / "empty").mkdir()
    with pytest.raises(PromptFileError, match="not a saved datasets dataset"):
        load_prompts(tmp_path / "empty")


def test_several_splits_and_a_per_category_cap():
    both = load_prompts(split="train,dev")
    assert {p.split for p in both} == {"train", "dev"}
    assert len(both) == len(load_prompts(split="train")) + len(load_prompts(split="dev"))
    capped = load_prompts(split="all", per_category=2)
    counts = {}
    for p in capped:
        counts[p.task] = counts.get(p.task, 0) + 1
    assert set(counts.values()) == {2} and len(counts) == len({p.task for p in load_prompts()})
    with pytest.raises(PromptFileError, match="unknown split 'train,val'"):
        load_prompts(split="train,val")
    with pytest.raises(PromptFileError, match="per_category must be > 0"):
        load_prompts(per_category=0)


def test_mt_bench_categories_report_as_one_task():
    assert [task_of(c) for c in ("writing", "coding", "stem", "qa", "rag")] == [
        "mt_bench", "mt_bench", "mt_bench", "qa", "rag"]
