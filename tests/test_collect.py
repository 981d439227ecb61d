"""Collect traces on a tiny model pair, replay them, and survive crashes."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pyarrow.parquet as pq
import pytest
import torch

from draftctl.collect import run as collect_run
from draftctl.collect.run import CollectConfig, run_collect
from draftctl.collect.traces import TraceError, read_traces
from draftctl.controllers import make_controller
from draftctl.decode import DecodeConfig, SpeculativeDecoder, generate
from draftctl.decode.cached_lm import CachedLM
from draftctl.decode.features import SCHEMA_VERSION, distribution_stats
from draftctl.decode.loop import DEFAULT_ROWS
from draftctl.errors import DraftctlError
from draftctl.models import encode_prompt, load_model, perturbed_copy
from draftctl.profile import read_profile
from draftctl.prompts import load_prompts
from draftctl.train.replay import replay
from tests.conftest import make_decoder
from tests.test_models import save_model, word_tokenizer


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = save_model(root / "target")
    draft_model = perturbed_copy(load_model(target, "cpu").model, 0.3, seed=1)
    draft_model.save_pretrained(root / "draft")
    word_tokenizer().save_pretrained(root / "draft")
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(
        json.dumps({"question_id": i, "category": ["qa", "rag"][i % 2],
                    "turns": [" ".join(f"w{(i * 11 + j) % 90}" for j in range(2 + i % 5))]})
        for i in range(10)))
    return target, str(root / "draft"), str(prompts)


def config(pair, out, **kw) -> CollectConfig:
    target, draft, prompts = pair
    base = {"target": target, "draft": draft, "prompts": prompts, "split": "all",
            "max_new_tokens": 20, "k_probe": 6, "device": "cpu", "dtype": "float32",
            "pass_shape": f"fixed:{DEFAULT_ROWS}", "out": str(out)}
    return CollectConfig(**{**base, **kw})


def real_rounds(pair, spec: str, max_new_tokens=20, max_draft=6) -> tuple[int, int, int]:
    """(rounds, drafted tokens, draft forwards) of real decoding over the pair's prompts."""
    target_spec, draft_spec, prompts = pair
    target = load_model(target_spec, "cpu")
    draft = load_model(draft_spec, "cpu")
    decoder = SpeculativeDecoder.from_loaded(
        target, draft, DecodeConfig(max_new_tokens=max_new_tokens, max_draft=max_draft))
    rounds = drafted = forwards = 0
    for p in load_prompts(prompts):
        prompt_ids = encode_prompt(target.tokenizer, p.text)
        controller = make_controller(spec)
        if spec == "oracle":
            controller.set_reference(generate(decoder, prompt_ids,
                                              make_controller("none")).output_ids)
        result = generate(decoder, prompt_ids, controller)
        rounds += len(result.rounds)
        drafted += sum(r.drafted for r in result.rounds)
        forwards += sum(r.draft_forwards for r in result.rounds)
    return rounds, drafted, forwards


def test_dense_replay_equals_real_runs_exactly(pair, tmp_path):
    run_collect(config(pair, tmp_path / "dense", mode="dense"))
    specs = ["static:1", "static:3", "static:6", "heuristic", "svip:0.6", "pmin:0.3"]
    results = {r["spec"]: r for r in replay(tmp_path / "dense", specs + ["oracle"])}
    for spec in specs + ["oracle"]:
        rounds, drafted, forwards = real_rounds(pair, spec)
        assert results[spec]["target_forwards"] == rounds, spec
        assert results[spec]["drafted"] == drafted, spec
        assert results[spec]["draft_forwards"] == forwards, spec  # the oracle's mismatches too
    oracle = results["oracle"]
    assert oracle["wasted"] == 0
    assert all(oracle["tau"] >= results[s]["tau"] for s in specs)
    info = json.loads((tmp_path / "dense" / "run.json").read_text())
    assert len(info["cost"]["t_verify_s"]) >= 7 and info["cost"]["t_draft_s"] > 0
    assert info["cost"]["pass_shape"] == f"fixed:{DEFAULT_ROWS}"
    assert info["feature_schema_version"] == SCHEMA_VERSION and info["drafter"] == "model"


def test_traces_at_the_exact_shape_carry_its_own_cost_curve(pair, tmp_path):
    """replay models time with the curve the decoder really had: the exact shape's kernels
    have a curve of their own in the profile, and that is the one the traces record."""
    run_collect(config(pair, tmp_path / "exact", mode="probe", limit=2, pass_shape="exact"))
    cost = json.loads((tmp_path / "exact" / "run.json").read_text())["cost"]
    entry = read_profile(cost["profile"])["target"]["by_dtype"]["float32"]
    assert cost["pass_shape"] == "exact" and cost["pad_to"] == list(range(1, 1 + len(
        cost["t_verify_s"])))
    assert cost["t_verify_s"] == [t / 1e3 for t in entry["exact_shape"]["t_ms"].values()]
    assert cost["t_verify_s"] != [t / 1e3 for t in entry["t_ms"].values()]


