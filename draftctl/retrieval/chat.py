"""The built-in ``chat`` corpus: the target's own greedy responses to a prompt set's train split.

REST retrieves what the target tends to write; the closest text there is offline is the
target's own output. ``chat_responses`` generates it once (batched ``generate``, appended batch
by batch, so an interrupted build resumes) into a responses file, which ``build_datastore``
then reads as token documents (prompt with its chat template, then the response).
"""

from __future__ import annotations

from pathlib import Path

from draftctl.distill.data import generate_responses
from draftctl.distill.run import target_dtype
from draftctl.models import load_model
from draftctl.prompts import load_prompts


def chat_responses(target_spec: str, out_file: str | Path, prompts: str | None = None,
                   split: str = "train", max_new_tokens: int = 192, batch_size: int = 16,
                   max_prompt_tokens: int = 384, device: str = "cpu",
                   dtype: str = "auto") -> Path:
    """Write (or finish writing) the target's greedy responses to ``out_file``, batched, in
    ``dtype`` (auto: the calibrated one)."""
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    target = load_model(target_spec, device, target_dtype(target_spec, device, dtype))
    generate_responses(target.model, target.tokenizer, load_prompts(prompts, split), out_file,
                       samples_per_prompt=0, max_new_tokens=max_new_tokens, temperature=1.0,
                       top_p=1.0, batch_size=batch_size, max_prompt_tokens=max_prompt_tokens,
                       seed=0, eos_ids=target.eos_token_ids)
    return out_file
