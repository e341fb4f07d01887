"""``dynamo-spec eval-sampling``: which sampling defaults keep answers right, loop rarely and draft well.

For each setting (the penalty fields a request would get by default, and per-request sampling
extras such as DRY's ``dry_multiplier``), on one engine with the draft:

- the checked requests (``checked.py``, greedy): how many answers pass their check (a list that
  runs on past its end fails), and the mean acceptance length;
- the open-ended requests (``open_ended_eval.jsonl``: the README's poem, stories, explanations
  and lists), each at several seeds at the model's default temperature and top_p: the answers
  that loop and the mean share of repeated word 4-grams (``degeneration.text_degeneration``),
  and the mean acceptance length.

All settings' requests go to the engine at once: sampling fields and extras are per request, and
each open-ended answer has its own seed (``rows.sample_seed``), so an answer does not depend on
the requests batched with it, and the engine stays full until the last answer.

Offline (vLLM's engine in this process's children, the server's engine settings); the speed
a default gives through the server is the bench's job.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..sampling import dry
from .checked import load_checked, passes
from .degeneration import text_degeneration
from .rows import read_jsonl, sample_seed

OPEN_ENDED_EVAL = Path(__file__).with_name("open_ended_eval.jsonl")
NEUTRAL = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
EXTRAS = "extra_args"  # a setting's per-request sampling extras (SamplingParams.extra_args)
SETTINGS = {
    "presence 0.8": {"presence_penalty": 0.8},  # the CPU default's generation_config.json
    "no penalty": {},
    "dry 0.5": {EXTRAS: {"dry_multiplier": 0.5}},
    "dry 0.8": {EXTRAS: {"dry_multiplier": 0.8}},  # llama.cpp's suggestion
    "dry 1.2": {EXTRAS: {"dry_multiplier": 1.2}},
    "dry 0.8 + presence 0.3": {"presence_penalty": 0.3, EXTRAS: {"dry_multiplier": 0.8}},
    "frequency 0.3": {"frequency_penalty": 0.3},
    "frequency 0.5": {"frequency_penalty": 0.5},
}


def load_open_ended(path: Path = OPEN_ENDED_EVAL) -> list[dict]:
    return read_jsonl(path)


def _chat_ids(tok, prompt: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)


def penalty_fields(setting: dict) -> dict:
    """The sampling fields of a setting's requests: its penalties, neutral ones for the rest (not the
    model's defaults), so that settings differ by their own fields only; and its extras, if any."""
    fields = {**NEUTRAL, **{k: v for k, v in setting.items() if k != EXTRAS}}
    return {**fields, EXTRAS: dict(setting[EXTRAS])} if setting.get(EXTRAS) else fields


def is_model_default(setting: dict, model_defaults: dict) -> bool:
    """Whether a setting's requests get what a request that sets no penalty gets: the model's
    defaults (``generation_config.json``), no extras."""
    return penalty_fields(setting) == {k: model_defaults.get(k, v) for k, v in NEUTRAL.items()}


def open_seed(seed: int, row: dict) -> int:
    """An open-ended answer's seed: the same in every setting (settings compared on the same draws)."""
    return sample_seed(seed, row["id"])