def test_batched_dense_rows_equal_step_by_step_drafting(tiny_models):
    target, draft = tiny_models
    decoder = make_decoder(target, draft, max_new_tokens=12, max_draft=5)
    prompt = [3, 14, 15, 9, 26]
    rows = collect_run.dense_rows(decoder, prompt, 5, "run", 1, "qa")
    output = generate(decoder, prompt, make_controller("none")).output_ids
    seq = prompt + output
    assert len(rows) == len(output) * 5
    lm = CachedLM(draft, 97)
    for t in range(len(output)):
        lm.reset()
        logits = lm.forward(torch.tensor(seq[:len(prompt) + t]), last_only=True)
        expect = []
        for _ in range(5):
            expect.append(int(logits.argmax()))
            entropy = distribution_stats(torch.softmax(logits, -1))[0, 0]
            mine = rows[t * 5 + len(expect) - 1]
            assert mine["entropy"] == pytest.approx(float(entropy), abs=1e-4)
            logits = lm.forward(logits.argmax(dim=-1), last_only=True)
        assert [r["draft_token"] for r in rows[t * 5:t * 5 + 5]] == expect, t
        truth = seq[len(prompt) + t:len(prompt) + t + 5]
        match = next((j for j, (a, b) in enumerate(zip(expect, truth)) if a != b), len(truth))
        assert rows[t * 5]["match_len"] == match
    # the target's entropy over each round's first input token, as the live decoder sees it
    with torch.no_grad():
        target_logits = target(torch.tensor([seq])).logits[0].float()
    entropies = torch.special.entr(torch.softmax(target_logits, -1)).sum(-1)
    for t in range(len(output)):
        for row in rows[t * 5:t * 5 + 5]:
            assert row["target_entropy"] == pytest.approx(float(entropies[len(prompt) + t - 2]),
                                                          abs=1e-4)
            assert row["cum_logq"] == pytest.approx(math.log(row["cum_top1"]), abs=1e-5)


def test_probe_rows_are_readable_with_datasets_and_consistent(pair, tmp_path):
    run_collect(config(pair, tmp_path / "probe", mode="probe", limit=4))
    files = sorted(str(p) for p in (tmp_path / "probe" / "shards").glob("*.parquet"))
    rows = datasets.load_dataset("parquet", data_files=files, split="train")
    assert len(rows) > 0 and set(rows["position"]) <= set(range(1, 7))
    table = read_traces(tmp_path / "probe").to_pylist()
    for row in table:
        assert row["round_drafted"] == 6 or row["position"] <= row["round_drafted"]
        assert row["accepted"] == (row["position"] <= row["round_accepted"])
        assert row["reached"] == (row["position"] <= row["round_accepted"] + 1)
        assert row["target_top1_match"] == (row["accept_prob"] == 1.0)  # greedy
    assert {r["category"] for r in table} == {"qa", "rag"}
    results = replay(tmp_path / "probe", ["static:2", "oracle"])
    assert results[1]["tau"] >= results[0]["tau"]


def _keys(folder):
    table = read_traces(folder)
    return sorted(zip(*(table.column(c).to_pylist() for c in ("prompt_id", "round", "position"))))


def test_a_crashed_collection_resumes_without_lost_or_duplicated_rows(pair, tmp_path,
                                                                       monkeypatch):
    run_collect(config(pair, tmp_path / "straight", mode="probe"))
    real_write = collect_run.write_shard
    calls = {"n": 0}

    def crashing_write(rows, path, mode, prompt_sha256):
        calls["n"] += 1
        if calls["n"] == 4:
            path.with_name(f".{path.name}.tmp").write_bytes(b"half a shard")  # torn write
            raise KeyboardInterrupt
        real_write(rows, path, mode, prompt_sha256)

    monkeypatch.setattr(collect_run, "write_shard", crashing_write)
    with pytest.raises(KeyboardInterrupt):
        run_collect(config(pair, tmp_path / "crashed", mode="probe"))
    monkeypatch.setattr(collect_run, "write_shard", real_write)
    assert len(list((tmp_path / "crashed" / "shards").glob("*.parquet"))) == 3
    summary = run_collect(config(pair, tmp_path / "crashed", mode="probe"))
    assert summary["collected"] == 7
    keys = _keys(tmp_path / "crashed")
    assert keys == _keys(tmp_path / "straight") and len(keys) == len(set(keys))


def test_rerun_with_other_settings_is_refused(pair, tmp_path):
    run_collect(config(pair, tmp_path / "t", mode="probe", limit=2))
    with pytest.raises(DraftctlError, match=r"differs in .*k_probe"):
        run_collect(config(pair, tmp_path / "t", mode="probe", limit=2, k_probe=4))


