"""``draftctl pool``: a pool of prompts a draft may learn from, disjoint from every prompt set
used to train or evaluate controllers, and taken from no published benchmark.

Sources, all local and all written or generated here:

- ``direct``: task templates we wrote (``draftctl/data/pool_seeds.json``) filled with seed
  topics;
- ``self_instruct``: the target itself writes a user request from an instruction we wrote
  ("Write one question a curious student might ask about {topic}..."), one greedy and one
  sampled answer per instruction;
- ``passage`` and ``rag``: paragraphs of Python's own language reference (``pydoc_data``) to
  summarise, explain or extract from, and questions the target writes about them;
- ``code``: functions from the Python standard library's sources to explain, document or test;
- ``translation``: German sentences we wrote; ``math``: word problems we wrote, with numbers
  drawn at random;
- ``article``: long prose to summarise or answer questions from (as in Spec-Bench's
  summarization and rag groups, whose prompts run to about 3,000 characters): the target writes
  articles, stories and reports on seed topics (sampled: its greedy articles mostly loop on a
  sentence); summarization prompts hold one or two of them, rag prompts two to four as
  numbered documents with a question about one document's topic.

Candidates are cleaned, exact and near duplicates are removed (TF-IDF cosine over words and
word pairs), and so is every candidate that is, or nearly is, a prompt of an excluded set
(draftctl's own prompt set always; Spec-Bench through ``exclude``). Stages resume from ``out``:
the target's generations are appended batch by batch to ``self_instruct.jsonl`` and
``articles.jsonl``.

Output: ``pool.jsonl`` (Spec-Bench's format: ``question_id`` from 10,000,000, ``category``,
``turns``, plus ``source``) and ``manifest.json`` (recipe, counts, hashes).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import random
import re
import sysconfig
import textwrap
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from draftctl.config import save_config
from draftctl.errors import DraftctlError
from draftctl.models import DEFAULT_TARGET, model_file_sha256
from draftctl.prompts import DEFAULT_PROMPTS, Prompt, load_prompts

SEEDS = Path(__file__).resolve().parents[1] / "data" / "pool_seeds.json"
FIRST_ID = 10_000_000
CATEGORY_OF_SELF_INSTRUCT = {"explanation": "stem"}  # Spec-Bench has no explanation group


@dataclass
class PoolConfig:
    target: str = DEFAULT_TARGET
    out: str = "runs/pool"
    seeds: str | None = None  # default: draftctl/data/pool_seeds.json
    # prompt files the pool must not share a prompt with (draftctl's own set is always added)
    exclude: list[str] = field(default_factory=list)
    direct: int = 1500  # how many candidates each source contributes (before deduplication)
    self_instruct: int = 2400  # instructions; each gives a greedy and a sampled request
    passages: int = 700
    rag: int = 400
    code: int = 900
    translation: int = 300
    math: int = 600
    articles: int = 0  # article instructions; each gives one sampled article
    article_tokens: int = 384  # tokens the target may use to write an article
    article_min_words: int = 120  # shorter articles are dropped
    article_summaries: int = 0  # summarization prompts built from the articles
    article_rag: int = 0  # rag prompts built from the articles
    near_duplicate: float = 0.85  # TF-IDF cosine at or above which two prompts are one
    exclude_similarity: float = 0.8  # ... and at which a prompt is too close to an excluded one
    max_new_tokens: int = 72  # tokens the target may use to write a request
    batch: int = 32
    temperature: float = 1.0
    top_p: float = 0.95
    seed: int = 0
    device: str = "cpu"
    dtype: str = "auto"


def read_seeds(path: str | Path | None = None) -> dict:
    path = Path(path or SEEDS)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise DraftctlError(f"cannot read pool seeds {path}: {err}") from None


def normalise(text: str) -> str:
    """Lower case, words only, single spaces: the form in which prompts are compared."""
    return " ".join(re.findall(r"\w+", text.lower()))


@functools.cache
def language_reference(min_chars: int = 300, max_chars: int = 1200) -> list[str]:
    """Paragraphs of Python's own language reference (``pydoc_data.topics``), shipped with
    every CPython."""
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[name]):
            text = " ".join(block.split())
            if min_chars <= len(text) <= max_chars and not text.startswith(("*", "|", ">>>")):
                paragraphs.append(text)
    return paragraphs


@functools.cache
def stdlib_functions(min_lines: int = 4, max_lines: int = 30) -> list[str]:
    """Source of top-level functions and methods of the standard library, 4-30 lines each."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(root.glob("*.py")):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = source.split("\n")
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("__"):
                first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
                if min_lines <= node.end_lineno - first + 1 <= max_lines:
                    found.append(textwrap.dedent("\n".join(lines[first - 1:node.end_lineno])))
    return found


