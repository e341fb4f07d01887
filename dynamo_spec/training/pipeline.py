"""``train-draft`` end to end: prompts -> target answers and hidden states -> training.

Two ways to get answers and states: the default ``vllm`` (vLLM answers at a large batch,
then one transformers prefill pass for the states), or ``decoder`` (:mod:`.decode`, one
pass that keeps the states as it decodes); vLLM's path is the faster on CPU, prefill
pass included (data/README.md, "What a round costs"). Every stage writes into
``work_dir`` and skips what is already there, so re-running the same command after an
interruption resumes (training from its last checkpoint). ``data_from`` adds the
answers and states of earlier work dirs: their prompts are not answered again.
``self_prompts`` adds prompts the target writes itself (:mod:`.self_prompts`).

``corpus`` trains on the rounds kept in the repository (:mod:`.corpus`) instead, their
states recomputed by one prefill pass and cached; ``add_round`` first generates as
above and adds the answers to the corpus as a new round, so they outlive ``work_dir``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from .data import source_table, write_prompts
from .draft_defaults import AUX_LAYERS, DRAFT_FORMAT, DRAFT_VOCAB
from .rows import eval_texts, read_jsonl, write_jsonl

logger = logging.getLogger(__name__)


def _opt(default, help: str, **kwargs):
    """A field of PipelineConfig that is also a ``train-draft`` option (cli.py builds
    the parser from these: the default and the help live here only)."""
    return field(default=default, metadata={"help": help, **kwargs})


@dataclass
class PipelineConfig:
    """Every option of ``train-draft`` with its default: the one home for them."""

    target: Path = field(metadata={"help": "target model directory", "required": True})
    out: Path = field(metadata={"help": "where to write the draft", "required": True})
    work_dir: Path = _opt(Path(".cache/train"), "intermediate data and checkpoints")
    seed: int = _opt(0, "seed of the prompt split, sampling and training")
    steps: int | None = _opt(None, "exact number of optimizer steps (instead of --minutes)")
    minutes: float | None = _opt(25.0, "training time budget (steps estimated once, then fixed)")
    answer_minutes: float | None = _opt(26.0, "time budget for generating answers (stops early, resumable)")
    max_new_tokens: int = _opt(192, "longest answer the target writes per prompt")
    aux_layers: tuple[int, ...] = _opt(AUX_LAYERS, "target layers fed to the draft, e.g. '2,15,27'")
    draft_vocab: int = _opt(DRAFT_VOCAB, "draft vocabulary size (the most frequent answer tokens)")
    draft_format: str = _opt(DRAFT_FORMAT, "config.json of the written draft: vllm (LlamaForCausalLMEagle3) or speculators "
                             "(vLLM's speculators library's format; the same weights)", choices=("vllm", "speculators"))
    # what the target's pass in transformers (answers and states) and the training loop compute in;
    # auto follows the host as serving does (precision.py): bf16 on a CPU without bf16 units is emulated, slow
    dtype: str = _opt("auto", "what the target's passes in transformers (the decoder's answers and states, the "
                      "self-prompts, vllm's states pass) and the training loop compute in; auto: bfloat16 where the "
                      "CPU has native bf16 (AVX512-BF16, AMX), else float32, as serving's engine.dtype auto",
                      choices=("auto", "bfloat16", "float32"))
    keep_vocab: bool = _opt(False, "with --init-from: keep that draft's vocabulary (lm_head, d2t) and config, so "
                            "the new draft loads in its place, instead of choosing the vocabulary from these rows")
    generator: str = _opt("vllm", "vllm: vLLM answers at a large batch, then a prefill pass for the states "
                          "(the faster); decoder: one transformers pass keeps the hidden states while it decodes",
                          choices=("vllm", "decoder"))
    answer_sampling: str = _opt("plain", "plain: each answer at its temperature alone; defaults: as the server "
                                "samples a request that sets only its temperature (the target's generation_config.json "
                                "adds top_p, repetition_penalty), for a draft that serves the shipped defaults "
                                "(--generator vllm)", choices=("plain", "defaults"))
    more_chitchat: int = _opt(20000, "extra chit-chat prompts (other cuts of non-held-out conversations)")
    samples: int = _opt(0, "extra sampled answers per train prompt of the small sources "
                        "(chatterbot, mtbench, humaneval, mmlu, bbh)")
    temperature: float = _opt(0.7, "sampling temperature of those extra answers")
    self_prompts: int = _opt(0, "this many extra prompts written by the target itself (Magpie: sampled from "
                             "its chat template's start of a user turn)")
    self_temperature: float = _opt(0.8, "sampling temperature of those prompts")
    self_kinds: str = _opt("mixed", "which requests to start: mixed (free ones and multiple-choice questions), "
                           "instructions (explanations, how-tos, recipes, tips, writing, comparisons) or everyday "
                           "(instructions plus why/how questions and facts)",
                           choices=("mixed", "instructions", "everyday"))
    self_answer_temperatures: tuple[float, ...] = _opt((0.0,), "the answers of those prompts, in turn at these "
                                                       "temperatures (0: greedy), e.g. '0,0.7,1'")
    answer_sources: tuple[str, ...] = _opt((), "answer only the prompts of these sources, e.g. 'magpie,mtbench' "
                                           "(default: all)")
    second_turns: int = _opt(0, "this many answered conversations get a second user turn (a follow-up: shorter, "
                             "an example, simpler, a rewrite, more on a point, ...) and are answered again at the "
                             "first answer's temperature (--generator vllm)")
    self_seed: int | None = _opt(None, "sampling seed of those prompts (default: --seed); another seed gives new "
                                 "requests while the prompt split, set by --seed, stays")
    init_from: Path | None = _opt(None, "start from this draft's weights (fc, decoder layer, norm) instead of a "
                                  "random init")
    data_from: tuple[Path, ...] = _opt((), "an earlier work dir whose answers and states are trained on too "
                                       "(its prompts are not answered again); repeatable")
    corpus: Path | None = _opt(None, "train on the rounds of this corpus folder (e.g. data) instead of generating "
                               "answers; their hidden states are recomputed by one prefill pass and cached")
    rounds: tuple[int, ...] = _opt((), "train on these corpus rounds only, e.g. '1,2' (default: every round of "
                                   "the manifest)")
    add_round: bool = _opt(False, "generate answers as without --corpus, add them to --corpus as a new round, "
                           "then train on the corpus (with --rounds: those and the new round)")
    states_cache: Path = _opt(Path(".cache/corpus-states"), "where the corpus rows' hidden states are kept, by "
                              "target checksum and round")
    timings: dict = field(default_factory=dict, metadata={"cli": False})

    def __post_init__(self):
        if self.generator != "vllm" and (self.second_turns or self.answer_sampling != "plain"):
            raise ValueError(f"--{'second-turns' if self.second_turns else 'answer-sampling'} needs --generator vllm")
        if self.corpus is None and (self.add_round or self.rounds):
            raise ValueError(f"--{'add-round' if self.add_round else 'rounds'} needs --corpus (the corpus folder)")
        if self.keep_vocab and self.init_from is None:
            raise ValueError("--keep-vocab keeps the vocabulary of --init-from: set it")


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


def _generate(cfg: PipelineConfig) -> None:
    """Prompts, then the target's answers (and their states, unless the corpus's
    prefill pass will compute them) in ``work_dir``."""
    from .answers import generate_answers
    from .decode import generate_with_states
    from .hidden_states import extract_hidden_states
    from .self_prompts import KIND_SETS, merge_prompt_files, write_self_prompts

    work = cfg.work_dir
    prompts = _timed(cfg, "prompts", write_prompts, work / "prompts.jsonl", work / "downloads",
                     cfg.seed, more_chitchat=cfg.more_chitchat, samples=cfg.samples,
                     temperature=cfg.temperature)
    if cfg.self_prompts:
        known = {m["content"] for d in cfg.data_from for r in _earlier_prompts(Path(d))
                 for m in r["messages"] if m["role"] == "user"}
        own = _timed(cfg, "self_prompts", write_self_prompts, cfg.target,
                     work / "self_prompts.jsonl", cfg.self_prompts,
                     seed=cfg.seed if cfg.self_seed is None else cfg.self_seed,
                     temperature=cfg.self_temperature, dtype=cfg.dtype, known=known,
                     avoid=eval_texts(),
                     kinds=KIND_SETS[cfg.self_kinds],
                     answer_temperatures=tuple(cfg.self_answer_temperatures))
        prompts = merge_prompt_files(work / "answer_prompts.jsonl", prompts, own)
    if cfg.answer_sources:
        prompts = write_jsonl(work / "answer_prompts_selected.jsonl",
                              [r for r in read_jsonl(prompts) if r["source"] in cfg.answer_sources])
    if cfg.generator == "decoder":
        skip = {r["id"] for d in cfg.data_from for r in read_jsonl(Path(d) / "answers.jsonl")}
        _timed(cfg, "answers_and_states", generate_with_states, cfg.target, prompts, work,
               aux_layers=cfg.aux_layers, max_new_tokens=cfg.max_new_tokens,
               minutes=cfg.answer_minutes, skip_ids=skip, seed=cfg.seed, dtype=cfg.dtype)
    else:
        answers = _timed(cfg, "answers", generate_answers, cfg.target, prompts,
                         work / "answers.jsonl", max_new_tokens=cfg.max_new_tokens,
                         seed=cfg.seed, minutes=cfg.answer_minutes, sampling=cfg.answer_sampling)
        if cfg.second_turns:
            from .second_turns import write_second_turns

            follow = write_second_turns(work / "second_turn_prompts.jsonl", prompts, answers, cfg.second_turns,
                                        seed=cfg.seed if cfg.self_seed is None else cfg.self_seed,
                                        avoid=eval_texts())
            answers = _timed(cfg, "second_turn_answers", generate_answers, cfg.target, follow,
                             work / "answers.jsonl", max_new_tokens=cfg.max_new_tokens,
                             seed=cfg.seed, minutes=cfg.answer_minutes, budget_name="second_turns",
                             sampling=cfg.answer_sampling)
        if cfg.corpus is None:
            _timed(cfg, "hidden_states", extract_hidden_states, cfg.target, answers,
                   work / "hidden", cfg.aux_layers, dtype=cfg.dtype)


def add_work_round(cfg: PipelineConfig) -> dict | None:
    """The answers in ``work_dir`` as a new round of ``cfg.corpus`` (rows already in the
    corpus are left out, so running it again adds nothing)."""
    from .corpus import add_round, work_rows

    generator = {"generator": cfg.generator, "dtype": cfg.dtype, "max_new_tokens": cfg.max_new_tokens,
                 "seed": cfg.seed, "answer_sampling": cfg.answer_sampling,
                 "prompts": {"answer_sources": list(cfg.answer_sources), "self_prompts": cfg.self_prompts,
                             "self_kinds": cfg.self_kinds, "self_seed": cfg.self_seed,
                             "self_temperature": cfg.self_temperature, "second_turns": cfg.second_turns}}
    if cfg.answer_sampling == "defaults":
        from .corpus import sampling_defaults

        generator["sampling_defaults"] = sampling_defaults(cfg.target)
    return add_round(cfg.corpus, work_rows(cfg.work_dir), cfg.target, generator)


def run_pipeline(cfg: PipelineConfig) -> dict:
    """Without ``corpus``: generate into ``work_dir`` and train on it. With ``corpus``:
    train on its rounds; with ``add_round`` too, generate first and add a round."""
    from .corpus import corpus_states
    from .hidden_states import load_shards
    from .precision import training_dtype
    from .self_prompts import SOURCE
    from .train import TrainConfig, train

    work = cfg.work_dir
    work.mkdir(parents=True, exist_ok=True)
    asked = cfg.dtype
    cfg.dtype, why = training_dtype(asked)
    logger.info("computing in %s (%s: %s)", cfg.dtype, asked, why)
    corpus = None
    if cfg.corpus is None or cfg.add_round:
        _generate(cfg)
    rounds = tuple(cfg.rounds)
    if cfg.add_round:
        added = work / "corpus_round.json"  # a resumed run adds nothing: it remembers its round here
        entry = _timed(cfg, "corpus_add", add_work_round, cfg)
        if entry:
            added.write_text(json.dumps({"round": entry["round"]}) + "\n")
        if rounds and added.exists():
            rounds += (json.loads(added.read_text())["round"],)
    seqs = [s for d in cfg.data_from for s in load_shards(Path(d) / "hidden")]
    if cfg.corpus is None:
        seqs += load_shards(work / "hidden")
        sources = source_table() + ([{"name": SOURCE, "package": "the target itself",
                                      "licence": "the target's"}] if cfg.self_prompts else [])
    else:
        corpus_seqs, corpus = _timed(cfg, "corpus_states", corpus_states, cfg.corpus, cfg.target,
                                     aux_layers=tuple(cfg.aux_layers), dtype=cfg.dtype,
                                     cache_root=cfg.states_cache, rounds=rounds or None)
        seqs += corpus_seqs
        sources = corpus.pop("sources")
    eos_id = json.loads((cfg.target / "config.json").read_text())["eos_token_id"]
    tcfg = TrainConfig(seed=cfg.seed, steps=cfg.steps,
                       minutes=None if cfg.steps else cfg.minutes,
                       aux_layers=tuple(cfg.aux_layers), draft_vocab=cfg.draft_vocab,
                       init_from=cfg.init_from, keep_vocab=cfg.keep_vocab, draft_format=cfg.draft_format,
                       dtype=cfg.dtype)
    summary = _timed(cfg, "train", train, cfg.target, seqs, cfg.out, work / "checkpoint.pt",
                     tcfg, eos_id)
    summary.update({"timings_s": cfg.timings, "sources": sources,
                    "answer_sequences": len(seqs), "dtype": {"asked": asked, "used": cfg.dtype, "why": why}})
    if corpus is not None:
        summary["corpus"] = corpus
    (work / "training_summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary
