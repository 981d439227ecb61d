"""A tiny distillation end to end: tiny teacher built from a config, a few steps."""

import json
import random
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from draftctl.controllers import make_controller
from draftctl.decode import DecodeConfig, SpeculativeDecoder, generate
from draftctl.distill import run as distill_run
from draftctl.distill.data import choose_head_ids
from draftctl.distill.model import DraftFileError, DraftLM
from draftctl.distill.run import DistillConfig, run_distill
from draftctl.errors import DraftctlError
from draftctl.models import VocabularyMismatchError, load_model
from tests.test_models import WORDS, save_model


@pytest.fixture()
def setup(tmp_path):
    teacher = save_model(tmp_path / "teacher")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(
        json.dumps({"question_id": i, "category": "qa",
                    "turns": [" ".join(f"w{(i * 7 + j) % 90}" for j in range(3 + i % 4))]})
        for i in range(20)))
    config = DistillConfig(target=teacher, out=str(tmp_path / "draft"), prompts=str(prompts),
                           eval_limit=2, samples_per_prompt=1, max_new_tokens=10, gen_batch=4,
                           eval_max_new_tokens=10, n_layers=1, head_size=40, teacher_top_k=4,
                           steps=6, batch_sequences=2, eval_every=3, checkpoint_every=2,
                           warmup_steps=1, lr=3e-3, dtype="float32")
    return teacher, config


def test_distill_writes_a_loadable_lossless_draft(setup):
    teacher_spec, config = setup
    manifest = run_distill(config)
    assert manifest["training"]["steps"] == 6
    assert manifest["teacher"]["sha256"] and manifest["data"]["responses"] == 24  # 12 x 2
    assert 0.0 <= manifest["agreement_eval_float32"] <= 1.0
    assert abs(manifest["agreement_eval_int8"] - manifest["agreement_eval_float32"]) < 0.1
    stages = manifest["stages"]
    assert stages["responses"]["tokens"] == manifest["data"]["response_tokens"]
    assert stages["responses"]["responses"] == 24 and stages["responses"]["tokens_per_s"] > 0
    assert {"eval_responses", "teacher_labels", "training"} <= set(stages)
    target = load_model(teacher_spec, "cpu")
    draft = load_model(config.out, "cpu", target=target)
    assert isinstance(draft.model, DraftLM) and draft.model.head_ids.numel() == 40
    decoder = SpeculativeDecoder.from_loaded(target, draft, DecodeConfig(max_new_tokens=16))
    ids = target.tokenizer("w3 w4 w5")["input_ids"]
    reference = generate(decoder, ids, make_controller("none")).output_ids
    for spec in ("static:3", "svip:0.5"):
        assert generate(decoder, ids, make_controller(spec)).output_ids == reference
    # Loaded on its own, it finds its target's embedding and tokenizer from its config.
    alone = load_model(config.out, "cpu")
    assert torch.equal(alone.model.head.weight, draft.model.head.weight)


@pytest.mark.parametrize("window", [0, 4])
def test_distill_resumes_after_an_interruption(setup, monkeypatch, window):
    _, config = setup
    config.length_window = window
    calls = {"n": 0}
    real_loss = distill_run.distill_loss

    def crashing_loss(*args):
        calls["n"] += 1
        if calls["n"] == 5:  # in step 5; the last checkpoint is step 4
            raise KeyboardInterrupt
        return real_loss(*args)

    monkeypatch.setattr(distill_run, "distill_loss", crashing_loss)
    with pytest.raises(KeyboardInterrupt):
        run_distill(config)
    checkpoint = torch.load(f"{config.out}/checkpoint.pt", weights_only=False)
    assert checkpoint["step"] == 4
    calls["n"] = 0
    manifest = run_distill(config)
    assert calls["n"] == 2  # only steps 5 and 6 ran again
    assert manifest["training"]["steps"] == 6
    assert [h["step"] for h in manifest["training"]["history"]] == [0, 3, 6]
    # the responses were all written by the first run; the second added none, and its time
    assert manifest["stages"]["responses"]["runs"] == 2
    assert manifest["stages"]["responses"]["responses"] == 24