def _topics(seeds: dict) -> list[str]:
    return [t for domain in sorted(seeds["topics"]) for t in seeds["topics"][domain]]


def _pick(rng: random.Random, items: list, n: int) -> list:
    """n items, cycling through shuffled copies when n exceeds the list."""
    out: list = []
    while len(out) < n and items:
        batch = list(items)
        rng.shuffle(batch)
        out += batch[: n - len(out)]
    return out


def template_candidates(seeds: dict, cfg: PoolConfig, rng: random.Random) -> list[dict]:
    """Every candidate that needs no generation: direct templates, passages, code,
    translation and math."""
    topics, out = _topics(seeds), []
    direct = [(cat, t) for cat in sorted(seeds["direct"]) for t in seeds["direct"][cat]]
    for (category, template), topic in zip(_pick(rng, direct, cfg.direct),
                                           _pick(rng, topics, cfg.direct)):
        out.append({"category": category, "text": template.format(topic=topic),
                    "source": "direct"})
    passages = list(language_reference())
    tasks = [(cat, t) for cat in ("summarization", "extraction", "explanation")
             for t in seeds["passage_tasks"][cat]]
    for (category, template), text in zip(_pick(rng, tasks, cfg.passages),
                                          _pick(rng, passages, cfg.passages)):
        out.append({"category": category, "text": template.format(text=text),
                    "source": "passage"})
    functions = list(stdlib_functions())
    for template, code in zip(_pick(rng, seeds["code_tasks"], cfg.code),
                              _pick(rng, functions, cfg.code)):
        out.append({"category": "coding", "text": template.format(code=code), "source": "code"})
    for template, text in zip(_pick(rng, seeds["translation_templates"], cfg.translation),
                              _pick(rng, seeds["german"], cfg.translation)):
        out.append({"category": "translation", "text": template.format(text=text),
                    "source": "translation"})
    for problem in _pick(rng, seeds["math_templates"], cfg.math):
        values = {k: rng.randint(lo, hi) for k, (lo, hi) in problem["vars"].items()}
        out.append({"category": "math_reasoning", "text": problem["text"].format(**values),
                    "source": "math"})
    return [c | {"category": CATEGORY_OF_SELF_INSTRUCT.get(c["category"], c["category"])}
            for c in out]


def generation_requests(seeds: dict, cfg: PoolConfig, rng: random.Random) -> list[dict]:
    """Instructions the target answers with a user request (or, for ``rag``, a question about
    a passage): {"id", "category", "instruction", "passage"}."""
    topics, roles = _topics(seeds), seeds["roles"]
    kinds = [(cat, t) for cat in sorted(seeds["self_instruct"])
             for t in seeds["self_instruct"][cat]]
    requests = []
    for (category, template), topic in zip(_pick(rng, kinds, cfg.self_instruct),
                                           _pick(rng, topics, cfg.self_instruct)):
        text = template.format(topic=topic, role=rng.choice(roles))
        requests.append({"category": CATEGORY_OF_SELF_INSTRUCT.get(category, category),
                         "instruction": text, "passage": None})
    passages = list(language_reference())
    for template, passage in zip(_pick(rng, seeds["passage_questions"], cfg.rag),
                                 _pick(rng, passages, cfg.rag)):
        requests.append({"category": "rag", "instruction": template.format(text=passage),
                         "passage": passage})
    return [r | {"id": i} for i, r in enumerate(requests)]


_REFUSAL = re.compile(r"\b(as an ai|i'm sorry|i cannot|i can't)\b", re.IGNORECASE)


def article_requests(seeds: dict, cfg: PoolConfig, rng: random.Random) -> list[dict]:
    """Instructions the target answers with an article: {"id", "topic", "instruction"}."""
    pairs = zip(_pick(rng, seeds["article_instructions"], cfg.articles),
                _pick(rng, _topics(seeds), cfg.articles))
    return [{"id": i, "topic": topic, "instruction": template.format(topic=topic)}
            for i, (template, topic) in enumerate(pairs)]


