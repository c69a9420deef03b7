"""One logging set-up for every entry point: stderr, level from SKILL_LOG_LEVEL (default INFO)."""

import logging
import os
import sys

LOG_LEVEL_ENV = "SKILL_LOG_LEVEL"


def setup_logging(rank: int | None = None) -> None:
    """A rank of several (WORLD_SIZE > 1, from its launcher) prefixes its lines with `[rank<rank>]`, by default
    its RANK (standalone runners pass it)."""
    level = os.environ.get(LOG_LEVEL_ENV, "INFO").upper()
    rank = os.environ.get("RANK", "0") if rank is None else rank
    prefix = f"[rank{rank}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        stream=sys.stderr,
        force=True,
        format=f"%(asctime)s {prefix}%(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