def test_a_finished_run_reruns_to_the_same_draft_without_training(setup, monkeypatch):
    _, config = setup
    config.steps = 5  # the last periodic checkpoint is step 4; the final one is step 5
    run_distill(config)
    weights = (Path(config.out) / "model.safetensors").read_bytes()
    calls = {"n": 0}
    real_loss = distill_run.distill_loss

    def counting_loss(*args):
        calls["n"] += 1
        return real_loss(*args)

    monkeypatch.setattr(distill_run, "distill_loss", counting_loss)
    run_distill(config)
    assert calls["n"] == 0
    assert (Path(config.out) / "model.safetensors").read_bytes() == weights


def test_corrupt_draft_weights_are_refused(setup):
    _, config = setup
    config.steps = 2
    run_distill(config)
    (Path(config.out) / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(DraftFileError, match="model.safetensors are missing or corrupt"):
        load_model(config.out, "cpu")


def test_a_target_with_another_tokenizer_is_refused(setup, tmp_path):
    _, config = setup
    config.steps = 2
    run_distill(config)
    other = list(WORDS)
    other[7] = "xx"
    stranger = load_model(save_model(tmp_path / "stranger", words=other), "cpu")
    draft = load_model(config.out, "cpu")
    with pytest.raises(VocabularyMismatchError, match="first at id 7"):
        SpeculativeDecoder.from_loaded(stranger, draft)


def test_batched_teacher_labels_match_one_sequence_at_a_time(setup):
    teacher_spec, _ = setup
    target = load_model(teacher_spec, "cpu")
    rows = [{"question_id": i, "sample": i % 2, "prompt_ids": list(range(3, 6 + i)),
             "response_ids": list(range(10 + i, 14 + 2 * i))} for i in range(5)]
    head = torch.arange(0, 60)
    batched = distill_run.teacher_labels(target.model, rows, head, 4, prompt_loss=True,
                                         batch_tokens=64)
    single = distill_run.teacher_labels(target.model, rows, head, 4, prompt_loss=True,
                                        batch_tokens=1)
    for (tokens, start), row in zip(batched["sequences"], rows):
        prompt = len(row["prompt_ids"])
        # The prompt is labelled once, on its first response only.
        assert start == (0 if row["sample"] == 0 else prompt - 1)
        assert tokens.tolist() == row["prompt_ids"] + row["response_ids"]
    for a, b in zip(batched["label_probs"], single["label_probs"]):
        assert a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), atol=2e-3, rtol=0)
    assert [len(p) for p in batched["label_probs"]] == [
        len(t) - 1 - s for t, s in batched["sequences"]]


def test_extra_text_is_labelled_at_every_position(setup, tmp_path):
    _, config = setup
    text = tmp_path / "notes.txt"
    text.write_text(" ".join(f"w{i % 50}" for i in range(30)))
    config.extra_text, config.text_chunk_tokens, config.steps = [str(text)], 8, 2
    manifest = run_distill(config)
    (entry,) = manifest["data"]["extra_text"]
    assert entry["path"] == str(text) and entry["tokens"] == 30
    # 4 chunks (8, 8, 8, 6 tokens) add 7 + 7 + 7 + 5 labelled positions to the responses'.
    teacher = torch.load(f"{config.out}/data/teacher.pt")
    assert [len(t) for t, _ in teacher["sequences"][-4:]] == [8, 8, 8, 6]
    assert all(start == 0 for _, start in teacher["sequences"][-4:])
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe not utf-8")
    config.extra_text, config.out = [str(bad)], str(tmp_path / "other")
    with pytest.raises(DraftctlError, match="bad.txt is not UTF-8"):
        run_distill(config)


