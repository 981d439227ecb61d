"""What every benchmark script does last: write its JSON report (and print it)."""

from __future__ import annotations

import json
from pathlib import Path


def write_report(report: dict, out: str | Path, show: bool = True) -> Path:
    """Write ``report`` as JSON to ``out`` (folders created); print it first when ``show``."""
    text = json.dumps(report, indent=2)
    if show:
        print(text)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    return out