def clean_article(text: str, min_words: int = 120) -> str | None:
    """A generated article without a last, unfinished sentence; None if it is short, a
    refusal, or repeats itself (under half of its word trigrams distinct)."""
    text = text.strip()
    end = max(text.rfind(mark) for mark in ".!?")
    text = text[:end + 1].strip() if end > 0 else text
    words = text.split()
    if len(words) < min_words:
        return None
    if _REFUSAL.search(text):
        return None
    trigrams = list(zip(words, words[1:], words[2:]))
    if len(set(trigrams)) < 0.5 * len(trigrams):
        return None
    return text


def article_candidates(articles: list[tuple[str, str]], seeds: dict, cfg: PoolConfig,
                       rng: random.Random) -> list[dict]:
    """Summarization and rag prompts over (topic, article) pairs: a summary of one or two
    articles, or a question about one article's topic asked of two to four documents."""
    if not articles:
        return []
    tasks = seeds["article_tasks"]
    out = []
    for template in _pick(rng, tasks["summarization"], cfg.article_summaries):
        chosen = rng.sample(articles, min(rng.choice((1, 2)), len(articles)))
        out.append({"category": "summarization", "source": "article",
                    "text": template.format(text="\n\n".join(text for _, text in chosen))})
    for template in _pick(rng, tasks["rag"], cfg.article_rag):
        chosen = rng.sample(articles, min(rng.randint(2, 4), len(articles)))
        documents = "\n\n".join(f"Document {i}: {text}" for i, (_, text) in
                                 enumerate(chosen, start=1))
        question = rng.choice(tasks["questions"]).format(topic=rng.choice(chosen)[0])
        out.append({"category": "rag", "source": "article",
                    "text": template.format(text=documents, question=question)})
    return out


_LABEL = re.compile(r"^\s*(question|request|prompt|user|task|q)\s*[:.)-]\s*", re.IGNORECASE)


def clean_request(text: str) -> str | None:
    """The first paragraph of a generated request, without labels or quotes; None if it is
    too short, too long, or not a request."""
    text = text.strip().split("\n\n")[0].strip()
    text = _LABEL.sub("", text).strip().strip('"“”\'').strip()
    words = text.split()
    if not 4 <= len(words) <= 80 or len(text) > 600:
        return None
    if _REFUSAL.search(text):
        return None
    return text


