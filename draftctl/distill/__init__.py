"""Distil a small draft model from a target (``draftctl distill``)."""
