"""Collect traces: real SD runs recorded one row per drafted token."""
