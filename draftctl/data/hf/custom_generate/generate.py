"""draftctl's controlled assisted generation as transformers' ``custom_generate``:

    model.generate(input_ids, custom_generate=draftctl.hf.CUSTOM_GENERATE,
                   trust_remote_code=True, assistant_model=draft, controller="svip:0.3")
"""

from draftctl.hf import custom_generate as generate  # noqa: F401
