"""draftctl bench on a tiny model pair: every output, the identical-output check, ranges."""

import json

import pytest
import torch

from draftctl.bench.run import BenchConfig, run_bench
from draftctl.cli import main
from draftctl.decode import loop, verify
from tests.test_collect import pair  # noqa: F401  (module fixture: tiny target, draft, prompts)


def bench_args(pair, out, *extra):  # noqa: F811
    target, draft, prompts = pair
    return ["bench", "--target", target, "--draft", draft, "--prompts", prompts, "--split", "all",
            "--limit", "4", "--max-new-tokens", "16", "--device", "cpu", "--out", str(out),
            *extra]


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


def test_bench_exits_non_zero_when_an_output_differs(pair, tmp_path, monkeypatch):  # noqa: F811
    def accept_everything(draft_tokens, target_logits):  # a corrupting test double
        k = draft_tokens.shape[0]
        return verify.Verdict(k, target_logits[k].argmax().view(()), torch.ones(k))

    monkeypatch.setattr(loop, "verify_greedy", accept_everything)
    out = tmp_path / "bad"
    assert main(bench_args(pair, out, "--controllers", "static:3", "--no-plots")) == 1
    report = json.loads((out / "report.json").read_text())
    assert report["controllers"][0]["mismatches"] > 0


def test_bench_refuses_bad_requests(pair, tmp_path):  # noqa: F811
    target, draft, prompts = pair
    base = {"target": target, "draft": draft, "prompts": prompts, "split": "all",
            "device": "cpu", "out": str(tmp_path / "x")}
    with pytest.raises(Exception, match="oracle needs greedy decoding"):
        run_bench(BenchConfig(**base, controllers=["oracle"], temperature=0.8))
    with pytest.raises(Exception, match="listed twice"):
        run_bench(BenchConfig(**base, controllers=["static:2", "static:1-3"]))


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
    assert main(bench_args(pair, tmp_path / "x", "--controllers", "svip", "--drafter",
                           drafter)) == 2
    assert "do not apply to retrieval" in capsys.readouterr().err
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
