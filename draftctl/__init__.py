"""draftctl: decide, token by token, when the draft model should stop drafting."""

__version__ = "0.1.0"