def test_teacher_labels_resume_from_their_parts_with_features(tmp_path, monkeypatch):
    teacher = load_model(save_model(tmp_path / "teacher"), "cpu", "float32")
    rows = [{"question_id": i, "sample": 0, "prompt_ids": [2 + i, 3 + i],
             "response_ids": [(7 * i + j) % 90 + 2 for j in range(3 + i % 5)]} for i in range(12)]
    head_ids = torch.arange(40)
    kwargs = {"prompt_loss": False, "batch_tokens": 16, "folder": tmp_path / "parts",
              "feature_layers": (1, 2), "part_tokens": 20}
    calls = {"n": 0}
    real = distill_run._label_batch

    def crashing(*args):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(distill_run, "_label_batch", crashing)
    with pytest.raises(KeyboardInterrupt):
        distill_run.teacher_labels(teacher.model, rows, head_ids, 4, **kwargs)
    done = sorted((tmp_path / "parts").glob("part-*.pt"))
    assert done  # whole parts only
    calls["n"] = -100
    resumed = distill_run.teacher_labels(teacher.model, rows, head_ids, 4, **kwargs)
    redone = calls["n"] + 100
    monkeypatch.setattr(distill_run, "_label_batch", real)
    fresh = distill_run.teacher_labels(teacher.model, rows, head_ids, 4,
                                       **{**kwargs, "folder": None})
    assert redone < len(rows)  # parts on disk were loaded, not labelled again
    for key in ("label_ids", "label_probs", "features"):
        for a, b in zip(resumed[key], fresh[key]):
            assert torch.equal(a, b), key
    tokens, _ = resumed["sequences"][3]
    assert resumed["features"][3].shape == (len(tokens), 2, teacher.model.config.hidden_size)
    with pytest.raises(DraftctlError, match="labelled from other responses or layers"):
        distill_run.teacher_labels(teacher.model, rows, head_ids, 4,
                                   **{**kwargs, "feature_layers": (1,)})


def test_the_head_is_sized_by_held_out_coverage_of_the_targets_outputs():
    """Head ids rank the responses' tokens (what the draft must propose), not the prompts':
    a prompt-heavy token set does not push the outputs' tokens out of a small head."""
    rows = [{"prompt_ids": list(range(50, 60)) * 5, "response_ids": list(range(10)) * (1 + i)}
            for i in range(3)]
    heldout = [{"prompt_ids": [1], "response_ids": list(range(10)) * 2}]
    sized = distill_run.head_size_for(rows, heldout, [5, 10, 20], 0.98)
    assert sized["head_size"] == 10 and sized["coverage"] == 1.0
    assert sized["curve"] == {5: 0.5, 10: 1.0, 20: 1.0}
    head = choose_head_ids(rows, 12, always=[96], vocab_size=97)
    assert set(range(10)) | {96} <= set(head.tolist()) and len(head) == 12


def test_length_windows_batch_sequences_of_similar_length_and_reach_every_one():
    """With a window, a batch pads to little more than its sequences' own lengths; every
    sequence still gets picked, and the draws follow ``random``'s state (kept by checkpoints)."""
    rng = random.Random(1)
    lengths = [rng.randrange(20, 1200) for _ in range(400)]
    by_length = sorted(range(400), key=lambda i: lengths[i])

    def padding(picker, draws=300):
        """Padded tokens over real tokens in ``draws`` batches, and the batches."""
        batches = [picker() for _ in range(draws)]
        padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
        return padded / sum(lengths[i] for b in batches for i in b), batches

    random.seed(0)
    anywhere, _ = padding(distill_run.batch_picker(lengths, 8, 0))
    random.seed(0)
    windowed, batches = padding(distill_run.batch_picker(lengths, 8, 16))
    assert anywhere > 1.5 and windowed < 1.1
    for batch in batches:
        assert len(set(batch)) == 8
        ranks = sorted(by_length.index(i) for i in batch)
        assert ranks[-1] - ranks[0] < 16
    random.seed(0)
    picker = distill_run.batch_picker(lengths, 8, 16)
    assert set().union(*(picker() for _ in range(3000))) == set(range(400))
    random.seed(0)
    again = distill_run.batch_picker(lengths, 8, 16)
    assert [again() for _ in range(5)] == batches[:5]
    few = distill_run.batch_picker(lengths[:3], 8, 16)()  # fewer sequences than a batch
    assert sorted(few) == [0, 1, 2]


def test_a_length_window_smaller_than_a_batch_is_refused(setup):
    _, config = setup
    config.length_window = 1
    with pytest.raises(DraftctlError, match="length_window must be 0 .* at least "
                                            "batch_sequences"):
        run_distill(config)


