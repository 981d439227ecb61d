"""Errors that mean "bad input", as opposed to bugs. The CLI prints these without a trace."""


class DraftctlError(ValueError):
    """Base class of every input error draftctl raises on purpose."""


class DecodeInputError(DraftctlError):
    """A prompt or decoding setting the decoder cannot run with."""
