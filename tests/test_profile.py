"""Calibrated profiles: what calibrate writes, what settle accepts, and the choices' math."""

import json

import pytest
import torch

from draftctl import models
from draftctl.cli import main
from draftctl.decode.cached_lm import PassShape
from draftctl.profile import (
    FORMAT,
    CalibrateConfig,
    ProfileError,
    calibrate,
    candidate_dtypes,
    cheapest_pad,
    choose_rows,
    choose_shape,
    pass_time,
    rank_rows,
    settle,
)
from draftctl.train.replay import CostModel
from tests.test_models import save_model


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrate")
    target, draft = save_model(root / "target"), save_model(root / "draft", seed=1)
    cfg = CalibrateConfig(target=target, draft=draft, device="cpu", max_n=6, repeats=2,
                          context=48, out=str(root / "profile.json"))
    profile, path = calibrate(cfg, progress=False)
    return target, draft, profile, path


def test_calibrate_writes_a_profile_covering_every_pass_size(tiny_profile):
    target, draft, profile, path = tiny_profile
    assert json.loads(path.read_text()) == profile and profile["format"] == FORMAT
    assert profile["target"]["spec"] == target and profile["draft"]["spec"] == draft
    dtypes = candidate_dtypes(torch.device("cpu"))
    assert list(profile["target"]["by_dtype"]) == dtypes
    for dtype, entry in profile["target"]["by_dtype"].items():
        assert sorted(map(int, entry["t_ms"])) == list(range(1, 7)), dtype
        assert all(t > 0 for t in entry["t_ms"].values())
        assert 2 <= entry["rows"] <= 6 and entry["rows_checked"][str(entry["rows"])] is True
        exact = entry["exact_shape"]  # CPU: the row-invariant kernels are measured and checked
        assert sorted(map(int, exact["t_ms"])) == list(range(1, 7)) and exact["exact"] is True
        assert entry["pass_shape"] in ("exact", f"fixed:{entry['rows']}")
        assert 0 <= entry["static_k"] < (6 if entry["pass_shape"] == "exact" else entry["rows"])
    chosen = profile["target"]["by_dtype"][profile["target"]["dtype"]]
    assert profile["pass_shape"] == chosen["pass_shape"]
    shape = PassShape.parse(chosen["pass_shape"])
    assert profile["target"]["t_ms"] == (chosen["exact_shape"] if shape.row_invariant
                                         else chosen)["t_ms"]
    assert profile["pad_to"] == {str(n): shape.rows(n) for n in range(1, 7)}
    assert set(profile["draft"]["by_dtype"]) == set(dtypes) and profile["draft"]["t_ms"]["1"] > 0
    assert profile["fastest_plain"]["dtype"] in dtypes
    assert {"device", "threads", "torch"} <= set(profile)
    batch = profile["batch"]  # batch jobs: the dtype of the fastest batched pass
    assert set(batch["ms"]) == set(dtypes) and all(ms > 0 for ms in batch["ms"].values())
    assert batch["dtype"] == min(batch["ms"], key=batch["ms"].get)


