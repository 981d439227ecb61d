"""draftctl bench on a tiny model pair: every output, the identical-output check, ranges."""

import json

import numpy as np
import pytest
import torch

from draftctl.bench import run as bench_run
from draftctl.bench.report import mismatch_notice, setup_line
from draftctl.bench.run import BenchConfig, Run, keep_fastest, modelled_seconds, run_bench
from draftctl.cli import main
from draftctl.collect.run import CollectConfig, run_collect
from draftctl.collect.traces import read_traces
from draftctl.controllers import make_controller
from draftctl.decode import DecodeConfig, SpeculativeDecoder, generate, loop, verify
from draftctl.decode.cached_lm import PassShape
from draftctl.decode.loop import GenerationResult, RoundRecord
from draftctl.errors import DraftctlError
from draftctl.export.onnx import export_onnx
from draftctl.models import encode_prompt, load_model
from draftctl.profile import profile_costs, settle
from draftctl.prompts import load_prompts
from draftctl.retrieval.datastore import SEPARATOR, tokenizer_sha256, write_datastore
from draftctl.train.replay import CostModel, replay
from draftctl.train.run import TrainConfig, run_train
from tests.test_collect import pair  # noqa: F401  (module fixture: tiny target, draft, prompts)


def bench_args(pair, out, *extra):  # noqa: F811
    target, draft, prompts = pair
    return ["bench", "--target", target, "--draft", draft, "--prompts", prompts, "--split", "all",
            "--limit", "4", "--max-new-tokens", "16", "--device", "cpu", "--dtype", "float32",
            "--pass-shape", "fixed:4", "--out", str(out), *extra]


