"""The draft/verify decoder: feature records, accept rules, and the round loop."""

from draftctl.decode.features import FEATURE_NAMES, SCHEMA_VERSION, FeatureRecord
from draftctl.decode.loop import (
    DecodeConfig,
    DecodeInputError,
    DecodingOptions,
    GenerationResult,
    RoundRecord,
    SpeculativeDecoder,
    generate,
)
from draftctl.decode.verify import SamplingConfig

__all__ = [
    "FEATURE_NAMES",
    "SCHEMA_VERSION",
    "DecodeConfig",
    "DecodeInputError",
    "DecodingOptions",
    "FeatureRecord",
    "GenerationResult",
    "RoundRecord",
    "SamplingConfig",
    "SpeculativeDecoder",
    "generate",
]
