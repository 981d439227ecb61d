"""The KV cache and the pass shape: rollback, trees, and logits that do not depend on how
tokens were split into passes."""

import random

import pytest
import torch

from draftctl.controllers import make_controller
from draftctl.decode import DecodeInputError, generate, kernels
from draftctl.decode.cached_lm import KEY_BLOCK, CachedLM, PassShape, shape_is_exact
from tests.conftest import make_decoder, tiny_llama


def split_logits(lm: CachedLM, tokens: list[int], prefill: int, sizes: list[int]) -> torch.Tensor:
    """Logits of tokens[prefill:] fed in passes of the given sizes after a prefill."""
    ids = torch.tensor(tokens)
    lm.reset()
    lm.prefill(ids[:prefill])
    out, at = [], prefill
    for n in sizes:
        out.append(lm.forward(ids[at:at + n]))
        at += n
    return torch.cat(out)


def random_sizes(total: int, largest: int, rng: random.Random) -> list[int]:
    sizes = []
    while sum(sizes) < total:
        sizes.append(min(rng.randint(1, largest), total - sum(sizes)))
    return sizes


def exact_shapes(model, candidates=range(2, 9)) -> list[int]:
    tokens = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1))
    return [m for m in candidates if shape_is_exact(model, 97, PassShape(fixed=m), tokens)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_shape_logits_do_not_depend_on_the_split(dtype):
    """For every shape the machine check accepts (and at least one is accepted), across cache
    lengths that cross KEY_BLOCK boundaries, a token's logits are bitwise the same whether it
    is fed alone, in a block, or in a chunk of a longer pass."""
    target = tiny_llama(vocab_size=97, layers=2, hidden=64, context=2048).to(dtype)
    exact = exact_shapes(target)
    assert exact, "no pass shape from 2 to 8 rows is exact on this machine"
    rng = random.Random(0)
    tokens = [rng.randrange(97) for _ in range(KEY_BLOCK + 150)]
    first = KEY_BLOCK - 150  # the fed tokens straddle a key block boundary
    for rows in exact[-2:]:
        lm = CachedLM(target, 97, PassShape(fixed=rows))
        alone = split_logits(lm, tokens, first, [1] * (len(tokens) - first))
        for trial in range(3):
            largest = 2 * rows + 1 if trial % 2 else rows  # past rows: chunked passes
            sizes = random_sizes(len(tokens) - first, largest, rng)
            assert torch.equal(split_logits(lm, tokens, first, sizes), alone), (rows, sizes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_shape_logits_do_not_depend_on_the_split(dtype):
    """The exact shape runs every pass at its own size through row-invariant kernels: passes of
    1 to 2 query blocks + 1 rows, across a key block boundary, give bitwise the logits of
    one-token passes, while the stock kernels at the same sizes do not (so the check has
    teeth)."""
    target = tiny_llama(vocab_size=97, layers=2, hidden=64, context=2048).to(dtype)
    reason = kernels.supported(target)
    if reason:
        pytest.skip(reason)
    rng = random.Random(0)
    tokens = [rng.randrange(97) for _ in range(KEY_BLOCK + 150)]
    first = KEY_BLOCK - 150
    lm = CachedLM(target, 97, PassShape(row_invariant=True))
    alone = split_logits(lm, tokens, first, [1] * (len(tokens) - first))
    for _ in range(3):
        sizes = random_sizes(len(tokens) - first, 2 * kernels.QUERY_BLOCK + 1, rng)
        assert torch.equal(split_logits(lm, tokens, first, sizes), alone), sizes
    stock = CachedLM(target, 97, PassShape())
    assert not torch.equal(split_logits(stock, tokens, first, sizes), split_logits(
        stock, tokens, first, [1] * (len(tokens) - first)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_linear_row_is_the_same_alone_and_in_any_product(dtype):
    """At the real target's MLP geometry (1536 -> 576), oneDNN's one-row kernel rounds
    differently from its many-row kernel on some CPUs (an AVX-512 Xeon, both dtypes):
    a row computed alone must still equal that row in products of 2 to 20 rows."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no bfloat16 oneDNN kernels")
    linear = torch.nn.Linear(1536, 576, bias=False).to(dtype)
    packed = kernels.PackedLinear(linear)
    x = torch.randn(40, 1536, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.inference_mode():
        full = packed(x)
        for row in range(0, 40, 3):
            assert torch.equal(packed(x[row:row + 1]), full[row:row + 1]), row
            for rows in range(2, 21, 3):
                assert torch.equal(packed(x[row:row + rows]), full[row:row + rows]), (row, rows)
        assert packed(x[None, :1]).shape == (1, 1, 576)


def test_the_row_invariant_view_shares_weights_and_leaves_the_model_alone(tiny_models):
    target, _ = tiny_models
    if kernels.supported(target):
        pytest.skip(kernels.supported(target))
    view = CachedLM(target, 97, PassShape(row_invariant=True)).model
    assert view is not target and kernels.row_invariant_view(target) is view  # made once
    assert view.lm_head.weight is target.lm_head.weight
    assert target.config._attn_implementation == "sdpa"
    assert isinstance(target.lm_head, torch.nn.Linear)
    assert isinstance(view.lm_head, kernels.PackedLinear)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        torch.testing.assert_close(view.lm_head(target.model.embed_tokens(ids)),
                                   target.lm_head(target.model.embed_tokens(ids)))


def test_the_packed_view_keeps_the_models_logits_and_shares_its_weights(tiny_models):
    """The packed view (speed, not exactness): one token or several through oneDNN give the
    model's own logits to rounding; it shares the weights, is made once, leaves the model
    alone; other dtypes are refused."""
    target, _ = tiny_models
    if kernels.packable(target):
        pytest.skip(kernels.packable(target))
    view = kernels.packed_view(target)
    assert view is not target and kernels.packed_view(target) is view
    assert kernels.packed_view(view) is view
    assert view.lm_head.weight is target.lm_head.weight
    assert isinstance(target.lm_head, torch.nn.Linear)
    assert isinstance(view.lm_head, kernels.PackedLinear) and not view.lm_head.row_invariant
    assert view.config._attn_implementation == target.config._attn_implementation
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.inference_mode():
        torch.testing.assert_close(view(ids).logits, target(ids).logits)
        torch.testing.assert_close(view(ids[:, :1]).logits, target(ids[:, :1]).logits)
    half = tiny_llama(vocab_size=97).to(torch.float16)
    with pytest.raises(DecodeInputError, match="support float32 and bfloat16, not "
                                               "torch.float16"):
        kernels.packed_view(half)


def test_every_pass_after_the_prompt_runs_at_the_fixed_rows(tiny_models):
    target, draft = tiny_models
    decoder = make_decoder(target, draft, max_new_tokens=30, pass_shape=PassShape(fixed=5))
    rows = []
    hook = target.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        result = generate(decoder, [5, 6, 7, 8], make_controller("static:7"))  # 8 rows: 2 passes
    finally:
        hook.remove()
    assert rows[0] == 3  # the prompt's prefill: all but its last token, unpadded
    assert set(rows[1:]) == {5}
    assert len(rows) - 1 == sum(-(-(r.drafted + 1) // 5) for r in result.rounds)
    assert result.target_forwards == len(rows)


@pytest.mark.parametrize("kind", ["fixed", "exact"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_sd_equals_plain_decoding_bitwise_in_both_dtypes(dtype, kind):
    target = tiny_llama(vocab_size=97, layers=2, hidden=64).to(dtype)
    draft = tiny_llama(vocab_size=97, layers=1, hidden=32, seed=3).to(dtype)
    with torch.no_grad():  # a draft that often agrees: the target's own head on its embedding
        draft.lm_head.weight.copy_(target.lm_head.weight[:, :32])
    if kind == "exact":
        if kernels.supported(target):
            pytest.skip(kernels.supported(target))
        shape = PassShape(row_invariant=True)
    else:
        shape = PassShape(fixed=exact_shapes(target)[-1])
    decoder = make_decoder(target, draft, max_new_tokens=48, pass_shape=shape)
    for prompt in ([5, 6, 7, 8, 9], [1], list(range(30, 90))):
        plain = generate(decoder, prompt, make_controller("none")).output_ids
        for spec in ("static:1", "static:3", "static:9", "svip:0.5", "heuristic"):
            assert generate(decoder, prompt, make_controller(spec)).output_ids == plain, spec


def test_masked_forward_runs_branches_like_separate_sequences(tiny_models):
    """Two branches after a shared prefix, fed in one pass (or in chunks of a fixed shape),
    give each branch's own logits."""
    target, _ = tiny_models
    prefix, left, right = [5, 7, 11, 13], [20, 21], [30, 31]
    tokens = torch.tensor(left + right)
    positions = torch.tensor([4, 5, 4, 5])
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    allowed = torch.cat([torch.ones(4, 4, dtype=torch.bool), tree], dim=1)
    for shape in (PassShape(), PassShape(fixed=3), PassShape(fixed=8)):
        lm = CachedLM(target, 97, shape)
        lm.prefill(torch.tensor(prefix))
        logits = lm.forward_masked(tokens, positions, allowed)
        assert len(lm) == 8
        for branch, rows in ((left, logits[:2]), (right, logits[2:])):
            alone = CachedLM(target, 97, PassShape())
            expect = alone.forward(torch.tensor(prefix + branch))[-2:]
            torch.testing.assert_close(rows, expect, atol=1e-5, rtol=1e-4)
        lm.keep(4, [2, 3])  # the right branch becomes the sequence
        alone = CachedLM(target, 97, PassShape())
        alone.forward(torch.tensor(prefix + right))
        for kept, expected in zip(lm.cache.layers, alone.cache.layers):
            torch.testing.assert_close(kept.keys[:, :, :6], expected.keys[:, :, :6])
        with pytest.raises(ValueError, match="attention pattern has shape"):
            lm.forward_masked(tokens, positions, allowed)


def test_pass_shapes_parse_and_refuse_bad_specs():
    assert PassShape.parse("fixed:8") == PassShape(fixed=8)
    assert PassShape.parse("free") == PassShape()
    exact = PassShape.parse("exact")
    assert exact.exact and exact.rows(9) == 9 and exact.chunks(20) == [(0, 20)]
    assert exact.describe() == "exact"
    with pytest.raises(DecodeInputError, match="takes no fixed rows or padding"):
        PassShape(fixed=4, row_invariant=True)
    assert PassShape(fixed=4).rows(9) == 12 and PassShape(fixed=4).exact
    assert PassShape(pad_to=(1, 4, 4, 4)).rows(2) == 4 and not PassShape(pad_to=(1, 4)).exact
    for bad in ("fixed:0", "fixed", "fixed:x", "wide"):
        with pytest.raises(DecodeInputError, match="unknown pass shape"):
            PassShape.parse(bad)
    with pytest.raises(DecodeInputError, match="cannot run at fewer rows"):
        PassShape(pad_to=(1, 1))


def test_row_invariant_attention_reads_grouped_heads_and_refuses_softcap():
    """The view's attention hands grouped keys to SDPA as they are: each query head reads its
    group's key head, as with the keys repeated per head; padded query rows are dropped.
    Soft-capped attention (which it cannot do) is refused, not silently left out."""
    torch.manual_seed(0)
    query, key, value = torch.randn(1, 6, 3, 8), torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    mask = torch.rand(1, 1, 3, 40) > 0.3
    mask[..., 0] = True
    out, _ = kernels.query_block_attention(None, query, key, value, mask, scaling=0.25)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(3, 1), value.repeat_interleave(3, 1), attn_mask=mask,
        scale=0.25).transpose(1, 2)
    assert out.shape == (1, 3, 6, 8)
    torch.testing.assert_close(out, expected)
    with pytest.raises(DecodeInputError, match="soft-capping"):
        kernels.query_block_attention(None, query, key, value, mask, softcap=30.0)