def test_bench_writes_every_output_with_the_documented_fields(pair, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "bench"
    assert main(bench_args(pair, out, "--controllers", "static:1-2,svip:0.5,oracle")) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["ar"]["tokens_per_s"] > 0 and report["mismatches"] == 0
    specs = [c["spec"] for c in report["controllers"]]
    assert specs == ["static:1", "static:2", "svip:0.5", "oracle"]
    fields = {"spec", "tokens_per_s", "speedup_vs_ar", "tau", "acceptance_rate", "drafted",
              "wasted", "target_forwards", "draft_forwards", "controller_us_per_call",
              "mismatches", "per_category"}
    by_spec = {c["spec"]: c for c in report["controllers"]}
    for row in report["controllers"]:
        assert fields <= set(row), row["spec"]
        assert set(row["per_category"]) == {"qa", "rag"}
        assert row["mismatches"] == 0
    static2 = by_spec["static:2"]
    assert static2["drafted"] <= 2 * static2["rounds"] and static2["drafted"] > static2["rounds"]
    assert report["ar"]["target_forwards"] > static2["target_forwards"] - 4  # prefills
    oracle = by_spec["oracle"]
    assert oracle["wasted"] == 0
    assert oracle["tau"] >= max(c["tau"] for c in report["controllers"])
    assert by_spec["svip:0.5"]["controller_us_per_call"] > 0
    assert by_spec["static:1"]["controller_us_per_call"] is None  # never asked per token
    for name in ("report.md", "speedup.png", "acceptance.png", "accepted_lengths.png"):
        assert (out / name).stat().st_size > 0, name
    answers = [json.loads(x) for x in (out / "answers" / "oracle.jsonl").read_text().splitlines()]
    assert len(answers) == 4
    choice = answers[0]["choices"][0]
    assert set(choice) >= {"turns", "decoding_steps", "new_tokens", "wall_time", "accept_lengths"}
    assert sum(choice["accept_lengths"]) == choice["new_tokens"][0]
    assert len(choice["accept_lengths"]) == choice["decoding_steps"][0]
    assert "| `oracle` |" in (out / "report.md").read_text()
    assert "mismatch" in capsys.readouterr().out


def test_a_rows_modelled_time_is_its_rounds_at_the_profiles_costs():
    """Each round costs its draft steps and one verification pass of its drafts plus one
    token at the pass shape (here fixed:2, so 3 new tokens take two passes)."""
    cost = CostModel(t_draft=0.01, t_verify=(0.1, 0.12, 0.2), shape=PassShape.parse("fixed:2"))

    def round_of(drafted: int, forwards: int, draft_s: float = 0.0) -> RoundRecord:
        return RoundRecord(0, [5] * drafted, [], 0, [], [], [], [5], 0, forwards, draft_s, 0.0,
                           0.0, 0)

    result = GenerationResult([1], [5, 5, 5], [round_of(2, 3), round_of(0, 0), round_of(1, 1)],
                              9.0, 4, 4, "max_new_tokens")
    assert modelled_seconds(result, cost) == pytest.approx(
        3 * 0.01 + 2 * 0.12 + 0.12 + 0.01 + 0.12)
    # retrieval drafts: no draft step, each round's measured lookup instead (an empty trie's too)
    tries = GenerationResult([1], [5, 5], [round_of(3, 0, 0.004), round_of(0, 0, 0.002)],
                             9.0, 2, 0, "max_new_tokens")
    assert modelled_seconds(tries, cost) == pytest.approx(2 * 0.12 + 0.12)
    assert modelled_seconds(tries, cost, lookups=True) == pytest.approx(
        0.004 + 2 * 0.12 + 0.002 + 0.12)


def test_step_costs_follow_the_pass_shapes_steps():
    """The cost rule's scale: one more draft after k costs a draft step plus the longer
    verification, over a plain step. At fixed:2 every second draft opens a new pass."""
    cost = CostModel(t_draft=0.01, t_verify=(0.1, 0.12, 0.2), shape=PassShape.parse("fixed:2"))
    assert cost.step_costs(3) == pytest.approx([0.13 / 0.12, 0.01 / 0.12, 0.13 / 0.12])
    free = CostModel(t_draft=0.01, t_verify=(0.1, 0.12, 0.2, 0.15))
    assert free.step_costs(2) == pytest.approx([(0.01 + 0.08) / 0.1, (0.01 - 0.05) / 0.1])


def test_bench_reports_each_rows_modelled_speedup_with_a_profile(pair, tmp_path, capsys):  # noqa: F811
    """With a calibrated profile the report gives every row its modelled rate next to the
    clock's: AR's is one one-token pass per token, a speculative row's lies between its
    rounds at the cheapest and at the dearest pass plus its draft steps; without a profile
    the column is empty."""
    target, draft, _ = pair
    setup = settle(target, draft, "cpu", "float32", "fixed:4", need_profile=True,
                   progress=False)
    out = tmp_path / "modelled"
    assert main(bench_args(pair, out, "--controllers", "static:2,oracle", "--profile",
                           str(setup.profile_path), "--no-plots")) == 0
    report = json.loads((out / "report.json").read_text())
    cost = CostModel.from_run({"cost": profile_costs(setup, setup.shape)})
    assert report["ar"]["modelled_tokens_per_s"] == pytest.approx(1 / cost.verify(1))
    rows = {r["spec"]: r for r in report["controllers"]}
    for row in rows.values():
        assert row["modelled_speedup_vs_ar"] == pytest.approx(
            row["modelled_tokens_per_s"] / report["ar"]["modelled_tokens_per_s"])
        for cat, group in row["per_category"].items():
            assert group["modelled_speedup_vs_ar"] > 0, cat
        seconds = row["new_tokens"] / row["modelled_tokens_per_s"]
        passes = [cost.verify(n) for n in range(1, 10)]
        steps = row["draft_forwards"] * cost.t_draft
        assert steps + row["rounds"] * min(passes) <= seconds + 1e-9
        assert seconds <= steps + row["rounds"] * max(passes) + 1e-9
        assert seconds > row["rounds"] * cost.verify(1)
    assert "modelled" in capsys.readouterr().out
    assert "| modelled speedup |" in (out / "report.md").read_text()
    bare = tmp_path / "bare"
    assert main(bench_args(pair, bare, "--controllers", "static:2", "--no-plots")) == 0
    report = json.loads((bare / "report.json").read_text())
    assert report["controllers"][0]["modelled_speedup_vs_ar"] is None
    assert "'modelled'" not in setup_line(report)


def test_bench_exits_non_zero_when_an_output_differs(pair, tmp_path, monkeypatch):  # noqa: F811
    def accept_everything(draft_tokens, target_logits):  # a corrupting test double
        k = draft_tokens.shape[0]
        return verify.Verdict(k, target_logits[k].argmax().view(()), torch.ones(k))

    monkeypatch.setattr(loop, "verify_greedy", accept_everything)
    out = tmp_path / "bad"
    assert main(bench_args(pair, out, "--controllers", "static:3", "--no-plots")) == 1
    report = json.loads((out / "report.json").read_text())
    assert report["controllers"][0]["mismatches"] > 0


def test_only_draftctls_chain_decoder_fails_a_bench_on_differing_outputs():
    """Differing greedy outputs fail draftctl's own chain decoder, which promises bit-exact
    output; transformers' generate() (and tree passes) are counted and named, not failed."""
    rows = [{"spec": "hf:constant:1", "schedule": "transformers", "mismatches": 3},
            {"spec": "static:1", "schedule": "draftctl", "mismatches": 4}]
    hf_report = {"engine": "transformers", "mismatches": 7, "tree_mismatches": 0,
                 "target_dtype": "bfloat16", "controllers": rows}
    notices, failed = mismatch_notice(hf_report)
    assert not failed and len(notices) == 1
    assert "7 outputs" in notices[0] and "3 of them from transformers' own" in notices[0]
    assert "bfloat16" in notices[0]
    own = {"mismatches": 2, "tree_mismatches": 5, "controllers": []}
    notices, failed = mismatch_notice(own)
    assert failed and "tree" in notices[0] and "lossless decoder" in notices[1]
    assert mismatch_notice({"mismatches": 0, "tree_mismatches": 0}) == ([], False)


def test_repeated_passes_keep_each_runs_fastest(pair, tmp_path, monkeypatch):  # noqa: F811
    """``--repeats 2``: every prompt is decoded twice by every spec, in another order; the
    report counts each prompt once per spec, with the time of its faster pass."""
    calls = []
    timed = bench_run._run

    def recording(decoder, tokenizer, prompt, ids, spec, *args, **kwargs):
        run = timed(decoder, tokenizer, prompt, ids, spec, *args, **kwargs)
        calls.append(run)
        return run

    monkeypatch.setattr(bench_run, "_run", recording)
    out = tmp_path / "twice"
    assert main(bench_args(pair, out, "--controllers", "static:2,svip:0.5", "--repeats", "2",
                           "--no-plots")) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["prompts"] == 4 and report["mismatches"] == 0
    specs = ["none", "static:2", "svip:0.5", "ar-fastest"]
    assert len(calls) == 2 * 4 * len(specs)
    for spec in specs:
        mine = [c for c in calls if c.spec == spec]
        best = sum(min(c.result.wall_s for c in mine if c.question_id == q)
                   for q in {c.question_id for c in mine})
        row = report["ar"] if spec == "none" else report["ar_fastest"] \
            if spec == "ar-fastest" else next(r for r in report["controllers"]
                                              if r["spec"] == spec)
        assert row["wall_s"] == pytest.approx(best), spec
    firsts = [[c.spec for c in calls[i:i + len(specs)]] for i in range(0, len(calls),
                                                                        len(specs))]
    assert firsts[0][1:] != firsts[1][1:]  # the second pass runs the specs in another order
    lines = (out / "answers" / "static-2.jsonl").read_text().splitlines()
    assert sorted(json.loads(x)["question_id"] for x in lines) == sorted(
        {c.question_id for c in calls})
    assert "fastest of 2 interleaved passes" in setup_line(report)


def test_the_fastest_pass_keeps_a_mismatch_from_any_pass():
    def run(spec, wall, mismatch):
        result = GenerationResult(prompt_ids=[1], output_ids=[2], rounds=[], wall_s=wall,
                                  target_forwards=1, draft_forwards=0, stop_reason="eos")
        return Run(spec, 7, "qa", result, "x", mismatch)

    best = {}
    keep_fastest(best, [run("static:2", 2.0, True), run("svip", 1.0, False),
                        run("sampled", 3.0, None)])
    keep_fastest(best, [run("static:2", 1.5, False), run("svip", 1.2, False),
                        run("sampled", 2.5, None)])
    assert {s: (r.result.wall_s, r.mismatch) for s, r in best.items()} == {
        "static:2": (1.5, True), "svip": (1.0, False), "sampled": (2.5, None)}


def test_bench_refuses_bad_requests(pair, tmp_path):  # noqa: F811
    target, draft, prompts = pair
    base = {"target": target, "draft": draft, "prompts": prompts, "split": "all",
            "device": "cpu", "out": str(tmp_path / "x")}
    with pytest.raises(Exception, match="oracle needs greedy decoding"):
        run_bench(BenchConfig(**base, controllers=["oracle"], temperature=0.8))
    with pytest.raises(Exception, match="listed twice"):
        run_bench(BenchConfig(**base, controllers=["static:2", "static:1-3"]))
    with pytest.raises(Exception, match="name a drafter after '@'"):
        run_bench(BenchConfig(**base, controllers=["static:2@"]))
    with pytest.raises(Exception, match="unknown drafter 'ngram'"):
        run_bench(BenchConfig(**base, controllers=["static:2@ngram"]))
    with pytest.raises(DraftctlError, match="repeats must be at least 1, got 0"):
        run_bench(BenchConfig(**base, controllers=["static:2"], repeats=0))


def test_bench_and_decode_with_a_rest_datastore(pair, tmp_path, capsys):  # noqa: F811
    target = pair[0]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(f"w{(i * 7 + j) % 90}" for j in range(40))
                                for i in range(30)))
    assert main(["datastore", "build", "--target", target, "--corpus", str(corpus),
                 "--out", str(tmp_path / "ds")]) == 0
    drafter = f"rest:{tmp_path / 'ds'}"
    out = tmp_path / "rest"
    assert main(bench_args(pair, out, "--controllers", "static:10,static:2", "--drafter",
                           drafter, "--no-plots")) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["draft"] == drafter and report["mismatches"] == 0
    assert [c["spec"] for c in report["controllers"]] == ["static:10", "static:2"]
    assert main(bench_args(pair, tmp_path / "x", "--controllers", "oracle", "--drafter",
                           drafter)) == 2
    assert "does not apply to retrieval" in capsys.readouterr().err
    assert main(["decode", "--target", target, "--drafter", drafter, "--controller", "static:5",
                 "--prompt", "w1 w8 w15", "--max-new-tokens", "8", "--device", "cpu",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["new_tokens"] == 8
    drafted = {}
    for option in ("", ",max_nodes=2"):  # "w2 w3" occurs in the corpus: a wide first trie
        assert main(["decode", "--target", target, "--drafter", drafter + option,
                     "--controller", "static:5", "--prompt", "w1 w2 w3", "--max-new-tokens",
                     "8", "--device", "cpu", "--json"]) == 0
        drafted[option] = json.loads(capsys.readouterr().out.splitlines()[-1])[
            "drafted_per_round"]
    assert drafted[""][0] > 2 and drafted[",max_nodes=2"][0] == 2
    assert main(["decode", "--target", target, "--drafter", f"{drafter},width=2",
                 "--prompt", "w1", "--device", "cpu"]) == 2
    assert "'width=2' is not key=integer" in capsys.readouterr().err


def test_retrieval_traces_train_a_trie_pruning_controller(pair, tmp_path):  # noqa: F811
    target, _, prompts = pair
    # A corpus holding the target's own greedy answers to half the prompts, and noise.
    model = load_model(target, "cpu")
    plain = SpeculativeDecoder.from_loaded(model, None, DecodeConfig(max_new_tokens=20))
    rng = np.random.default_rng(0)
    corpus = []
    for p in load_prompts(prompts)[::2]:
        ids = encode_prompt(model.tokenizer, p.text)
        out = generate(plain, ids, make_controller("none")).output_ids
        corpus += [*ids, *out, SEPARATOR, *ids[-3:], *rng.integers(3, 90, 8), SEPARATOR]
    write_datastore(np.asarray(corpus, dtype=np.uint32), tmp_path / "ds",
                    {"tokenizer": "words", "tokenizer_sha256": tokenizer_sha256(model.tokenizer)})
    drafter = f"rest:{tmp_path / 'ds'},max_nodes=8"
    traces = tmp_path / "traces"
    run_collect(CollectConfig(target=target, drafter=drafter, prompts=prompts, split="all",
                              mode="probe", k_probe=6, max_new_tokens=20, device="cpu",
                              out=str(traces)))
    info = json.loads((traces / "run.json").read_text())
    assert info["drafter"] == "retrieval" and len(info["cost"]["t_verify_s"]) >= 9
    assert info["cost"]["pass_shape"] == "free"  # a trie is verified in one unpadded pass
    rows = read_traces(traces).to_pylist()
    nodes = [r for r in rows if r["node"] >= 0]
    assert nodes and all(not r["reached"] for r in rows if r["node"] < 0)  # empty tries
    by_key = {(r["prompt_id"], r["round"], r["node"]): r for r in nodes}
    for r in nodes:
        parent = by_key.get((r["prompt_id"], r["round"], r["parent"]))
        assert r["reached"] == (r["parent"] < 0 or parent["accepted"])
        assert r["accepted"] == (r["reached"] and r["target_top1_match"])
        assert 1 <= r["position"] <= 6 and r["occurrences"] >= 1 and r["suffix_len"] >= 2
        assert 0 < r["token_share"] <= 1 and r["node_share"] <= r["token_share"] + 1e-9
    # Replaying the collection's own policy gives back its rounds exactly.
    rounds = {(r["prompt_id"], r["round"]): r["round_accepted"] for r in rows}
    (probe, oracle, shallow) = replay(traces, ["static:6", "oracle", "static:1"])
    assert probe["rounds"] == len(rounds)
    assert probe["tokens"] == sum(a + 1 for a in rounds.values())
    assert oracle["tokens"] == probe["tokens"] and oracle["drafted"] <= probe["drafted"]
    assert shallow["tokens"] <= probe["tokens"] and shallow["drafted"] < probe["drafted"]
    # A learned controller on the retrieval features prunes the trie; the output stays exact.
    report = run_train(TrainConfig(traces=str(traces), kind="logreg", out=str(tmp_path / "m"),
                                   grid=6))
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert {"suffix_len", "occurrences", "node_share", "token_share"} <= set(
        manifest["features"]) and manifest["cost_ratio"] is None
    assert set(report["dev_by_stop"]) == {"token", "path"}  # no draft step: no cost rule
    with pytest.raises(DraftctlError, match="cost stop rule needs a draft model's step cost"):
        run_train(TrainConfig(traces=str(traces), kind="logreg", stop="cost",
                              out=str(tmp_path / "c"), grid=6))
    export_onnx(tmp_path / "m", tmp_path / "m.onnx")
    out = tmp_path / "bench"
    assert main(bench_args(pair, out, "--controllers", f"static:6,svip,onnx:{tmp_path}/m.onnx",
                           "--drafter", drafter, "--no-plots")) == 0
    bench = json.loads((out / "report.json").read_text())
    assert bench["mismatches"] == 0 and len(bench["controllers"]) == 3
    # One run comparing the model draft, REST and AR: a controller names its own drafter.
    out = tmp_path / "both"
    assert main(bench_args(pair, out, "--controllers", f"static:1-2,static:6@{drafter}",
                           "--no-plots")) == 0
    bench = json.loads((out / "report.json").read_text())
    draft = pair[1]
    assert [(c["spec"], c["drafter"]) for c in bench["controllers"]] == [
        ("static:1", draft), ("static:2", draft), (f"static:6@{drafter}", drafter)]
    assert bench["mismatches"] == 0 and bench["draft"] == draft
    rest_row = bench["controllers"][2]
    assert rest_row["draft_forwards"] == 0 and rest_row["drafted"] > 0
    assert "static:6@rest:ds,max_nodes=8" in (out / "report.md").read_text()


def test_chat_corpus_holds_the_targets_own_answers(pair, tmp_path, capsys):  # noqa: F811
    target, _, prompts = pair
    out = tmp_path / "chat"
    assert main(["datastore", "build", "--target", target, "--corpus", "chat", "--prompts",
                 prompts, "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    train = load_prompts(prompts, "train")
    (source,) = manifest["responses"]
    assert source["responses"] == len(train) and manifest["documents"] == len(train)
    # On a train prompt the datastore holds the target's exact continuation: REST accepts it.
    capsys.readouterr()
    assert main(["decode", "--target", target, "--drafter", f"rest:{out}", "--controller",
                 "static:8", "--prompt", train[0].text, "--max-new-tokens", "16", "--device",
                 "cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert sum(result["accepted_per_round"]) >= result["new_tokens"] // 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "no ids here"}\n')
    assert main(["datastore", "build", "--target", target, "--responses", str(bad), "--out",
                 str(tmp_path / "x")]) == 2
    assert "is not a responses file" in capsys.readouterr().err


def test_bench_engine_hf_runs_transformers_schedules_and_draftctl_controllers(
        pair, tmp_path):  # noqa: F811
    """``--engine hf``: AR is plain generate(); transformers' own schedules and draftctl
    controllers run inside generate(), every greedy output equal to plain generate()'s;
    at T=1 every run of a prompt starts from one seed and no mismatch is counted."""
    out = tmp_path / "hf"
    specs = "hf:constant:2-3,hf:heuristic,hf:confidence:0.4,static:3,svip:0.5"
    assert main(bench_args(pair, out, "--engine", "hf", "--controllers", specs,
                           "--no-plots")) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["engine"] == "transformers" and report["mismatches"] == 0
    assert report["pass_shape"] == "free" and not report["bit_exact"]
    by_spec = {c["spec"]: c for c in report["controllers"]}
    assert list(by_spec) == ["hf:constant:2", "hf:constant:3", "hf:heuristic",
                             "hf:confidence:0.4", "static:3", "svip:0.5"]
    assert by_spec["hf:constant:3"]["schedule"] == "transformers"
    assert by_spec["static:3"]["schedule"] == "draftctl"
    for spec in ("hf:constant:3", "static:3"):  # both draft 3 a round, bar cut rounds
        row = by_spec[spec]
        assert row["rounds"] < row["drafted"] <= 3 * row["rounds"], spec
        assert row["tokens_per_s"] > 0 and row["speedup_vs_ar"] > 0
    assert by_spec["svip:0.5"]["controller_us_per_call"] > 0
    target, draft, prompts = pair
    other = tmp_path / "other-draft"  # a second assistant, named by a spec's @DRAFT
    load_model(draft, "cpu").model.save_pretrained(other)
    load_model(draft, "cpu").tokenizer.save_pretrained(other)
    mixed = tmp_path / "hf-mixed"
    assert main(bench_args(pair, mixed, "--engine", "hf", "--controllers",
                           f"hf:constant:2@{other},static:2", "--no-plots")) == 0
    rows = json.loads((mixed / "report.json").read_text())["controllers"]
    assert [r["drafter"] for r in rows] == [str(other), draft]
    assert all(r["mismatches"] == 0 for r in rows)
    sampled = tmp_path / "hf-t1"
    assert main(bench_args(pair, sampled, "--engine", "hf", "--controllers", "hf:constant:2,"
                           "static:2", "--temperature", "1", "--repeats", "2",
                           "--no-plots")) == 0
    report = json.loads((sampled / "report.json").read_text())
    assert report["mismatches"] is None and not report["greedy"]
    assert report["prompts"] == 4 and report["config"]["repeats"] == 2
    assert len((sampled / "answers" / "static-2.jsonl").read_text().splitlines()) == 4
    base = {"target": target, "draft": draft, "prompts": prompts, "split": "all",
            "device": "cpu", "engine": "hf", "out": str(tmp_path / "x")}
    with pytest.raises(DraftctlError, match="oracle needs the reference output"):
        run_bench(BenchConfig(**base, controllers=["oracle"]))
    with pytest.raises(DraftctlError, match="unknown transformers schedule"):
        run_bench(BenchConfig(**base, controllers=["hf:fast"]))
    with pytest.raises(DraftctlError, match="unknown engine 'vllm'"):
        run_bench(BenchConfig(**{**base, "engine": "vllm"}, controllers=["static:2"]))


def test_bench_engine_hf_runs_lookup_both_ways(pair, tmp_path):  # noqa: F811
    """``--engine hf`` runs transformers' own prompt lookup (``hf:lookup:N``, no assistant)
    beside draftctl controllers drafting with a feature draft mixed with context lookup
    (``@model+lookup``), every greedy output equal to plain generate()'s; lookup alone and
    a transformers schedule with lookup are refused by name."""
    from draftctl.distill.feature import from_target, save_feature_draft

    target, _, prompts = pair
    model = load_model(target, "cpu").model
    folder = tmp_path / "feature-draft"
    vocab = model.config.vocab_size
    save_feature_draft(from_target(model, torch.arange(vocab), (1, 2)), folder, target, {})
    args = bench_args(pair, tmp_path / "hf", "--engine", "hf", "--draft", str(folder),
                      "--controllers", "hf:lookup:3,static:2@model+lookup,alone=2,svip:0.5",
                      "--no-plots")
    assert main(args) == 0
    report = json.loads((tmp_path / "hf" / "report.json").read_text())
    rows = {c["spec"]: c for c in report["controllers"]}
    assert report["mismatches"] == 0 and list(rows) == [
        "hf:lookup:3", "static:2@model+lookup,alone=2", "svip:0.5"]
    assert rows["hf:lookup:3"]["drafter"] == "transformers' prompt lookup"
    assert rows["hf:lookup:3"]["draft_forwards"] <= 3 * rows["hf:lookup:3"]["rounds"]
    assert rows["static:2@model+lookup,alone=2"]["drafter"] == \
        f"{folder} with model+lookup,alone=2"
    assert rows["svip:0.5"]["drafter"] == str(folder)
    assert rows["svip:0.5"]["controller_us_per_call"] > 0
    base = {"target": target, "prompts": prompts, "split": "all", "device": "cpu",
            "dtype": "float32", "engine": "hf", "out": str(tmp_path / "x")}
    for spec in ("static:2@lookup", "hf:constant:2@model+lookup", "svip@rest:/nowhere"):
        with pytest.raises(DraftctlError, match="hf:lookup:N is transformers' own prompt "
                                                "lookup"):
            run_bench(BenchConfig(**base, draft=str(folder), controllers=[spec]))


def test_bench_engine_hf_runs_every_row_on_packed_linear_layers(pair, tmp_path):  # noqa: F811
    """``--engine hf --kernels packed``: plain generate() and every schedule run on the
    models' packed views, greedy outputs still equal to plain generate()'s, and the report
    says so; draftctl's engine refuses the flag (its kernels follow --pass-shape)."""
    from draftctl.decode import kernels

    target, draft, prompts = pair
    if kernels.packable(load_model(target, "cpu").model):
        pytest.skip(kernels.packable(load_model(target, "cpu").model))
    out = tmp_path / "packed"
    assert main(bench_args(pair, out, "--engine", "hf", "--kernels", "packed",
                           "--controllers", "hf:constant:2,static:2", "--no-plots")) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["kernels"] == "packed" and report["mismatches"] == 0
    assert [c["spec"] for c in report["controllers"]] == ["hf:constant:2", "static:2"]
    assert "linear layers packed" in (out / "report.md").read_text()
    base = {"target": target, "draft": draft, "prompts": prompts, "split": "all",
            "device": "cpu", "out": str(tmp_path / "x"), "controllers": ["static:2"]}
    with pytest.raises(DraftctlError, match="applies to --engine hf"):
        run_bench(BenchConfig(**base, kernels="packed"))
    with pytest.raises(DraftctlError, match="unknown kernels 'fast'"):
        run_bench(BenchConfig(**base, engine="hf", kernels="fast"))


def test_bench_at_t1_runs_every_controller_from_one_seed(pair, tmp_path):  # noqa: F811
    """Sampling (T=1): every controller but the oracle runs, each prompt from the configured
    seed (so a rerun repeats every output, another seed changes them), and no mismatch
    count is reported, documented in the report's sampling note."""
    specs = "static:1-3,heuristic,confidence,pmin,svip:0.5,adaedl"

    def answers(out, seed):
        assert main(bench_args(pair, out, "--controllers", specs, "--temperature", "1",
                               "--seed", str(seed), "--no-plots")) == 0
        report = json.loads((out / "report.json").read_text())
        texts = {p.stem: p.read_text() for p in (out / "answers").glob("*.jsonl")}
        return report, {k: [json.loads(x)["choices"][0]["turns"] for x in v.splitlines()]
                        for k, v in texts.items()}

    report, first = answers(tmp_path / "a", 3)
    assert report["mismatches"] is None and report["sampling"]["seed"] == 3
    assert "no mismatches are counted" in report["sampling"]["note"]
    assert all(row["mismatches"] is None for row in report["controllers"])
    assert len(report["controllers"]) == 8 and all(r["tokens_per_s"] > 0
                                                   for r in report["controllers"])
    _, again = answers(tmp_path / "b", 3)
    _, other = answers(tmp_path / "c", 4)
    assert again == first and other != first


def test_lookup_drafters_through_collect_train_and_bench(pair, tmp_path):  # noqa: F811
    """Dense traces of the draft mixed with lookup keep the lookup features, a controller
    trained on them reads those, and bench runs it beside lookup alone, losslessly."""
    target, draft, prompts = pair
    traces = tmp_path / "traces"
    run_collect(CollectConfig(target=target, draft=draft, drafter="model+lookup",
                              prompts=prompts, split="all", mode="dense", k_probe=4,
                              max_new_tokens=20, device="cpu", dtype="float32",
                              pass_shape="fixed:4", out=str(traces)))
    info = json.loads((traces / "run.json").read_text())
    assert info["drafter"] == "model+lookup" and info["lookup"]["weight"] == 0.5
    rows = read_traces(traces).to_pylist()
    assert any(r["suffix_len"] > 0 for r in rows) and any(r["suffix_len"] == 0 for r in rows)
    run_train(TrainConfig(traces=str(traces), kind="logreg", out=str(tmp_path / "m"), grid=6))
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert {"suffix_len", "occurrences", "node_share"} <= set(manifest["features"])
    export_onnx(tmp_path / "m", tmp_path / "m.onnx")
    with pytest.raises(DraftctlError, match="dense mode follows a draft model"):
        CollectConfig(target=target, drafter="lookup", mode="dense")
    out = tmp_path / "bench"
    assert main(bench_args(pair, out, "--controllers",
                           f"static:2,onnx:{tmp_path}/m.onnx@model+lookup,static:4@lookup",
                           "--no-plots")) == 0
    bench = json.loads((out / "report.json").read_text())
    rows = {c["spec"]: c for c in bench["controllers"]}
    assert bench["mismatches"] == 0 and rows["static:4@lookup"]["draft_forwards"] == 0
    assert rows["static:4@lookup"]["drafted"] > 0 and rows["static:4@lookup"]["bit_exact"]
    assert rows[f"onnx:{tmp_path}/m.onnx@model+lookup"]["drafter"] == f"{draft}+lookup"
