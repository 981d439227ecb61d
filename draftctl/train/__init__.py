"""Traces -> controllers: replay with a cost model, fitters, threshold choice."""
