"""``train-draft`` end to end: prompts -> target answers and hidden states -> training.

Two ways to get answers and states: the default ``decoder`` (:mod:`.decode`, one pass
that keeps the states as it decodes, about 2x vLLM's CPU throughput here), or ``vllm``
(vLLM answers, then a transformers pass for the states). Every stage writes into
``work_dir`` and skips what is already there, so re-running the same command after an
interruption resumes (training from its last checkpoint). ``data_from`` adds the
answers and states of earlier work dirs: their prompts are not answered again.
``self_prompts`` adds prompts the target writes itself (:mod:`.self_prompts`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from .data import read_jsonl, source_table, write_prompts

logger = logging.getLogger(__name__)


@dataclass
class PipelineConfig:
    target: Path
    out: Path
    work_dir: Path
    seed: int = 0
    steps: int | None = None
    minutes: float | None = 25.0
    answer_minutes: float | None = 26.0
    max_new_tokens: int = 128
    aux_layers: tuple = (2, 15, 27)
    draft_vocab: int = 8192
    # the target's compute dtype for answers and states (both generators); bf16 is the
    # serving dtype, fp32 is about 1.7x faster in the decoder on a CPU without bf16 units
    dtype: str = "bfloat16"
    generator: str = "decoder"
    more_chitchat: int = 20000
    samples: int = 0
    temperature: float = 0.7
    self_prompts: int = 0
    self_temperature: float = 0.8
    self_seed: int | None = None  # the self-prompts' sampling seed; default: ``seed``
    init_from: Path | None = None
    data_from: tuple = ()
    timings: dict = field(default_factory=dict)


def _timed(cfg: PipelineConfig, name: str, fn, *args, **kwargs):
    """Run a stage; its seconds add up over resumed runs in ``timings.json``."""
    path = cfg.work_dir / "timings.json"
    t0 = time.monotonic()
    result = fn(*args, **kwargs)
    timings = json.loads(path.read_text()) if path.exists() else {}
    timings[name] = round(timings.get(name, 0) + time.monotonic() - t0)
    path.write_text(json.dumps(timings, indent=2) + "\n")
    cfg.timings = timings
    logger.info("stage %s: %d s (all runs)", name, timings[name])
    return result


def _earlier_prompts(work: Path) -> list[dict]:
    """The prompts an earlier work dir answered (with its self-prompts, if any)."""
    merged = work / "answer_prompts.jsonl"
    return read_jsonl(merged if merged.exists() else work / "prompts.jsonl")


def run_pipeline(cfg: PipelineConfig) -> dict:
    from .answers import generate_answers
    from .decode import generate_with_states
    from .hidden_states import extract_hidden_states, load_shards
    from .self_prompts import SOURCE, merge_prompt_files, write_self_prompts
    from .train import TrainConfig, train

    work = cfg.work_dir
    work.mkdir(parents=True, exist_ok=True)
    prompts = _timed(cfg, "prompts", write_prompts, work / "prompts.jsonl", work / "downloads",
                     cfg.seed, more_chitchat=cfg.more_chitchat, samples=cfg.samples,
                     temperature=cfg.temperature)
    if cfg.self_prompts:
        known = {m["content"] for d in cfg.data_from for r in _earlier_prompts(Path(d))
                 for m in r["messages"] if m["role"] == "user"}
        own = _timed(cfg, "self_prompts", write_self_prompts, cfg.target,
                     work / "self_prompts.jsonl", cfg.self_prompts,
                     seed=cfg.seed if cfg.self_seed is None else cfg.self_seed,
                     temperature=cfg.self_temperature, dtype=cfg.dtype, known=known)
        prompts = merge_prompt_files(work / "answer_prompts.jsonl", prompts, own)
    if cfg.generator == "decoder":
        skip = {r["id"] for d in cfg.data_from for r in read_jsonl(Path(d) / "answers.jsonl")}
        _timed(cfg, "answers_and_states", generate_with_states, cfg.target, prompts, work,
               aux_layers=cfg.aux_layers, max_new_tokens=cfg.max_new_tokens,
               minutes=cfg.answer_minutes, skip_ids=skip, seed=cfg.seed, dtype=cfg.dtype)
    else:
        answers = _timed(cfg, "answers", generate_answers, cfg.target, prompts,
                         work / "answers.jsonl", max_new_tokens=cfg.max_new_tokens,
                         seed=cfg.seed, minutes=cfg.answer_minutes)
        _timed(cfg, "hidden_states", extract_hidden_states, cfg.target, answers,
               work / "hidden", cfg.aux_layers, dtype=cfg.dtype)
    seqs = [s for d in (*cfg.data_from, work) for s in load_shards(Path(d) / "hidden")]
    eos_id = json.loads((cfg.target / "config.json").read_text())["eos_token_id"]
    tcfg = TrainConfig(seed=cfg.seed, steps=cfg.steps,
                       minutes=None if cfg.steps else cfg.minutes,
                       aux_layers=tuple(cfg.aux_layers), draft_vocab=cfg.draft_vocab,
                       init_from=cfg.init_from)
    summary = _timed(cfg, "train", train, cfg.target, seqs, cfg.out, work / "checkpoint.pt",
                     tcfg, eos_id)
    sources = source_table() + ([{"name": SOURCE, "package": "the target itself",
                                  "licence": "the target's"}] if cfg.self_prompts else [])
    summary.update({"timings_s": cfg.timings, "sources": sources,
                    "answer_sequences": len(seqs)})
    (work / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
