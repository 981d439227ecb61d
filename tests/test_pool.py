"""The prompt pool a draft learns from: built by the target and from local text, disjoint from
every prompt set used to train or evaluate controllers, and resumable."""

import json
from pathlib import Path

import pytest
from transformers import LlamaForCausalLM

from draftctl.distill.pool import (
    FIRST_ID,
    PoolConfig,
    clean_article,
    clean_request,
    near_duplicates,
    normalise,
    read_seeds,
    run_pool,
)
from draftctl.prompts import DEFAULT_PROMPTS, load_prompts
from tests.test_models import save_model

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


@pytest.fixture()
def small(tmp_path):
    """A tiny target, and seeds whose direct templates include two benchmark prompts."""
    seeds = read_seeds()
    ours = load_prompts(DEFAULT_PROMPTS)[0].text
    seeds["direct"]["qa"] = [*seeds["direct"]["qa"], ours]  # a template with no {topic}
    exclude = []
    if SPEC_BENCH.is_file():
        theirs = load_prompts(SPEC_BENCH)[5].text
        seeds["direct"]["writing"] = [*seeds["direct"]["writing"], theirs.upper()]
        exclude = [str(SPEC_BENCH)]
    (tmp_path / "seeds.json").write_text(json.dumps(seeds))
    config = PoolConfig(target=save_model(tmp_path / "target"), out=str(tmp_path / "pool"),
                        seeds=str(tmp_path / "seeds.json"), exclude=exclude, direct=400,
                        self_instruct=12, passages=10, rag=4, code=10, translation=6, math=12,
                        max_new_tokens=12, batch=4, dtype="float32")
    return config


def test_the_pool_shares_no_prompt_with_any_excluded_set(small):
    manifest = run_pool(small, progress=False)
    rows = [json.loads(x) for x in Path(small.out, "pool.jsonl").read_text().splitlines()]
    assert len(rows) == manifest["prompts"] > 0
    assert [r["question_id"] for r in rows] == list(range(FIRST_ID, FIRST_ID + len(rows)))
    texts = [normalise(r["turns"][0]) for r in rows]
    assert len(set(texts)) == len(texts)
    protected = {normalise(t) for p in load_prompts(DEFAULT_PROMPTS) for t in p.turns}
    if SPEC_BENCH.is_file():
        protected |= {normalise(t) for p in load_prompts(SPEC_BENCH) for t in p.turns}
    assert not set(texts) & protected
    assert manifest["too_close_to_excluded"] >= (2 if SPEC_BENCH.is_file() else 1)
    assert set(manifest["counts"]["source"]) == {"direct", "passage", "code", "translation",
                                                 "math", "self_instruct", "rag"} - (
        set() if manifest["counts"]["source"].get("rag") else {"rag"})
    assert manifest["pool_sha256"] and manifest["seeds_sha256"] and manifest["target"]["sha256"]
    # sources are interleaved, so a prefix (distill --limit) samples all of them
    assert {r["source"] for r in rows[:len(rows) // 2]} >= {"direct", "code", "self_instruct"}


def test_a_killed_generation_resumes_without_redoing_finished_batches(small, monkeypatch):
    calls = {"n": 0}
    real_generate = LlamaForCausalLM.generate

    def crashing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_generate(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "generate", crashing)
    with pytest.raises(KeyboardInterrupt):
        run_pool(small, progress=False)
    written = Path(small.out, "self_instruct.jsonl").read_text().splitlines()
    assert len(written) == 2 * small.batch  # two whole batches, nothing torn
    calls["n"] = -100
    resumed = run_pool(small, progress=False)
    requests = small.self_instruct + small.rag  # each answered greedily and sampled
    assert len(Path(small.out, "self_instruct.jsonl").read_text().splitlines()) == 2 * requests
    batches = 2 * -(-requests // small.batch)  # greedy and sampled answers batch apart
    assert calls["n"] == -100 + batches - 2  # only the missing batches ran
    monkeypatch.setattr(LlamaForCausalLM, "generate", real_generate)
    again = run_pool(small, progress=False)
    assert again["pool_sha256"] == resumed["pool_sha256"]


def test_requests_are_cleaned_and_near_duplicates_found():
    assert clean_request('Question: "How do tides form each day?"\n\nAnswer: ...') == \
        "How do tides form each day?"
    assert clean_request("Too short.") is None
    assert clean_request("As an AI, I cannot write that question for you.") is None
    texts = ["Write a poem about the sea.", "write a poem about the SEA!",
             "Explain how a binary search tree stays balanced.", "Write a poem about the sea"]
    assert near_duplicates(texts, 0.85).tolist() == [False, True, False, True]
    close = near_duplicates(texts, 0.8,
                            against=["Please explain how a binary search tree stays balanced."])
    assert close.tolist() == [False, False, True, False]


def test_articles_become_long_summarization_and_rag_prompts(small):
    small.articles, small.article_tokens, small.article_min_words = 6, 48, 5
    small.article_summaries, small.article_rag = 5, 5
    manifest = run_pool(small, progress=False)
    written = [json.loads(x) for x in Path(small.out, "articles.jsonl").read_text().splitlines()]
    assert sorted((r["question_id"], r["sample"]) for r in written) == [(i, 1) for i in range(6)]
    assert 2 <= manifest["articles"] <= 6  # sampled only; whole, non-repeating ones kept
    rows = [json.loads(x) for x in Path(small.out, "pool.jsonl").read_text().splitlines()]
    made = [r for r in rows if r["source"] == "article"]
    assert made and {r["category"] for r in made} <= {"summarization", "rag"}
    for row in made:
        if row["category"] == "rag":
            assert "Document 1: " in row["turns"][0]


def test_articles_are_cleaned():
    story = " ".join(f"Sentence {i} tells part {i} of the story." for i in range(30))
    assert clean_article(story + " And then the", min_words=50) == story
    assert clean_article("Too short. Much too short.", min_words=50) is None
    assert clean_article("The cat sat on the mat. " * 40, min_words=50) is None
    assert clean_article("I'm sorry, I cannot write that. " + story, min_words=50) is None