def test_resuming_refuses_a_shard_of_a_prompt_edited_since(pair, tmp_path):
    """Shards are matched to prompts by id; a prompt whose text changed after its shard was
    written is named, not silently kept."""
    edited = tmp_path / "prompts.jsonl"
    rows = [json.loads(line) for line in Path(pair[2]).read_text().splitlines()]
    edited.write_text("\n".join(json.dumps(r) for r in rows))
    run_collect(config(pair, tmp_path / "t", mode="probe", limit=3, prompts=str(edited)))
    assert run_collect(config(pair, tmp_path / "t", mode="probe", limit=3,
                              prompts=str(edited)))["collected"] == 0
    rows[1]["turns"] = ["w5 w6 w7"]
    edited.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DraftctlError, match=r"q1\.parquet was collected from another text "
                                            "of prompt 1"):
        run_collect(config(pair, tmp_path / "t", mode="probe", limit=3, prompts=str(edited)))


def test_corrupt_shard_is_refused_with_its_name(pair, tmp_path):
    run_collect(config(pair, tmp_path / "t", mode="probe", limit=2))
    shard = min((tmp_path / "t" / "shards").glob("*.parquet"))
    shard.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(TraceError, match=f"corrupt trace shard {shard}"):
        read_traces(tmp_path / "t")


def test_bad_collect_settings():
    with pytest.raises(DraftctlError, match="unknown collect mode"):
        CollectConfig(mode="wide")
    with pytest.raises(DraftctlError, match="dense mode replays greedy decoding"):
        CollectConfig(mode="dense", temperature=0.7)


def test_two_ranks_take_disjoint_prompts_whose_union_is_the_set(pair, tmp_path):
    target, draft, prompts = pair
    out = tmp_path / "ranks"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", "29517", "-m", "draftctl", "collect", "--target", target,
           "--draft", draft, "--prompts", prompts, "--split", "all", "--mode", "probe",
           "--k-probe", "4", "--max-new-tokens", "8", "--device", "cpu", "--out", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    by_rank = {}
    for shard in (out / "shards").glob("*.parquet"):
        prompt_id = pq.read_table(shard).column("prompt_id")[0].as_py()
        by_rank.setdefault(prompt_id % 2, set()).add(prompt_id)
    assert "rank 0/2" in done.stdout and "rank 1/2" in done.stdout
    assert set().union(*by_rank.values()) == set(range(10))


def test_demo_runs_on_the_pair_it_is_given(pair, tmp_path):
    from draftctl.jobs import DemoJob, run_demo

    target, draft, prompts = pair
    summary = run_demo(DemoJob(target=target, draft=draft, prompts=prompts,
                               collect_per_category=None, collect_max_new_tokens=5,
                               collect_limit=6, bench_per_category=None, bench_limit=2,
                               max_new_tokens=8, k_probe=4, kinds=["logreg"],
                               out=str(tmp_path / "demo")))
    bench = summary["bench"]
    assert bench["draft"] == draft and bench["mismatches"] == 0
    # the traces follow each prompt for collect_max_new_tokens, the bench for max_new_tokens
    traced = read_traces(tmp_path / "demo" / "traces").column("output_len").to_pylist()
    assert max(traced) == 5
    assert bench["ar"]["new_tokens"] > 2 * 5
    assert any(row["spec"].startswith("onnx:") for row in bench["controllers"])


@pytest.mark.parametrize("kinds", [["logreg", "forest"], ["mlp", "mlp"], []])
def test_demo_refuses_bad_model_kinds_before_collecting(pair, tmp_path, capsys, kinds):
    """``--kinds`` is checked before any trace is collected, with the kinds it takes named."""
    from draftctl.cli import main

    _, draft, prompts = pair
    out = tmp_path / "demo"
    code = main(["demo", "--prompts", prompts, "--draft", draft, "--kinds", ",".join(kinds),
                 "--out", str(out)])
    assert code == 2
    assert "logreg, hgb, mlp, threshold" in capsys.readouterr().err
    assert not out.exists()


def test_demo_refuses_a_bad_trace_length_before_collecting(pair, tmp_path, capsys):
    from draftctl.cli import main

    _, draft, prompts = pair
    out = tmp_path / "demo"
    code = main(["demo", "--prompts", prompts, "--draft", draft, "--collect-max-new-tokens", "0",
                 "--out", str(out)])
    assert code == 2
    assert "collect_max_new_tokens must be >= 1, got 0" in capsys.readouterr().err
    assert not out.exists()


def test_demo_collects_probe_traces_for_a_drafter_without_dense_rows(pair, tmp_path):
    """``model+lookup,alone=2`` ends rounds where lookup matches do, so dense traces refuse
    it: the demo collects probe traces for it instead and runs to its bench."""
    from draftctl.jobs import DemoJob, run_demo

    target, draft, prompts = pair
    out = tmp_path / "demo"
    summary = run_demo(DemoJob(target=target, draft=draft, prompts=prompts,
                               drafter="model+lookup,alone=2", collect_per_category=None,
                               collect_limit=6, bench_per_category=None, bench_limit=2,
                               max_new_tokens=8, k_probe=4, kinds=["logreg"], out=str(out)))
    info = json.loads((out / "traces" / "run.json").read_text())
    assert info["mode"] == "rounds" and info["policy"] == "static:4"
    assert summary["bench"]["mismatches"] == 0
