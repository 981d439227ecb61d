"""Row-invariant kernels: a view of a model in which a token's result does not depend on how
many tokens its pass has, so that passes of any size are bit-exact without padding rows.

The fixed pass shape (``fixed:M``) gets exactness by running every pass at M rows, which taxes
plain decoding (measured on an AVX2 CPU in float32: a one-token step at ``fixed:8`` cost twice
the unpadded step). Two kernels make a row's result depend on the pass's row count, and the
view replaces both:

- linear layers: MKL's GEMM picks another kernel by row count. The view runs every
  ``nn.Linear`` through oneDNN's linear with weights packed once at conversion
  (``torch.ops.mkldnn``), whose rows do not depend on how many rows the product has, from two
  rows up: for a single row oneDNN may take a matrix-vector kernel (seen on an AVX-512 Xeon:
  the 1536-to-576 MLP projection rounds one row differently alone), so a one-row input is fed
  as two copies of the row; and only up to a point: on an AMX Xeon in bfloat16, products of
  33 rows or more round rows differently from products of 1 to 32, so the view feeds the rows
  in products of at most ``LINEAR_BLOCK`` rows (a one-row remainder again as two copies);
- attention: one query row takes another path (``pack_gqa``, another SDPA kernel). The view
  feeds queries in blocks of ``QUERY_BLOCK`` rows, the last block padded by repeating its last
  row (padding dropped after), so every attention call has the same query count. Keys are
  padded to whole blocks by ``CachedLM`` as in ``fixed:M``.

Whether this holds on a given machine and dtype is checked, not assumed: ``calibrate`` feeds
tokens in several splits and offers the ``exact`` pass shape only where every split gave
bit-identical logits (``draftctl.decode.cached_lm.shape_is_exact``). CPU only.
"""

from __future__ import annotations

import copy
import itertools
import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F
from transformers import AttentionInterface

from draftctl.errors import DecodeInputError

QUERY_BLOCK = 16  # query rows of every attention call in the view
LINEAR_BLOCK = 32  # the most rows of any linear product in the view
ATTENTION = "draftctl_query_blocks"  # the view's attention implementation (registered below)


def query_block_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: torch.Tensor | None,
                          scaling: float | None = None, dropout: float = 0.0,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """SDPA over the queries in blocks of ``QUERY_BLOCK`` rows (the last padded), under an
    explicit 4-D mask. Returns (batch, queries, heads, head_dim) as transformers' SDPA does.
    Grouped keys and values go to SDPA as they are (``enable_gqa``): copying them out to every
    query head, as transformers' SDPA does under a mask, cost more than the attention itself
    in a decoding step."""
    if attention_mask is None or attention_mask.dim() != 4:
        raise DecodeInputError("row-invariant attention needs an explicit 4-D mask (it is fed "
                               "by draftctl's CachedLM)")
    if kwargs.get("softcap") is not None:
        raise DecodeInputError("row-invariant attention has no logit soft-capping; use fixed:M")
    n = query.shape[2]
    outputs = []
    for first in range(0, n, QUERY_BLOCK):
        q = query[:, :, first:first + QUERY_BLOCK]
        mask = attention_mask[:, :, first:first + QUERY_BLOCK]
        real = q.shape[2]
        if real < QUERY_BLOCK:
            q = torch.cat([q, q[:, :, -1:].expand(-1, -1, QUERY_BLOCK - real, -1)], dim=2)
            mask = torch.cat([mask, mask[:, :, -1:].expand(-1, -1, QUERY_BLOCK - real, -1)],
                             dim=2)
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, dropout_p=dropout,
                                             scale=scaling,
                                             enable_gqa=query.shape[1] != key.shape[1])
        outputs.append(out[:, :, :real])
    out = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, query_block_attention)


