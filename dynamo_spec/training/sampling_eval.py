"""``dynamo-spec eval-sampling``: which sampling defaults keep answers right, loop rarely and draft well.

For each penalty setting (the penalty fields a request would get by default), one engine with
the draft:

- the checked requests (``checked.py``, greedy): how many answers pass their check, and the
  mean acceptance length;
- open-ended requests (the README's poem and everyday ones), each at several seeds at the
  model's default temperature and top_p: the share of word 4-grams repeated and the answers
  that loop (``degeneration``), and the mean acceptance length.

Offline (vLLM's engine in this process's children, the server's engine settings); the speed
a default gives through the server is the bench's job.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .checked import load_checked, passes
from .degeneration import degeneration

NEUTRAL = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
SETTINGS = {
    "no penalty": {},
    "repetition 1.05": {"repetition_penalty": 1.05},
    "repetition 1.1": {"repetition_penalty": 1.1},
    "frequency 0.2": {"frequency_penalty": 0.2},
    "frequency 0.5": {"frequency_penalty": 0.5},
    "presence 0.3": {"presence_penalty": 0.3},
}
OPEN_ENDED = [
    "Write a poem about why Sakura trees are beautiful.",
    "Tell me a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Describe your ideal weekend.",
]


def words(text: str) -> list[str]:
    return text.lower().split()


def _chat_ids(tok, prompt: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)


def evaluate_sampling(target: Path, draft: Path, *, k: int = 3, settings: dict[str, dict] = SETTINGS,
                      seeds: int = 4, max_tokens: int = 200, draft_penalties: bool = True) -> list[dict]:
    """One row per setting: checked pass rate, loops on the open-ended requests, acceptance."""
    from transformers import AutoTokenizer
    from vllm.inputs import TokensPrompt

    from .evaluate import acceptance
    from .offline_llm import offline_llm, request_params

    tok = AutoTokenizer.from_pretrained(target)
    checked = load_checked()
    checked_ids = [TokensPrompt(prompt_token_ids=_chat_ids(tok, r["messages"][0]["content"])) for r in checked]
    open_ids = [TokensPrompt(prompt_token_ids=_chat_ids(tok, p)) for p in OPEN_ENDED]
    rows = []
    with offline_llm(target, draft=draft, k=k, max_num_seqs=64, per_request_spec_decode_metrics="summary",
                     draft_penalties=draft_penalties) as llm:
        for name, penalty in settings.items():
            fields = penalty_fields(penalty)
            greedy = [request_params(llm, temperature=0.0, max_tokens=max_tokens, **fields)] * len(checked_ids)
            outs = llm.generate(checked_ids, greedy, use_tqdm=False)
            sampled = [request_params(llm, max_tokens=max_tokens, seed=s, **fields)
                       for s in range(seeds) for _ in OPEN_ENDED]
            open_outs = llm.generate(open_ids * seeds, sampled, use_tqdm=False)
            rows.append(setting_row(name, penalty, checked, [o.outputs[0].text for o in outs],
                                    [o.outputs[0].text for o in open_outs],
                                    checked_acceptance=acceptance(outs, k)["mean_acceptance_length"],
                                    open_acceptance=acceptance(open_outs, k)["mean_acceptance_length"]))
    return rows


def penalty_fields(penalty: dict) -> dict:
    """The penalty fields of a setting's requests: its own, and neutral ones for the rest (not the model's
    defaults), so that settings differ by their own fields only."""
    return {**NEUTRAL, **penalty}


def setting_row(name: str, penalty: dict, checked: list[dict], answers: list[str], open_answers: list[str], *,
                checked_acceptance: float, open_acceptance: float) -> dict:
    """A setting's row: the checked answers that pass (and the ids of those that fail), and the loops and
    repeated word 4-grams of the open-ended answers (the first is the poem)."""
    failed = [r["id"] for r, a in zip(checked, answers, strict=True) if not passes(a, r["check"])]
    # word 4-grams (the README's measure), by a stable id per word
    vocab: dict[str, int] = {}
    deg = degeneration([[vocab.setdefault(w, len(vocab)) for w in words(a)] for a in open_answers])
    return {
        "setting": name, "fields": penalty, "passed": len(checked) - len(failed), "checked": len(checked),
        "failed": failed, "checked_acceptance": checked_acceptance,
        "open_repeated_4grams": deg["repeated_ngram_share"], "open_looping": deg["looping"],
        "open_answers": deg["answers"], "open_acceptance": open_acceptance, "poem": open_answers[0],
    }


def parse_settings(text: str) -> dict[str, dict]:
    """``--settings``: a JSON object of named settings, each of penalty fields with numbers (checked here,
    before an engine starts)."""
    settings = json.loads(text)
    if not isinstance(settings, dict) or not all(isinstance(v, dict) for v in settings.values()):
        raise argparse.ArgumentTypeError('expected {"name": {"presence_penalty": 0.5}, ...}')
    for name, penalty in settings.items():
        for field, value in penalty.items():
            if field not in NEUTRAL:
                raise argparse.ArgumentTypeError(f"setting {name!r}: {field!r} is not one of {', '.join(NEUTRAL)}")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise argparse.ArgumentTypeError(f"setting {name!r}: {field} must be a number, not {value!r}")
    return settings


def format_table(rows: list[dict]) -> str:
    lines = ["| setting | checked answers right | looping answers (open-ended) | repeated word 4-grams "
             "| mean acceptance length, checked | mean acceptance length, open-ended |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['passed']} / {r['checked']} | {r['open_looping']} / {r['open_answers']} "
                     f"| {r['open_repeated_4grams']:.0%} | {r['checked_acceptance']:.2f} | {r['open_acceptance']:.2f} |")
    return "\n".join(lines)


def register(subparsers) -> None:
    p = subparsers.add_parser("eval-sampling", help="checked answers, loops and acceptance for each penalty "
                              "setting (which sampling defaults to ship)")
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--draft", type=Path, required=True)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--seeds", type=int, default=4, help="seeds of each open-ended request (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--draft-penalties", choices=("on", "off"), default="on")
    p.add_argument("--settings", type=parse_settings, default=None,
                   help='penalty settings to compare, as JSON: {"name": {"presence_penalty": 0.5}, ...} '
                   "(default: none, repetition 1.05 and 1.1, frequency 0.2 and 0.5, presence 0.3)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    from ..logs import setup_logging

    setup_logging()
    rows = evaluate_sampling(args.target, args.draft, k=args.k, seeds=args.seeds, max_tokens=args.max_tokens,
                             draft_penalties=args.draft_penalties == "on", settings=args.settings or SETTINGS)
    print(format_table(rows))
    for r in rows:
        print(f"\n{r['setting']}: failed {', '.join(r['failed']) or 'none'}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0
