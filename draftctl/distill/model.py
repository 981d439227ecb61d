"""The distilled draft: a few transformer layers over the target's own embedding.

Architecture (``DraftLM``): the target's token embedding (frozen, not stored with the draft),
``n_layers`` decoder layers of the target's architecture (initialised from the target's first
layers), its final norm, and an output head over ``head_ids`` only (the most frequent tokens of
the training text), initialised from those tokens' embedding rows. All but the embedding train.
The draft's ``q`` is zero outside ``head_ids``: logits there are ``-inf``, which the lossless
rule handles (those tokens are never drafted; the residual keeps the target's mass there).

Stored files: ``config.json`` (config of the layers + draft metadata),
``model.safetensors`` (matrices as int8 with one float scale per output row, the norms,
and ``head_ids``), ``manifest.json`` (how it was made).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig
from transformers.modeling_outputs import CausalLMOutputWithPast

from draftctl.errors import DraftctlError

FORMAT = "draftctl-distilled-draft/1"


class DraftFileError(DraftctlError):
    """A draft folder that is missing files or holds corrupt weights."""


class DraftLM(nn.Module):
    """A small causal LM that drafts for a target whose embedding it shares.

    ``forward`` has the transformers causal-LM call shape the decoder uses
    (``input_ids``, ``cache``, ``use_cache``, ``logits_to_keep``) and returns full-vocabulary
    logits, ``-inf`` outside ``head_ids``.
    """

    def __init__(self, config: PretrainedConfig, embedding: torch.Tensor, head_ids: torch.Tensor):
        super().__init__()
        self.config = config
        # layers in the embedding's dtype, not the dtype the config names (a target loaded
        # in bfloat16 passes its own; the draft trains and loads in float32, then casts)
        self.model = AutoModel.from_config(config, dtype=embedding.dtype)
        self.model.embed_tokens.weight = nn.Parameter(embedding, requires_grad=False)
        self.register_buffer("head_ids", head_ids.long(), persistent=False)
        # Output head over the head tokens only, initialised from their embedding rows (the
        # target ties its head to its embedding) and trained.
        self.head = nn.Linear(config.hidden_size, len(head_ids), bias=False)
        with torch.no_grad():
            self.head.weight.copy_(embedding[self.head_ids])

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., len(head_ids)) logits over the head tokens only."""
        return self.head(hidden)

    def forward(self, input_ids: torch.Tensor, cache=None, use_cache: bool = False,
                logits_to_keep: int = 0, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, head_only: bool = False,
                **kwargs) -> CausalLMOutputWithPast:
        """Full-vocabulary logits (``-inf`` off the head), or with ``head_only`` the head's
        logits (..., len(head_ids)), column i for token ``head_ids[i]`` (the drafter's path:
        it spares a vocabulary-wide softmax and top-k per drafted token)."""
        hidden = self.model(input_ids=input_ids, cache=cache, use_cache=use_cache,
                            attention_mask=attention_mask,
                            position_ids=position_ids).last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        small = self.head_logits(hidden)
        if head_only:
            return CausalLMOutputWithPast(logits=small)
        logits = small.new_full((*small.shape[:-1], self.config.vocab_size), float("-inf"))
        logits[..., self.head_ids] = small
        return CausalLMOutputWithPast(logits=logits)


def from_target(target: nn.Module, n_layers: int, head_ids: torch.Tensor) -> DraftLM:
    """A draft initialised from the target's first ``n_layers`` layers and final norm."""
    config = type(target.config)(**{**target.config.to_dict(), "num_hidden_layers": n_layers,
                                     "tie_word_embeddings": False})
    embedding = target.get_input_embeddings().weight.detach().float().clone()  # trains in fp32
    draft = DraftLM(config, embedding, head_ids)
    source = target.model
    for mine, theirs in zip(draft.model.layers, source.layers):
        mine.load_state_dict(theirs.state_dict())
    draft.model.norm.load_state_dict(source.norm.state_dict())
    return draft


SHARED = "model.embed_tokens."  # the target's embedding: shared, never stored