class PackedLinear(nn.Module):
    """An ``nn.Linear`` computed by oneDNN with its weight packed once. It shares the original
    parameters (tied weights stay tied); the packed copy is for inference only.

    ``row_invariant`` (the exact view): a row's result does not depend on the product's row
    count (one row fed as two copies, products of at most ``LINEAR_BLOCK`` rows). Without it
    (the packed view, for speed only): any number of rows in one oneDNN product."""

    def __init__(self, linear: nn.Linear, row_invariant: bool = True):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.row_invariant = row_invariant
        self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(
            linear.weight.detach(), QUERY_BLOCK), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.detach()
        rows = x.reshape(-1, x.shape[-1])
        if not self.row_invariant:
            y = self._onednn(rows, bias)
        elif rows.shape[0] <= LINEAR_BLOCK:  # one product: no split, no copy by cat
            y = self._product(rows, bias)
        else:
            y = torch.cat([self._product(block, bias) for block in rows.split(LINEAR_BLOCK)])
        return y.reshape(*x.shape[:-1], self.out_features)

    def _product(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        single = rows.shape[0] == 1
        if single:  # oneDNN's one-row kernel rounds differently: compute it as a 2-row product
            rows = rows.expand(2, -1)
        y = self._onednn(rows, bias)
        return y[:1] if single else y

    def _onednn(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows, self.packed, bias, "none", [], "")


def supported(model: nn.Module) -> str | None:
    """Why this model cannot have a row-invariant view here, or None if it can."""
    reason = _packing(model, "the exact pass shape")
    if reason:
        return f"{reason}; use fixed:M"
    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", ATTENTION):
        return "the exact pass shape needs a model with SDPA attention"
    return None


def packable(model: nn.Module) -> str | None:
    """Why this model's linear layers cannot be packed here (``packed_view``), or None."""
    return _packing(model, "packed linear layers")


def _packing(model: nn.Module, what: str) -> str | None:
    param = next(model.parameters())
    if param.device.type != "cpu":
        return f"{what} run on CPU only (the model is on {param.device.type})"
    if not torch.backends.mkldnn.is_available():
        return f"{what} need oneDNN (torch.backends.mkldnn), which this torch build lacks"
    if param.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return f"this CPU has no bfloat16 oneDNN kernels for {what}"
    if param.dtype not in (torch.float32, torch.bfloat16):
        return f"{what} support float32 and bfloat16, not {param.dtype}"
    return None


_VIEWS: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()
_PACKED: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()


def _view(model: nn.Module, row_invariant: bool,
          views: weakref.WeakKeyDictionary[nn.Module, nn.Module],
          refusal: Callable[[nn.Module], str | None]) -> nn.Module:
    """The model's view, made once (kept in ``views``): a copy of its modules and config
    sharing its parameters and buffers (not copied), each ``nn.Linear`` replaced by a
    ``PackedLinear``; the row-invariant one attends through ``query_block_attention``.
    ``refusal``: why a model cannot have it (None if it can), asked only when it is made."""
    view = views.get(model)
    if view is not None:
        return view
    reason = refusal(model)
    if reason:
        raise DecodeInputError(reason)
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    view = copy.deepcopy(model, shared)
    for module in list(view.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child, row_invariant))
    if row_invariant:
        view.config._attn_implementation = ATTENTION
    view.eval()
    views[model] = view
    return view


def row_invariant_view(model: nn.Module) -> nn.Module:
    """The model's row-invariant view: its own modules and config, the model's parameters
    (shared, not copied) plus the packed linear weights. Made once per model; the model itself
    is left as it was, so plain and padded passes over it keep their speed."""
    if getattr(model.config, "_attn_implementation", None) == ATTENTION:
        return model  # already a view
    return _view(model, True, _VIEWS, supported)


def packed_view(model: nn.Module) -> nn.Module:
    """The model with its linear layers on oneDNN with packed weights, for speed, not
    exactness: every pass in one oneDNN product per layer, which can cost far less than the
    stock kernel's for several tokens and no more for one (measured on an AVX2 CPU in
    float32: a pass of 2 to 16 tokens 0.54-0.80x the stock one's, of one 0.94x;
    ``benchmarks/packed_linear.py`` times it on any CPU). A pass of several tokens verifies
    a draft, so speculation inside transformers' ``generate()`` pays more; a draft model's
    steps cost less (``drafters.model_drafter`` drafts on this view). It is a model like the
    original (``generate()`` included) sharing its parameters; attention stays the model's
    own. Made once per model."""
    if any(isinstance(m, PackedLinear) for m in model.modules()):
        return model  # already a view
    return _view(model, False, _PACKED, packable)