def evaluate_sampling(target: Path, draft: Path, *, k: int = 3, settings: dict[str, dict] = SETTINGS,
                      seeds: int = 4, max_tokens: int = 250, draft_penalties: bool = True,
                      dtype: str = "bfloat16") -> list[dict]:
    """One row per setting: checked answers right, loops of the open-ended answers, acceptance."""
    from transformers import AutoTokenizer
    from vllm.inputs import TokensPrompt

    from .evaluate import acceptance
    from .offline_llm import offline_llm, request_params

    tok = AutoTokenizer.from_pretrained(target)
    checked, open_rows = load_checked(), load_open_ended()
    checked_ids = [TokensPrompt(prompt_token_ids=_chat_ids(tok, r["messages"][0]["content"])) for r in checked]
    open_ids = [TokensPrompt(prompt_token_ids=_chat_ids(tok, r["messages"][0]["content"])) for r in open_rows]
    opens = [(s, i) for s in range(seeds) for i in range(len(open_rows))]
    # KV cache for 64 requests of the longest prompt and answer: none is preempted (and recomputed)
    longest = max(len(p["prompt_token_ids"]) for p in checked_ids + open_ids) + max_tokens + k + 1
    with offline_llm(target, draft=draft, k=k, dtype=dtype, max_num_seqs=64,
                     kv_cache_bytes=kv_cache_bytes(target, 64, longest, dtype),
                     per_request_spec_decode_metrics="summary", draft_penalties=draft_penalties) as llm:
        defaults = llm.model_config.get_diff_sampling_param()
        prompts, params = [], []
        for setting in settings.values():
            fields = penalty_fields(setting)
            prompts += checked_ids + [open_ids[i] for _, i in opens]
            params += [request_params(llm, temperature=0.0, max_tokens=max_tokens, **fields)] * len(checked_ids)
            params += [request_params(llm, max_tokens=max_tokens, seed=open_seed(s, open_rows[i]), **fields)
                       for s, i in opens]
        outs = llm.generate(prompts, params, use_tqdm=False)
    rows, per = [], len(checked_ids) + len(opens)
    for n, (name, setting) in enumerate(settings.items()):
        mine = outs[n * per:(n + 1) * per]
        checked_outs, open_outs = mine[:len(checked_ids)], mine[len(checked_ids):]
        answers = [{"id": open_rows[i]["id"], "seed": s, "text": o.outputs[0].text,
                    "cut": o.outputs[0].finish_reason == "length"} for (s, i), o in zip(opens, open_outs, strict=True)]
        rows.append(setting_row(name, setting, checked, [o.outputs[0].text for o in checked_outs], answers,
                                checked_acceptance=acceptance(checked_outs, k)["mean_acceptance_length"],
                                open_acceptance=acceptance(open_outs, k)["mean_acceptance_length"],
                                model_default=is_model_default(setting, defaults)))
    return rows


