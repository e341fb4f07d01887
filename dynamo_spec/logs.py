"""The one logging set-up of the command-line tools (serve, prepare-default, training)."""

from __future__ import annotations

import logging

FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


def setup_logging(level: str = "INFO") -> None:
    """Log to stderr at ``level`` in one format (a later call only changes the level)."""
    logging.basicConfig(level=level.upper(), format=FORMAT)
    logging.getLogger().setLevel(level.upper())
