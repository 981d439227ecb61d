"""Drafters: where draft tokens come from (a draft model; retrieval later)."""