def kv_cache_bytes(target: Path, requests: int, tokens: int, dtype: str, block: int = 128) -> int:
    """KV-cache bytes for ``requests`` requests of ``tokens`` tokens each (in whole blocks of ``block``
    tokens, the CPU's, and one more) of the target (its config.json) and a one-layer draft; at least
    512 MiB."""
    config = json.loads((Path(target) / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    per_token = 2 * (config["num_hidden_layers"] + 1) * heads * head_dim * (4 if dtype == "float32" else 2)
    return max(512 * 2**20, requests * (-(-tokens // block) + 1) * block * per_token)


def setting_row(name: str, setting: dict, checked: list[dict], answers: list[str], open_answers: list[dict], *,
                checked_acceptance: float, open_acceptance: float, model_default: bool = False) -> dict:
    """A setting's row: the checked answers that pass (and the ids of those that fail); of the open-ended
    answers (``{"id", "seed", "text", "cut"}``; cut: ended at the token limit), those that loop and the
    mean share of repeated word 4-grams (each answer against itself); the poem's answers."""
    failed = [r["id"] for r, a in zip(checked, answers, strict=True) if not passes(a, r["check"])]
    deg = text_degeneration([a["text"] for a in open_answers], [a["cut"] for a in open_answers])
    return {
        "setting": name, "fields": setting, "model_default": model_default,
        "passed": len(checked) - len(failed), "checked": len(checked), "failed": failed,
        "checked_acceptance": checked_acceptance,
        "open_looping": deg["looping"], "open_answers": deg["answers"],
        "looping": [f"{a['id']} (seed {a['seed']})" for a, start in zip(open_answers, deg["cycle_starts"], strict=True)
                    if start is not None],
        "open_repeated_4grams": deg["mean_repeated_ngram_share"],
        "open_repeated_4grams_pooled": deg["repeated_ngram_share"],
        "open_acceptance": open_acceptance,
        "poem": [a["text"] for a in open_answers if a["id"] == "poem-sakura"],
    }


def _number(name: str, field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise argparse.ArgumentTypeError(f"setting {name!r}: {field} must be a number, not {value!r}")


def parse_settings(text: str) -> dict[str, dict]:
    """``--settings``: a JSON object of named settings, each of penalty fields with numbers and DRY's
    fields in ``extra_args`` (checked here, before an engine starts)."""
    settings = json.loads(text)
    if not isinstance(settings, dict) or not settings or not all(isinstance(v, dict) for v in settings.values()):
        raise argparse.ArgumentTypeError('expected {"name": {"presence_penalty": 0.5}, ...}')
    for name, setting in settings.items():
        for field, value in setting.items():
            if field == EXTRAS:
                _extras(name, value)
            elif field not in NEUTRAL:
                raise argparse.ArgumentTypeError(f"setting {name!r}: {field!r} is not one of "
                                                 f"{', '.join([*NEUTRAL, EXTRAS])}")
            else:
                _number(name, field, value)
    return settings


def _extras(name: str, extras) -> None:
    if not isinstance(extras, dict):
        raise argparse.ArgumentTypeError(f"setting {name!r}: {EXTRAS} must be an object, not {extras!r}")
    unknown = [f for f in extras if f not in dry.FIELDS]
    if unknown:
        raise argparse.ArgumentTypeError(f"setting {name!r}: {EXTRAS}.{unknown[0]} is not one of {', '.join(dry.FIELDS)}")
    try:
        dry.parse(extras, prefix=f"{EXTRAS}.")
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"setting {name!r}: {e}") from None


def format_table(rows: list[dict]) -> str:
    """The model card's table: a line per setting, in their order."""
    lines = ["| setting | checked answers right | looping open answers | mean repeated word 4-grams "
             "| mean acceptance length: checked / open-ended |",
             "|---|---|---|---|---|"]
    for r in rows:
        name = f"**{r['setting']}** (the model's default)" if r["model_default"] else r["setting"]
        lines.append(f"| {name} | {r['passed']} / {r['checked']} | {r['open_looping']} / {r['open_answers']} "
                     f"| {r['open_repeated_4grams']:.0%} | {r['checked_acceptance']:.2f} / {r['open_acceptance']:.2f} |")
    return "\n".join(lines)


def register(subparsers) -> None:
    p = subparsers.add_parser("eval-sampling", help="checked answers, loops and acceptance for each sampling "
                              "setting (which sampling defaults to ship)")
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--draft", type=Path, required=True)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--seeds", type=int, default=4, help="seeds of each open-ended request (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=250,
                   help="tokens per answer (default: %(default)s, as the README's request)")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="auto: as the server resolves it (on a CPU: bf16 where native, else fp32)")
    p.add_argument("--draft-penalties", choices=("on", "off"), default="on")
    p.add_argument("--settings", type=parse_settings, default=None,
                   help='settings to compare, as JSON: {"name": {"presence_penalty": 0.5, "extra_args": '
                   '{"dry_multiplier": 0.8}}, ...} (penalty fields a setting leaves out: neutral; default: '
                   + ", ".join(SETTINGS) + ")")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    from ..engine.host import detect_host, resolve_dtype
    from ..logs import setup_logging

    setup_logging()
    dtype = resolve_dtype(args.dtype, detect_host())[0]
    rows = evaluate_sampling(args.target, args.draft, k=args.k, seeds=args.seeds, max_tokens=args.max_tokens,
                             draft_penalties=args.draft_penalties == "on", settings=args.settings or SETTINGS,
                             dtype=dtype)
    print(format_table(rows))
    for r in rows:
        print(f"\n{r['setting']}: failed {', '.join(r['failed']) or 'none'}; looping {', '.join(r['looping']) or 'none'}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0
