"""A fresh offline vLLM engine, in the test's own process, for tests that look at engine outputs directly."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from support.in_process import in_process_llm


def generate_one_by_one(engine_kwargs: dict[str, Any], prompts: Sequence[str], params: Any) -> list[Any]:
    """Each prompt in turn (one request at a time) in a fresh ``vllm.LLM`` built from
    ``engine_kwargs`` in this process (support/in_process.py), always shut down after; the final
    ``RequestOutput`` of each."""
    with in_process_llm(**engine_kwargs) as llm:
        finals = []
        for prompt in prompts:
            (final,) = llm.generate([prompt], params, use_tqdm=False)
            assert final.finished
            finals.append(final)
        return finals
