"""A feature-level draft (EAGLE-3 style, methods.md section 6): one decoder layer that reads the
target's own hidden states.

To predict the token after position p, the draft takes the embedding of token ``x_p`` and a
feature of position ``p - 1``: the target's hidden states at ``feature_layers`` (low, middle,
high), fused by ``fc``; or, when ``p - 1`` is itself a draft position, the draft's own output
there. ``mix`` maps (embedding, feature) to the layer's input; the layer's output goes through
a frozen copy of the target's final norm into a trained head over ``head_ids`` (the most
frequent tokens of the training text). ``q`` is zero outside ``head_ids``.

Training unrolls the draft over ``steps`` steps on its own features, as it drafts
("training-time test", EAGLE-3): step 1 reads the target's features; step j > 1 reads step
j - 1's outputs one position back and attends to the target-feature entries of its round's
context and to its round's own earlier entries only (``ttt_mask``), each step's loss weighted
``decay ** (j - 1)``, so drafting two or three tokens ahead holds up.

Stored files: ``config.json`` (format, target, feature layers, layer config),
``model.safetensors`` (matrices as int8 with one float scale per row, norms, ``head_ids``),
``manifest.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, DynamicLayer
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from draftctl.distill.model import fill_weights, read_saved_draft, write_draft_folder

FORMAT = "draftctl-feature-draft/1"


class FeatureDraftLM(nn.Module):
    """One decoder layer over (token embedding, target feature), with a reduced head.

    config: the target's config (its layer shapes; ``num_hidden_layers`` is ignored).
    embedding: the target's token embedding (V, H), frozen, not stored. norm_weight: the
    target's final norm (H,), frozen. feature_layers: the target's ``output_hidden_states``
    indices the draft reads.
    """

    def __init__(self, config: PretrainedConfig, embedding: torch.Tensor, head_ids: torch.Tensor,
                 norm_weight: torch.Tensor, feature_layers: tuple[int, ...]):
        super().__init__()
        hidden = config.hidden_size
        config._attn_implementation = "sdpa"
        self.config = config
        self.feature_layers = tuple(feature_layers)
        self.embed = nn.Parameter(embedding, requires_grad=False)
        self.register_buffer("head_ids", head_ids.long(), persistent=False)
        self.fc = nn.Linear(len(feature_layers) * hidden, hidden, bias=False)
        self.mix = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        with torch.no_grad():
            self.norm.weight.copy_(norm_weight)
        self.norm.weight.requires_grad_(False)
        self.head = nn.Linear(hidden, len(head_ids), bias=False)
        with torch.no_grad():
            self.head.weight.copy_(embedding[self.head_ids])

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, own: bool = False,
                cache=None, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                logits: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids (B, T): the tokens x_p; features (B, T, layers, H) the target's states at
        p - 1, or (B, T, H) the draft's own outputs there (``own``). Returns the layer's
        outputs (B, T, H), the next features, and head logits (B, T, len(head_ids)), or None
        without ``logits`` (training asks ``head_logits`` for the labelled rows only)."""
        feature = features if own else self.fc(features.flatten(-2).to(self.fc.weight.dtype))
        x = self.mix(torch.cat([self.embed[input_ids].to(feature.dtype), feature], dim=-1))
        if position_ids is None:
            position_ids = torch.arange(x.shape[1], device=x.device)[None]
        out = self.layer(x, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache, use_cache=cache is not None,
                         position_embeddings=self.rotary(x, position_ids))
        return out, self.head_logits(out) if logits else None

    def head_logits(self, out: torch.Tensor) -> torch.Tensor:
        """(..., H) layer outputs -> (..., len(head_ids)) logits over the head tokens."""
        return self.head(self.norm(out))


def from_target(target: nn.Module, head_ids: torch.Tensor,
                feature_layers: tuple[int, ...]) -> FeatureDraftLM:
    """A feature draft initialised from the target's last decoder layer and its head rows."""
    config = type(target.config)(**{**target.config.to_dict(), "num_hidden_layers": 1})
    embedding = target.get_input_embeddings().weight.detach().float().clone()
    draft = FeatureDraftLM(config, embedding, head_ids, target.model.norm.weight.detach().float(),
                           feature_layers)
    draft.layer.load_state_dict({k: v.float() for k, v in
                                 target.model.layers[-1].state_dict().items()})
    hidden = config.hidden_size
    with torch.no_grad():  # start from the highest feature, plus the token's embedding
        draft.fc.weight.zero_()
        draft.fc.weight[:, -hidden:] = torch.eye(hidden)
        draft.mix.weight.copy_(torch.cat([torch.eye(hidden), torch.eye(hidden)], dim=1))
    return draft


def ttt_mask(width: int, step: int, device=None) -> torch.Tensor:
    """(width, step * width) bool: what the step-``step`` query at column c (position c + 1)
    attends to when the unrolled draft runs as it drafts ("training-time test"). The query is
    the ``step``-th token of a round whose context ends at position c + 2 - step: it sees the
    entries computed from the target's features (step 1's keys) up to that position, and the
    entries of the round's own earlier draft tokens, step i's key at column c - step + i."""
    columns = torch.arange(width, device=device)
    blocks = [columns[None, :] <= (columns - step + 1)[:, None]]
    for i in range(2, step + 1):
        blocks.append(columns[None, :] == (columns - step + i)[:, None])
    return torch.cat(blocks, dim=1)


