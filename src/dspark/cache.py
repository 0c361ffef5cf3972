"""Where dspark keeps what it builds on this machine: converted targets, compiled kernels, cost-table profiles."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$DSPARK_CACHE, else $XDG_CACHE_HOME/dspark, else ~/.cache/dspark."""
    base = os.environ.get("DSPARK_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dspark")
    return Path(base)
