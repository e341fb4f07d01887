"""``dynamo-spec verify``: is speculative decoding lossless for this target + draft?

Greedy-decodes the same prompts twice, without and with speculation (two engines, one
after the other, each fully shut down), and compares the tokens. At the first
differing token it reports the log-prob margin of the reference run between the
token it chose and the one the speculative run chose: in bf16, verifying several
tokens in one pass rounds differently from one-token steps, so a near-tie (margin
below ``--tie-nats``) is numerical noise, while a clear margin is a real bug.
Exit status: 0 when no real difference, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from ..logs import setup_logging
from .rows import interleave_sources

logger = logging.getLogger(__name__)


@dataclass
class Difference:
    prompt: int
    position: int  # index into the generated tokens
    reference_token: int
    speculative_token: int
    margin: float  # reference logprob(chosen) - logprob(speculative's token), >= 0

    def near_tie(self, tie_nats: float) -> bool:
        return self.margin <= tie_nats


def load_prompts(path: Path, n: int) -> list[list[dict]]:
    """Chat message lists from a prompt file: JSON lines with ``messages`` (the eval
    split, sources interleaved, when rows carry one) or ``prompt``, or plain text, one
    user message a line."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        return [[{"role": "user", "content": line}] for line in lines[:n]]
    rows = [json.loads(line) for line in lines]
    if any("split" in r for r in rows):
        rows = interleave_sources([r for r in rows if r.get("split") == "eval"])
    return [r.get("messages") or [{"role": "user", "content": r["prompt"]}] for r in rows][:n]


def _run(target: Path, prompt_ids, max_tokens: int, dtype: str, draft: Path | None, k: int):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from .offline_llm import offline_llm

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=5)
    with offline_llm(target, draft=draft, k=k, dtype=dtype,
                     max_num_seqs=max(8, len(prompt_ids))) as llm:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params,
                            use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def _margin(logprobs_at, chosen: int, other: int) -> float:
    """logprob(chosen) - logprob(other) at one position; if ``other`` is outside the
    returned top log-probs, the gap to the lowest one returned (a lower bound)."""
    lp = {tok: entry.logprob for tok, entry in logprobs_at.items()}
    floor = min(lp.values())
    return lp.get(chosen, max(lp.values())) - lp.get(other, floor)


def compare(reference, speculative) -> list[Difference]:
    diffs = []
    for i, ((ref_toks, ref_lps), (spec_toks, _)) in enumerate(zip(reference, speculative)):
        for pos, (a, b) in enumerate(zip(ref_toks, spec_toks)):
            if a != b:
                diffs.append(Difference(i, pos, a, b, _margin(ref_lps[pos], a, b)))
                break
        else:
            if len(ref_toks) != len(spec_toks):
                pos = min(len(ref_toks), len(spec_toks))
                diffs.append(Difference(i, pos, -1, -1, float("inf")))
    return diffs


def verify(target: Path, draft: Path, k: int, prompts: list[list[dict]], *,
           max_tokens: int = 128, dtype: str = "bfloat16") -> list[Difference]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    ids = [list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)) for m in prompts]
    reference = _run(target, ids, max_tokens, dtype, None, k)
    speculative = _run(target, ids, max_tokens, dtype, draft, k)
    return compare(reference, speculative)


def _cmd(args: argparse.Namespace) -> int:
    setup_logging()
    prompts = load_prompts(args.prompts, args.n)
    diffs = verify(args.target, args.draft, args.k, prompts, max_tokens=args.max_tokens,
                   dtype=args.dtype)
    real = [d for d in diffs if not d.near_tie(args.tie_nats)]
    for d in diffs:
        kind = "near-tie" if d.near_tie(args.tie_nats) else "REAL DIFFERENCE"
        print(f"prompt {d.prompt}: first difference at generated token {d.position}: "
              f"reference {d.reference_token} vs speculative {d.speculative_token}, "
              f"margin {d.margin:.3f} nats ({kind})")
    print(f"verify: {len(prompts)} prompts, k={args.k}, {args.dtype}: "
          f"{len(prompts) - len(diffs)} identical, {len(diffs) - len(real)} near-ties "
          f"(<= {args.tie_nats} nats), {len(real)} real differences")
    return 1 if real else 0


def register(subparsers) -> None:
    p = subparsers.add_parser("verify", help="check that speculation does not change "
                              "greedy output", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True, help="target model directory")
    p.add_argument("--draft", type=Path, required=True, help="EAGLE-3 draft directory")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--prompts", type=Path, required=True,
                   help="JSON lines (messages or prompt; the eval split if marked) or text")
    p.add_argument("--n", type=int, default=50, help="number of prompts")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--tie-nats", type=float, default=0.25,
                   help="a first difference within this log-prob margin is a near-tie")
    p.set_defaults(func=_cmd)