def test_settle_uses_the_profile_and_refuses_one_made_for_other_models(tiny_profile, tmp_path):
    target, draft, profile, path = tiny_profile
    setup = settle(target, draft, "cpu", profile=str(path))
    assert setup.target_dtype == profile["target"]["dtype"]
    assert setup.draft_dtype == profile["draft"]["dtype"]
    assert setup.shape == PassShape.parse(profile["pass_shape"]) and setup.shape.exact
    other = save_model(tmp_path / "other", seed=5)
    with pytest.raises(ProfileError, match=f"measured for target '{target}', not '{other}'"):
        settle(other, draft, "cpu", profile=str(path))
    with pytest.raises(ProfileError, match=f"measured with draft '{draft}', not '{other}'"):
        settle(target, other, "cpu", profile=str(path))
    if "bfloat16" in candidate_dtypes(torch.device("cpu")):
        only32 = json.loads(path.read_text())
        del only32["target"]["by_dtype"]["bfloat16"]
        (tmp_path / "f32.json").write_text(json.dumps(only32))
        with pytest.raises(ProfileError, match="measured in float32, not bfloat16"):
            settle(target, draft, "cpu", dtype="bfloat16", profile=str(tmp_path / "f32.json"))
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ProfileError, match="is not a draftctl profile"):
        settle(target, draft, "cpu", profile=str(tmp_path / "junk.json"))
    assert settle(target, draft, "cpu", dtype="float32", pass_shape="free").profile is None
    assert settle(target, draft, "cpu", pass_shape="exact", profile=str(path)).shape.exact
    old = json.loads(path.read_text())  # a profile from before the exact shape
    for entry in old["target"]["by_dtype"].values():
        del entry["exact_shape"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(ProfileError, match="no curve for the exact pass shape"):
        settle(target, draft, "cpu", pass_shape="exact", profile=str(tmp_path / "old.json"))


def test_calibrate_cli_prints_the_curve_and_the_choice(tiny_profile, tmp_path, capsys):
    target, draft, _, _ = tiny_profile
    out = tmp_path / "p.json"
    assert main(["calibrate", "--target", target, "--draft", draft, "--device", "cpu",
                 "--dtypes", "float32", "--max-n", "3", "--repeats", "1", "--context", "20",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "float32" in printed and "chosen: target float32" in printed and str(out) in printed
    assert list(json.loads(out.read_text())["target"]["by_dtype"]) == ["float32"]


def test_a_cpu_without_bfloat16_falls_back_to_float32_with_a_notice(monkeypatch, capsys):
    monkeypatch.setattr(models, "bfloat16_supported", lambda device: False)
    assert models.resolve_dtype("bfloat16", torch.device("cpu")) == torch.float32
    assert "no bfloat16 instructions: using float32" in capsys.readouterr().err
    assert candidate_dtypes(torch.device("cpu")) == ["float32"]


def test_choices_follow_the_cost_curve():
    flat = {n: 10.0 + 0.1 * n for n in range(1, 17)}  # a GPU-like curve: wide passes pay
    steep = {n: 10.0 * n ** 0.9 for n in range(1, 17)}  # a CPU-like curve: they do not
    assert choose_rows(flat, 1.0, 0.8)[0] > choose_rows(steep, 1.0, 0.8)[0]
    assert rank_rows(flat, 1.0, 0.8, tolerance=0.0)[0][0] >= 6  # strictly fastest: wide
    assert choose_rows(flat, 1.0, 0.8)[0] >= 5  # the smallest within noise of it
    assert choose_rows(flat, 1.0, 0.8, frozenset(range(6, 17)))[0] < 6  # inexact shapes skipped
    noisy = {n: 100.0 + 10 * n for n in range(1, 9)}
    noisy[4], noisy[8] = 102.0, 100.0  # 8 rows "faster" than 4 by less than timing noise
    assert rank_rows(noisy, 10.0, 0.6, tolerance=0.0)[0][0] == 8
    assert choose_rows(noisy, 10.0, 0.6)[0] == 4
    assert pass_time(flat, PassShape(fixed=4), 9) == pytest.approx(3 * flat[4])
    assert pass_time(flat, PassShape(), 20) == pytest.approx(flat[16] + 4 * 0.1)
    fixed_rows = choose_rows(steep, 1.0, 0.6)[0]
    assert choose_shape(steep, 1.0, 0.6)[0] == f"fixed:{fixed_rows}"  # no exact curve
    cheap = {n: 0.9 * t for n, t in steep.items()}  # row-invariant kernels, unpadded, faster
    assert choose_shape(steep, 1.0, 0.6, exact_curve=cheap)[0] == "exact"
    dear = {n: 1.5 * t for n, t in steep.items()}
    assert choose_shape(steep, 1.0, 0.6, exact_curve=dear)[0] == f"fixed:{fixed_rows}"
    dip = {1: 5.0, 2: 9.0, 3: 9.0, 4: 6.0, 5: 7.0}
    assert cheapest_pad(dip) == {1: 1, 2: 4, 3: 4, 4: 4, 5: 5}
    cost = CostModel(0.001, tuple(v / 1e3 for v in flat.values()), shape=PassShape(fixed=4))
    assert cost.verify(5) == pytest.approx(2 * flat[4] / 1e3) and cost.verify(1) == cost.verify(4)


def test_batch_jobs_run_in_the_dtype_of_the_fastest_batched_pass(tmp_path, capsys):
    """``batch_dtype`` reads the target's profile (made once); a profile from before batch
    timing is measured again, with a notice."""
    from draftctl.profile import batch_dtype, default_path

    if len(candidate_dtypes(torch.device("cpu"))) == 1:
        pytest.skip("this CPU computes float32 only: batch jobs need no profile (next test)")
    target = save_model(tmp_path / "target")
    chosen = batch_dtype(target, "cpu")
    path = default_path(target, None, torch.device("cpu"))
    profile = json.loads(path.read_text())
    assert chosen == profile["batch"]["dtype"] in candidate_dtypes(torch.device("cpu"))
    del profile["batch"]
    path.write_text(json.dumps(profile))
    capsys.readouterr()
    assert batch_dtype(target, "cpu") in candidate_dtypes(torch.device("cpu"))
    assert "predates batch timing" in capsys.readouterr().err
    assert "batch" in json.loads(path.read_text())


def test_a_cpu_with_one_native_dtype_runs_batch_jobs_in_it_without_calibrating(
        tmp_path, monkeypatch):
    from draftctl.profile import batch_dtype, default_path

    monkeypatch.setattr(models, "bfloat16_supported", lambda device: False)
    target = save_model(tmp_path / "target")
    assert batch_dtype(target, "cpu") == "float32"
    assert not default_path(target, None, torch.device("cpu")).exists()
