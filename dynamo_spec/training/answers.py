"""The target's own greedy answers to the training prompts (vLLM, batched, bf16).

The draft must imitate this target, so the answers come from it and not from the
datasets. Output rows carry token ids (prompt and answer) for the hidden-state pass;
the file is appended chunk by chunk, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

from tqdm import tqdm

from .offline_llm import offline_llm, request_params
from .rows import read_jsonl, sample_seed

logger = logging.getLogger(__name__)


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


def generate_answers(target: Path, prompts_path: Path, out_path: Path, *,
                     max_new_tokens: int, max_prompt_tokens: int = 1024,
                     max_num_seqs: int = 256, kv_cache_gib: float = 2.0, seed: int = 0,
                     minutes: float | None = None, budget_name: str = "",
                     sampling: str = "plain") -> Path:
    """Append ``{"id", "source", "prompt_ids", "answer_ids", "answer", "finish_reason"}`` rows (greedy;
    rows with a ``temperature`` are sampled, seeded by ``seed`` and the row id).

    All prompts are queued at once (full batches throughout) in a seeded shuffled
    order, so any prefix is a balanced mix of the sources; each answer is written
    when it finishes. ``minutes`` caps the time spent over all runs (kept beside the
    output, by ``budget_name``: another pass appending to the same file has its own):
    a run stops there, dropping unfinished answers; re-running continues with the
    prompts not yet answered while budget is left.

    ``sampling`` "plain": the row's temperature alone; "defaults": as the server samples
    a request that sets only its temperature (the target's ``generation_config.json``
    fills top_p, repetition_penalty and the like), so the draft learns the answers users
    get at the shipped defaults.
    """
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    done = {r["id"] for r in read_jsonl(out_path)} if out_path.exists() else set()
    todo = [r for r in read_jsonl(prompts_path, split="train") if r["id"] not in done]
    random.Random(seed).shuffle(todo)
    budget_file = out_path.with_suffix(f".{budget_name}.seconds" if budget_name else ".seconds")
    spent = float(budget_file.read_text()) if budget_file.exists() else 0.0
    if not todo or (minutes is not None and spent >= 60 * minutes):
        logger.info("answers complete (%d rows, %.0f s spent): %s", len(done), spent, out_path)
        return out_path
    if minutes is not None:
        minutes -= spent / 60
    tok = AutoTokenizer.from_pretrained(target)
    pending = {}
    for r in todo:
        ids = chat_prompt_ids(tok, r["messages"])
        if len(ids) <= max_prompt_tokens:
            pending[r["id"]] = (r, ids)

    def params(r: dict) -> SamplingParams:  # greedy, or sampled as the row asks
        t = r.get("temperature") or 0.0
        fields = {"temperature": t, "max_tokens": max_new_tokens, "seed": sample_seed(seed, r["id"]) if t else None}
        return request_params(llm, **fields) if sampling == "defaults" else SamplingParams(**fields)

    start, n_tokens = time.monotonic(), 0
    with offline_llm(target, kv_cache_bytes=int(kv_cache_gib * 2**30), max_num_seqs=max_num_seqs) as llm, \
            open(out_path, "a") as f, \
            tqdm(total=len(pending), desc="answers", unit="prompt") as bar:
        engine = llm.llm_engine
        rid_map = {key: key for key in pending}
        for key, (r, ids) in pending.items():
            rid_map[engine.add_request(key, TokensPrompt(prompt_token_ids=ids), params(r))] = key
        while engine.has_unfinished_requests():
            for out in engine.step():
                if not out.finished:
                    continue
                r, ids = pending[rid_map[out.request_id]]
                ans = list(out.outputs[0].token_ids)
                n_tokens += len(ans)
                f.write(json.dumps({"id": r["id"], "source": r["source"], "prompt_ids": ids,
                                    "answer_ids": ans, "answer": out.outputs[0].text,
                                    "finish_reason": out.outputs[0].finish_reason}) + "\n")
                bar.update(1)
            f.flush()
            budget_file.write_text(f"{spent + time.monotonic() - start:.0f}")
            bar.set_postfix(tok_s=f"{n_tokens / (time.monotonic() - start):.0f}")
            if minutes is not None and time.monotonic() - start > 60 * minutes:
                logger.info("answer time budget (%.0f min) reached", minutes)
                break
    logger.info("answers: %d tokens in %.0f s", n_tokens, time.monotonic() - start)
    return out_path