def near_duplicates(texts: list[str], threshold: float,
                    against: list[str] | None = None) -> np.ndarray:
    """Which texts to drop. Without ``against``: a text is dropped when its TF-IDF cosine
    (words and word pairs, sublinear counts) with an earlier kept text is >= threshold; with
    ``against``: when it is that close to any text there (exact normalised matches always)."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    normal = [normalise(t) for t in texts]
    vectorizer = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=1)
    if against is None:
        x = vectorizer.fit_transform(normal)
        drop = np.zeros(len(texts), dtype=bool)
        seen: dict[str, int] = {}
        for i, key in enumerate(normal):
            drop[i] = key in seen
            seen.setdefault(key, i)
        for start in range(0, len(texts), 1000):
            sims = (x[start:start + 1000] @ x.T).toarray()
            for row, i in enumerate(range(start, min(start + 1000, len(texts)))):
                if drop[i]:
                    continue
                earlier = np.flatnonzero(sims[row, :i] >= threshold)
                drop[i] = bool(np.any(~drop[earlier]))
        return drop
    other = [normalise(t) for t in against]
    vectorizer.fit(normal + other)
    x, y = vectorizer.transform(normal), vectorizer.transform(other)
    protected = set(other)
    drop = np.array([key in protected for key in normal])
    for start in range(0, len(texts), 1000):
        sims = (x[start:start + 1000] @ y.T).toarray()
        drop[start:start + 1000] |= sims.max(axis=1, initial=0.0) >= threshold
    return drop


def excluded_texts(cfg: PoolConfig) -> tuple[list[str], list[str]]:
    """(texts of every excluded prompt, every turn; the files they came from)."""
    files = [str(DEFAULT_PROMPTS), *cfg.exclude]
    texts = [turn for path in files for p in load_prompts(path) for turn in p.turns]
    return texts, files


def run_pool(cfg: PoolConfig, progress: bool = True) -> dict:
    """Build (or finish building) the pool in ``cfg.out``; returns its manifest."""
    from draftctl.distill.data import generate_responses, ledger, read_responses, read_stages
    from draftctl.distill.run import target_dtype
    from draftctl.models import load_model

    started = time.time()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "pool.yaml")
    seeds = read_seeds(cfg.seeds)
    protected, protected_files = excluded_texts(cfg)
    rng = random.Random(cfg.seed)
    candidates = template_candidates(seeds, cfg, rng)
    requests = generation_requests(seeds, cfg, rng)
    article_jobs = article_requests(seeds, cfg, rng)

    generated = out / "self_instruct.jsonl"
    target = load_model(cfg.target, cfg.device, target_dtype(cfg.target, cfg.device, cfg.dtype))
    generate_responses(
        target.model, target.tokenizer,
        [Prompt(r["id"], r["category"], (r["instruction"],)) for r in requests], generated,
        samples_per_prompt=1, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
        top_p=cfg.top_p, batch_size=cfg.batch, max_prompt_tokens=512, seed=cfg.seed,
        eos_ids=target.eos_token_ids, on_batch=ledger(out, "requests"))
    generated_articles = out / "articles.jsonl"
    if article_jobs:
        generate_responses(
            target.model, target.tokenizer,
            [Prompt(r["id"], "writing", (r["instruction"],)) for r in article_jobs],
            generated_articles, samples_per_prompt=1, max_new_tokens=cfg.article_tokens,
            temperature=cfg.temperature, top_p=cfg.top_p, batch_size=cfg.batch,
            max_prompt_tokens=512, seed=cfg.seed, eos_ids=target.eos_token_ids,
            on_batch=ledger(out, "articles"), greedy=False)
    stages = read_stages(out)
    by_id = {r["id"]: r for r in requests}
    rag_templates = seeds["passage_tasks"]["rag"]
    rejected = 0
    for row in read_responses(generated):
        request = by_id[row["question_id"]]
        text = clean_request(target.tokenizer.decode(row["response_ids"],
                                                     skip_special_tokens=True))
        if text is None:
            rejected += 1
            continue
        if request["passage"] is not None:
            template = rag_templates[(row["question_id"] + row["sample"]) % len(rag_templates)]
            text = template.format(text=request["passage"], question=text)
            source = "rag"
        else:
            source = "self_instruct"
        candidates.append({"category": request["category"], "text": text, "source": source})
    articles = []
    if article_jobs:
        topic_of = {r["id"]: r["topic"] for r in article_jobs}
        for row in read_responses(generated_articles):
            text = clean_article(target.tokenizer.decode(row["response_ids"],
                                                         skip_special_tokens=True),
                                 cfg.article_min_words)
            if text is None:
                rejected += 1
            else:
                articles.append((topic_of[row["question_id"]], text))
    candidates += article_candidates(articles, seeds, cfg, rng)

    texts = [c["text"] for c in candidates]
    dup = near_duplicates(texts, cfg.near_duplicate)
    close = near_duplicates(texts, cfg.exclude_similarity, against=protected)
    kept = [c for c, d, e in zip(candidates, dup, close) if not (d or e)]
    rng.shuffle(kept)  # sources interleaved, so any prefix (distill --limit) is a fair sample
    lines = [json.dumps({"question_id": FIRST_ID + i, "category": c["category"],
                         "turns": [c["text"]], "source": c["source"]}, ensure_ascii=False)
             for i, c in enumerate(kept)]
    pool_path = out / "pool.jsonl"
    pool_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    counts = {key: dict(Counter(c[key] for c in kept)) for key in ("source", "category")}
    manifest = {
        "prompts": len(kept), "candidates": len(candidates),
        "rejected_generations": rejected, "articles": len(articles),
        "near_duplicates": int(dup.sum()),
        "too_close_to_excluded": int((close & ~dup).sum()), "counts": counts,
        "excluded_sets": protected_files, "excluded_prompts": len(protected),
        "pool_sha256": hashlib.sha256(pool_path.read_bytes()).hexdigest(),
        "seeds_sha256": hashlib.sha256(Path(cfg.seeds or SEEDS).read_bytes()).hexdigest(),
        "target": {"spec": cfg.target, "sha256": model_file_sha256(cfg.target),
                   "dtype": str(target.dtype).removeprefix("torch.")},
        "config": asdict(cfg), "stages": stages,
        "wall_minutes_this_run": (time.time() - started) / 60,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest
