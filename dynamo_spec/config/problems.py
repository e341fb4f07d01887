"""A preflight problem: one line saying what is wrong and how to fix it (preflight.py, ray_cluster.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Problem:
    level: Literal["error", "warning"]
    message: str

    def __str__(self) -> str:
        return f"{self.level}: {self.message}"