def test_a_second_draft_trains_on_another_runs_data_folder(setup):
    """``data_dir``: a second run (here the feature kind) reuses the first run's responses and
    labels instead of making them again, and a run with other data settings is refused."""
    from dataclasses import replace

    _, config = setup
    config.feature_layers = [1, 2]
    first = run_distill(config)
    data = Path(config.out) / "data"
    responses = (data / "responses.jsonl").read_bytes()
    second = replace(config, kind="feature", out=str(Path(config.out).parent / "feature"),
                     data_dir=str(data))
    manifest = run_distill(second)
    assert (data / "responses.jsonl").read_bytes() == responses
    ledger = distill_run.read_stages(data)  # the second run found every response made
    assert ledger["responses"]["runs"] == 2 and ledger["responses"]["responses"] == 24
    assert manifest["data"]["responses_sha256"] == first["data"]["responses_sha256"]
    assert manifest["architecture"]["kind"] == "feature"
    assert manifest["stages"]["teacher_labels"] == first["stages"]["teacher_labels"]
    with pytest.raises(DraftctlError, match=r"other data settings \(max_new_tokens\)"):
        run_distill(replace(second, max_new_tokens=12))


def test_a_recipe_on_another_runs_data_takes_the_data_settings_it_does_not_state(
        setup, tmp_path, capsys):
    """A recipe naming ``data_dir`` need not repeat the folder's data settings: those it
    leaves out come from the folder's recipe.json; one it states otherwise is refused."""
    import yaml

    from draftctl.cli import main

    _, config = setup
    config.feature_layers = [1, 2]
    first = run_distill(config)
    data = Path(config.out) / "data"
    training = {k: v for k, v in asdict(config).items() if k not in distill_run.DATA_KEYS}
    recipe = tmp_path / "second.yaml"
    recipe.write_text(yaml.safe_dump({**training, "kind": "feature", "data_dir": str(data),
                                      "out": str(tmp_path / "second")}))
    assert main(["distill", "--config", str(recipe)]) == 0
    manifest = json.loads((tmp_path / "second" / "manifest.json").read_text())
    assert manifest["data"]["responses_sha256"] == first["data"]["responses_sha256"]
    assert manifest["config"]["feature_layers"] == [1, 2]  # taken from the folder
    assert manifest["config"]["max_new_tokens"] == 10 != DistillConfig.max_new_tokens
    recipe.write_text(yaml.safe_dump({**training, "data_dir": str(data), "max_new_tokens": 12,
                                      "out": str(tmp_path / "third")}))
    assert main(["distill", "--config", str(recipe)]) == 2
    assert "other data settings (max_new_tokens)" in capsys.readouterr().err


def test_a_recipe_stating_no_data_setting_takes_them_all_from_the_folder(tmp_path):
    made = DistillConfig(prompts="pool.jsonl", max_new_tokens=64, seed=3)
    (tmp_path / "recipe.json").write_text(
        json.dumps({k: getattr(made, k) for k in distill_run.DATA_KEYS}))
    taken = distill_run.check_data_recipe(DistillConfig(), tmp_path, stated=set())
    assert (taken.prompts, taken.max_new_tokens, taken.seed) == ("pool.jsonl", 64, 3)
    with pytest.raises(DraftctlError, match=r"other data settings \(max_new_tokens, seed\)"):
        distill_run.check_data_recipe(DistillConfig(prompts="pool.jsonl"), tmp_path)