def unrolled(draft: FeatureDraftLM, ids: torch.Tensor, features: torch.Tensor,
             steps: int) -> list[torch.Tensor]:
    """Layer outputs of ``steps`` unrolled draft steps over teacher-forced sequences (their
    ``head_logits`` are the draft's logits).

    ids: (B, W) the tokens x_p, column c = position p = c + 1; features: (B, W, layers, H)
    the target's states at p - 1. Step 1 reads the target's features; step j > 1 reads step
    j - 1's output one position back and attends as ``ttt_mask`` says, so step j's logits at
    position p are what the draft proposes as the j-th token of a round whose first j - 1
    drafts were the sequence's own tokens. Returns [(B, W, H)] per step; at step j, columns
    c < j - 1 have no such round (garbage).
    """
    width = ids.shape[1]
    positions = torch.arange(1, width + 1, device=ids.device)[None]
    cache = Cache(layers=[DynamicLayer()])
    out, _ = draft(ids, features, cache=cache, position_ids=positions,
                   attention_mask=ttt_mask(width, 1, ids.device)[None, None], logits=False)
    per_step = [out]
    for step in range(2, steps + 1):
        previous = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)
        out, _ = draft(ids, previous, own=True, cache=cache, position_ids=positions,
                       attention_mask=ttt_mask(width, step, ids.device)[None, None],
                       logits=False)
        per_step.append(out)
    return per_step


def training_loss(draft: FeatureDraftLM, items: list[tuple], steps: int,
                  decay: float) -> tuple[torch.Tensor, int]:
    """The unrolled loss over a batch (``unrolled``), summed over labelled positions and
    steps, step j weighted ``decay ** (j - 1)``.

    items: (tokens (L,), first labelled position s, label ids (n, k), label probs (n, k),
    target features (L, layers, H)); label row r is the teacher's distribution after position
    s + r. Returns (loss, labelled positions of step 1).
    """
    ids, feats = _batch(items)
    loss, counted = 0.0, 0
    for step, out in enumerate(unrolled(draft, ids, feats, steps), start=1):
        total = 0.0
        for row, (tokens, start, label_ids, label_probs, _) in enumerate(items):
            first = max(start, step)  # positions with a label that a round of step reaches
            last = len(tokens) - 2
            if last < first:
                continue
            log_q = torch.log_softmax(draft.head_logits(out[row, first - 1:last]).float(), -1)
            target = label_probs[first - start:last - start + 1].float()
            target = target / target.sum(-1, keepdim=True)
            picked = log_q.gather(-1, label_ids[first - start:last - start + 1].long())
            total = total - (target * picked).sum()
            if step == 1:
                counted += last - first + 1
        loss = loss + decay ** (step - 1) * total
    return loss, counted


def _batch(items: list[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, W) token ids x_p (column c = position c + 1) and (B, W, layers, H)
    target features at p - 1 of ``(tokens, ..., features)`` items."""
    width = max(len(item[0]) for item in items) - 1
    ids = torch.zeros((len(items), width), dtype=torch.long)
    feats = torch.zeros((len(items), width, *items[0][-1].shape[1:]))
    for row, item in enumerate(items):
        tokens, features = item[0], item[-1]
        n = len(tokens) - 1
        ids[row, :n] = tokens[1:]
        feats[row, :n] = features[:n].float()
    return ids, feats


@torch.inference_mode()
def agreement(draft: FeatureDraftLM, rows: list[dict], target: nn.Module,
              steps: int = 2) -> list[float]:
    """Greedy top-1 agreement with the target along its own greedy output, per draft step:
    at step j, how often the draft's j-th token of a round equals the target's token when
    the round's earlier drafts were the target's (``unrolled``)."""
    hits, totals = [0] * steps, [0] * steps
    device = next(target.parameters()).device
    for row in rows:
        if not row["response_ids"]:
            continue
        tokens = torch.tensor(row["prompt_ids"] + row["response_ids"])
        states = target(tokens[None].to(device), output_hidden_states=True).hidden_states
        features = torch.stack([states[k][0] for k in draft.feature_layers], dim=1).float().cpu()
        ids, feats = _batch([(tokens, features)])
        start = len(row["prompt_ids"]) - 1
        for step, out in enumerate(unrolled(draft, ids, feats, steps), start=1):
            first = max(start, step)
            logits = draft.head_logits(out[0, first - 1:len(tokens) - 2])
            guess = draft.head_ids[logits.argmax(-1)]
            hits[step - 1] += int((guess == tokens[first + 1:]).sum())
            totals[step - 1] += len(tokens) - 1 - first
    return [h / t if t else float("nan") for h, t in zip(hits, totals)]


def trainable_state(draft: FeatureDraftLM) -> dict[str, torch.Tensor]:
    """Everything the draft learned (not the shared embedding)."""
    return {k: v for k, v in draft.state_dict().items() if k != "embed"}


def save_feature_draft(draft: FeatureDraftLM, folder: str | Path, target_spec: str,
                       manifest: dict) -> None:
    write_draft_folder(folder, trainable_state(draft), draft.head_ids,
                       {"format": FORMAT, "target": target_spec,
                        "feature_layers": list(draft.feature_layers),
                        "layers": draft.config.to_dict()}, manifest)


def is_feature_draft(folder: str | Path) -> bool:
    config = Path(folder) / "config.json"
    try:
        return config.is_file() and json.loads(config.read_text()).get("format") == FORMAT
    except (json.JSONDecodeError, AttributeError):
        return False


def load_feature_draft(folder: str | Path, embedding: torch.Tensor) -> FeatureDraftLM:
    """Rebuild a saved feature draft over the target's embedding (V, H)."""
    saved, config, head_ids, state = read_saved_draft(folder, embedding)
    draft = FeatureDraftLM(config, embedding, head_ids, state["norm.weight"],
                           tuple(saved["feature_layers"]))
    return fill_weights(draft, state, folder, "embed")
