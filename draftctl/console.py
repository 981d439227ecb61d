"""Messages for the person at the terminal, kept off stdout (which carries results)."""

from __future__ import annotations

import sys


def notice(message: str) -> None:
    """One line on stderr, prefixed with ``draftctl:``."""
    print(f"draftctl: {message}", file=sys.stderr, flush=True)