def test_a_killed_response_stage_keeps_its_batches_in_the_ledger(setup, monkeypatch):
    """The stage ledger is written batch by batch: a run killed in its third batch has its
    first two counted, and the resumed run adds the rest, so the recipe's totals add up."""
    from transformers import GenerationMixin

    _, config = setup
    real = GenerationMixin.generate
    calls = {"n": 0}

    def dying(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", dying)
    with pytest.raises(KeyboardInterrupt):
        run_distill(config)
    data = Path(config.out) / "data"
    killed = distill_run.read_stages(data)["responses"]
    assert killed["runs"] == 1 and killed["responses"] == 8 and killed["seconds"] > 0
    assert killed["dtype"] == ["float32"]  # the dtype the work was done in
    monkeypatch.setattr(GenerationMixin, "generate", real)
    manifest = run_distill(config)
    assert manifest["stages"]["responses"]["responses"] == 24
    assert manifest["stages"]["responses"]["runs"] == 2
    lines = (data / "responses.jsonl").read_text().splitlines()
    assert len(lines) == 24 and len({(json.loads(x)["question_id"], json.loads(x)["sample"])
                                     for x in lines}) == 24


def test_a_draft_is_refused_for_a_target_it_was_not_distilled_from(setup, tmp_path):
    """Pairing checks the draft's manifest against the target's weights (a draft distilled
    from another model of the same vocabulary is refused, naming both), and its head ids
    against the target's vocabulary."""
    from draftctl.models import check_draft_target

    teacher_spec, config = setup
    config.steps = 2
    run_distill(config)
    target = load_model(teacher_spec, "cpu")
    assert load_model(config.out, "cpu", target=target).model.head_ids.numel() == 40
    other = load_model(save_model(tmp_path / "other", seed=5), "cpu")  # same words, new weights
    with pytest.raises(DraftctlError, match=r"was distilled from .*teacher \(weights sha256 "
                                            r"\w{12}\.\.\.\), not from the target .*other"):
        load_model(config.out, "cpu", target=other)
    with pytest.raises(DraftctlError, match="head ids up to 97, outside the vocabulary"):
        check_draft_target(Path(config.out), torch.tensor([0, 5, 97]), target)


def test_bfloat16_training_runs_under_autocast_and_stays_lossless(setup):
    """``train_dtype: bfloat16`` changes the training passes (not the data): on the same data
    a float32 rerun reproduces the float32 draft, the bfloat16 run does not, and its draft is
    still lossless. An unknown train_dtype is refused by name."""
    from dataclasses import replace

    teacher_spec, config = setup
    first = run_distill(config)
    data = str(Path(config.out) / "data")
    again = run_distill(replace(config, out=str(Path(config.out).parent / "again"),
                                data_dir=data))
    low = replace(config, out=str(Path(config.out).parent / "bf16"), data_dir=data,
                  train_dtype="bfloat16")
    manifest = run_distill(low)
    assert again["training"]["history"] == first["training"]["history"]
    assert manifest["training"]["history"][-1] != first["training"]["history"][-1]
    assert manifest["config"]["train_dtype"] == "bfloat16"
    target = load_model(teacher_spec, "cpu")
    draft = load_model(low.out, "cpu", target=target)
    decoder = SpeculativeDecoder.from_loaded(target, draft, DecodeConfig(max_new_tokens=16))
    ids = target.tokenizer("w3 w4 w5")["input_ids"]
    reference = generate(decoder, ids, make_controller("none")).output_ids
    assert generate(decoder, ids, make_controller("static:3")).output_ids == reference
    with pytest.raises(DraftctlError, match="train_dtype must be one of float32, bfloat16"):
        run_distill(replace(config, train_dtype="float16"))


def test_a_model_draft_of_a_bfloat16_target_saves_and_reloads_in_float32(setup):
    """The target in bfloat16 (its config then names that dtype, and the draft copies its
    config): the draft still trains and reloads in float32, so its int8 weights as saved are
    evaluated and the manifest says how they agree. On a CPU without bfloat16 the target
    falls back to float32, and the manifest says so."""
    from dataclasses import replace

    from draftctl.models import resolve_dtype

    _, config = setup
    manifest = run_distill(replace(config, dtype="bfloat16", steps=2))
    ran = resolve_dtype("bfloat16", torch.device("cpu"))
    assert manifest["made_on"]["target_dtype"] == str(ran)
    assert 0.0 <= manifest["agreement_eval_int8"] <= 1.0


def test_static_and_dynamic_caches_give_the_same_greedy_answers(setup, tmp_path):
    """Distill's answers use a static cache on CPU (no copy of keys and values per step):
    over left-padded batches of prompts of different lengths, float32 greedy answers are the
    dynamic cache's, token for token; an unknown cache is refused by name."""
    from draftctl.distill.data import generate_responses
    from draftctl.prompts import load_prompts

    teacher, config = setup
    target = load_model(teacher, "cpu", "float32")
    prompts = load_prompts(config.prompts, "all", 12)
    rows = {}
    for cache in ("static", "dynamic"):
        path = tmp_path / f"{cache}.jsonl"
        generate_responses(target.model, target.tokenizer, prompts, path, samples_per_prompt=0,
                           max_new_tokens=8, temperature=1.0, top_p=1.0, batch_size=5,
                           max_prompt_tokens=64, seed=0, eos_ids=target.eos_token_ids,
                           cache=cache)
        rows[cache] = sorted(path.read_text().splitlines())
    assert len(rows["static"]) == 12 and rows["static"] == rows["dynamic"]
    assert any(json.loads(r)["response_ids"] for r in rows["static"])
    with pytest.raises(ValueError, match="cache must be"):
        generate_responses(target.model, target.tokenizer, prompts, tmp_path / "x.jsonl",
                           samples_per_prompt=0, max_new_tokens=8, temperature=1.0, top_p=1.0,
                           batch_size=5, max_prompt_tokens=64, seed=0,
                           eos_ids=target.eos_token_ids, cache="paged")


def test_a_run_continues_from_an_earlier_draft(setup):
    """``init_from``: training starts from an earlier draft's weights and keeps its head (the
    recipe's head size is ignored); a draft of another kind, or no draft, is refused."""
    from dataclasses import replace

    teacher_spec, config = setup
    first = run_distill(config)
    second = replace(config, out=str(Path(config.out).parent / "second"), init_from=config.out,
                     head_size=24, steps=3)
    manifest = run_distill(second)
    target = load_model(teacher_spec, "cpu")
    earlier = load_model(config.out, "cpu", target=target).model
    later = load_model(second.out, "cpu", target=target).model
    assert torch.equal(later.head_ids, earlier.head_ids) and later.head_ids.numel() == 40
    # step 0 evaluates the earlier draft's weights as saved, on the same held-out answers
    assert manifest["training"]["history"][0]["agreement"] == pytest.approx(
        first["agreement_eval_int8"], abs=1e-9)
    saved = json.loads((Path(config.out) / "manifest.json").read_text())
    assert manifest["training"]["init_from"]["weights_sha256"] == saved["weights_sha256"]
    assert not torch.equal(later.head.weight, earlier.head.weight)  # and it trained on
    with pytest.raises(DraftctlError, match="is a model draft; this recipe trains a feature"):
        run_distill(replace(second, out=str(Path(config.out).parent / "third"), kind="feature",
                            feature_layers=[1, 2]))
    with pytest.raises(DraftctlError, match="is not a draft distilled by draftctl"):
        run_distill(replace(second, out=str(Path(config.out).parent / "fourth"),
                            init_from=teacher_spec))


def test_labels_made_for_a_continued_draft_train_a_fresh_one_but_not_another_head(setup):
    """A data folder whose labels were made for ``init_from``'s head serves a fresh draft
    (which takes that head), but a run continuing a draft with another head is refused by the
    head ids themselves, not by the recipe's wording."""
    from dataclasses import replace

    _, config = setup
    run_distill(config)  # head of 40 ids
    parent = Path(config.out).parent
    second = replace(config, out=str(parent / "second"), init_from=config.out, steps=2)
    run_distill(second)
    fresh = run_distill(replace(config, out=str(parent / "fresh"), steps=2,
                                data_dir=str(parent / "second" / "data")))
    assert fresh["training"]["init_from"] is None and fresh["architecture"]["head_size"] == 40
    other = replace(config, out=str(parent / "other"), head_size=24, steps=2)
    run_distill(other)
    with pytest.raises(DraftctlError, match=r"has another head \(40 ids\) than the one .* \(24 "
                                            r"ids\); use another data folder"):
        run_distill(replace(other, out=str(parent / "mixed"), init_from=config.out,
                            data_dir=str(parent / "other" / "data")))
