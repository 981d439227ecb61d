"""The draft/verify decoder: feature records, accept rules, and the round loop."""

from draftctl.decode.features import FEATURE_NAMES, SCHEMA_VERSION, FeatureRecord
from draftctl.decode.loop import (
                                  DecodeConfig,
                                  DecodeInputError,
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
                                  "FeatureRecord",
                                  "GenerationResult",
                                  "RoundRecord",
                                  "SamplingConfig",
                                  "SpeculativeDecoder",
                                  "generate",
]