def trainable_state(draft: DraftLM) -> dict[str, torch.Tensor]:
    """Everything the draft learned: layers, final norm, head (not the shared embedding)."""
    return {k: v for k, v in draft.state_dict().items() if not k.startswith(SHARED)}



def _quantize(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Matrices -> int8 with a per-row absmax scale; vectors stay float32."""
    out = {}
    for name, value in state.items():
        value = value.detach().float().cpu()
        if value.dim() == 2:
            scale = value.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
            out[f"{name}.q8"] = torch.round(value / scale).to(torch.int8)
            out[f"{name}.scale"] = scale.squeeze(1)
        else:
            out[name] = value.contiguous()
    return out


def _dequantize(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = {}
    for name, value in stored.items():
        if name.endswith(".q8"):
            base = name[: -len(".q8")]
            state[base] = value.float() * stored[f"{base}.scale"][:, None]
        elif not name.endswith(".scale"):
            state[name] = value
    return state


def save_draft(draft: DraftLM, folder: str | Path, target_spec: str, manifest: dict) -> None:
    """Write config.json, model.safetensors (int8 layers) and manifest.json."""
    write_draft_folder(folder, trainable_state(draft), draft.head_ids,
                       {"format": FORMAT, "target": target_spec,
                        "layers": draft.config.to_dict()}, manifest)


def write_draft_folder(folder: str | Path, state: dict[str, torch.Tensor],
                       head_ids: torch.Tensor, config: dict, manifest: dict) -> None:
    """A draft's folder: its learned ``state`` stored int8 with its ``head_ids``, its config,
    and its manifest with the weights' hash."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = _quantize(state)
    tensors["head_ids"] = head_ids.cpu().to(torch.int32)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    weights_sha = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    (folder / "manifest.json").write_text(json.dumps({**manifest, "weights_sha256": weights_sha},
                                                     indent=2))


def is_draft_folder(folder: str | Path) -> bool:
    config = Path(folder) / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("format") == FORMAT
    except (json.JSONDecodeError, AttributeError):
        return False


def read_draft_config(folder: str | Path) -> dict:
    folder = Path(folder)
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DraftFileError(f"cannot read draft config {folder / 'config.json'}: {err}") from None


def read_saved_draft(folder: str | Path, embedding: torch.Tensor
                     ) -> tuple[dict, PretrainedConfig, torch.Tensor, dict[str, torch.Tensor]]:
    """A saved draft's ``config.json``, its layers' transformers config, its head ids and its
    dequantized weights, checked against the target's embedding (V, hidden)."""
    folder = Path(folder)
    saved = read_draft_config(folder)
    layers = dict(saved["layers"])
    config = AutoConfig.for_model(layers.pop("model_type"), **layers)
    weights = folder / "model.safetensors"
    try:
        stored = load_file(str(weights))
    except (OSError, SafetensorError) as err:
        raise DraftFileError(f"draft weights {weights} are missing or corrupt: {err}") from None
    if "head_ids" not in stored:
        raise DraftFileError(f"draft weights {weights} hold no head_ids: not a draftctl draft")
    if tuple(embedding.shape) != (config.vocab_size, config.hidden_size):
        raise DraftFileError(
            f"draft {folder} expects a target embedding of shape "
            f"({config.vocab_size}, {config.hidden_size}), got {tuple(embedding.shape)}")
    head_ids = stored.pop("head_ids")
    return saved, config, head_ids, _dequantize(stored)


def fill_weights(draft: nn.Module, state: dict[str, torch.Tensor], folder: str | Path,
                 shared: str) -> nn.Module:
    """``draft`` in eval mode with the saved ``state`` loaded; every parameter but the shared
    embedding (names starting with ``shared``) must be there, and nothing else."""
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith(shared)]
    if missing or unexpected:
        raise DraftFileError(f"draft weights {Path(folder) / 'model.safetensors'} do not fit "
                             f"its config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return draft.eval()


def load_draft(folder: str | Path, embedding: torch.Tensor) -> DraftLM:
    """Rebuild a saved draft over the target's embedding (V, hidden)."""
    _, config, head_ids, state = read_saved_draft(folder, embedding)
    return fill_weights(DraftLM(config, embedding, head_ids), state, folder, SHARED)
