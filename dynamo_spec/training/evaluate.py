"""``eval-draft``: acceptance and speed of an EAGLE-3 draft on held-out prompts.

Acceptance (one engine per k; greedy, or sampled at each of ``temperatures`` with a seed
per prompt): mean acceptance length (1 + accepted / drafts,
counting the bonus token, as vLLM defines it), acceptance rate (accepted / drafted)
and per-position acceptance (drafts whose first i + 1 tokens were accepted / drafts),
from vLLM's per-request speculative metrics summed over the prompts.
Speed: tokens/s at batch 1 (prompts one after another) and batch 8 (one batch), with
and without speculation, median of ``runs``; the two engines run back to back.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

from .answers import chat_prompt_ids
from .offline_llm import offline_llm
from .rows import interleave_sources, read_jsonl

logger = logging.getLogger(__name__)


def held_out_prompts(target: Path, prompts_path: Path, n: int) -> tuple[list[str], list]:
    """The first ``n`` prompts of the eval split, interleaving sources so any prefix is
    a mix: their sources, and their token ids with the target's chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    mixed = interleave_sources(read_jsonl(prompts_path, split="eval"))[:n]
    return [r["source"] for r in mixed], [chat_prompt_ids(tok, r["messages"]) for r in mixed]


def acceptance(outputs, k: int) -> dict:
    hist = [0] * (k + 1)
    drafted = 0
    for out in outputs:
        m = out.outputs[0].spec_decode_metrics
        if m is None:
            continue
        d = m.to_dict()
        hist = [a + b for a, b in zip(hist, d["acceptance_histogram"])]
        drafted += d["num_draft_tokens"]
    steps = sum(hist)
    accepted = sum(j * c for j, c in enumerate(hist))
    per_pos = [sum(hist[i + 1:]) / steps if steps else 0.0 for i in range(k)]
    return {"k": k, "mean_acceptance_length": 1 + accepted / steps if steps else 1.0,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "per_position": per_pos, "drafts": steps, "histogram": hist}


def _generate(llm, prompt_ids, max_tokens, temperature: float = 0.0):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # Sampled runs are seeded per prompt, so a draft and its successor see the same draws.
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens,
                             seed=i if temperature > 0 else None) for i in range(len(prompt_ids))]
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params,
                        use_tqdm=False)


def speed(llm, prompt_ids, max_tokens: int, runs: int) -> dict:
    """Median tokens/s at batch 1 and at batch len(prompt_ids)."""
    _generate(llm, prompt_ids[:1], 16)  # warm-up
    b1, b8 = [], []
    for _ in range(runs):
        t0, n = time.monotonic(), 0
        for p in prompt_ids:
            n += len(_generate(llm, [p], max_tokens)[0].outputs[0].token_ids)
        b1.append(n / (time.monotonic() - t0))
        t0 = time.monotonic()
        outs = _generate(llm, prompt_ids, max_tokens)
        b8.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.monotonic() - t0))
    return {"batch1_tok_s": statistics.median(b1), "batch8_tok_s": statistics.median(b8),
            "batch1_runs": b1, "batch8_runs": b8}


def evaluate_draft(target: Path, draft: Path, prompts_path: Path, *, n: int = 100,
                   ks=(1, 2, 3, 4, 5), speed_k: int = 3, speed_prompts: int = 8,
                   speed_runs: int = 3, max_tokens: int = 128,
                   speed_max_tokens: int = 64, temperatures=(0.0,)) -> dict:
    """Acceptance for each k in ``ks`` and each of ``temperatures`` (all ``n`` prompts in
    one batch), then, when ``speed_runs`` > 0, tokens/s (greedy) without speculation and
    with k = ``speed_k``."""
    sources, prompts = held_out_prompts(target, prompts_path, n)
    result: dict = {"n_prompts": len(prompts), "max_tokens": max_tokens, "acceptance": []}
    for k in ks:
        with offline_llm(target, draft=draft, k=k, max_num_seqs=max(len(prompts), 8),
                         per_request_spec_decode_metrics="summary") as llm:
            for temperature in temperatures:
                t0 = time.monotonic()
                outputs = _generate(llm, prompts, max_tokens, temperature)
                acc = {"temperature": temperature, **acceptance(outputs, k)}
                acc["per_source"] = {}
                for src in sorted(set(sources)):
                    part = acceptance([o for o, s in zip(outputs, sources) if s == src], k)
                    acc["per_source"][src] = {"n": sources.count(src), **{
                        key: part[key] for key in ("mean_acceptance_length", "per_position")}}
                acc["seconds"] = round(time.monotonic() - t0, 1)
                result["acceptance"].append(acc)
                logger.info("k=%d T=%g: %s", k, temperature, acc)
    if speed_runs:
        fast = prompts[:speed_prompts]
        result["speed_max_tokens"] = speed_max_tokens
        with offline_llm(target, max_num_seqs=max(speed_prompts, 8)) as llm:
            result["speed_no_spec"] = speed(llm, fast, speed_max_tokens, speed_runs)
        with offline_llm(target, draft=draft, k=speed_k, max_num_seqs=max(speed_prompts, 8)) as llm:
            result["speed_spec"] = {"k": speed_k,
                                    **speed(llm, fast, speed_max_tokens, speed_runs)}
    return result


def format_report(result: dict) -> str:
    lines = [(f"held-out prompts: {result['n_prompts']}, max_tokens {result['max_tokens']} "
              "(temperature 0: greedy; above 0: sampled, seeded per prompt)"), "",
             "| k | temperature | mean acceptance length | acceptance rate | per position |",
             "|---|---|---|---|---|"]
    for a in result["acceptance"]:
        pos = " / ".join(f"{p:.2f}" for p in a["per_position"])
        lines.append(f"| {a['k']} | {a.get('temperature', 0.0):g} | "
                     f"{a['mean_acceptance_length']:.2f} | {a['acceptance_rate']:.2f} | {pos} |")
    cols = [f"k={a['k']} T={a.get('temperature', 0.0):g}" for a in result["acceptance"]]
    if cols:
        lines += ["", "mean acceptance length per source:", "",
                  "| source | prompts | " + " | ".join(cols) + " |",
                  "|---|---|" + "---|" * len(cols)]
        for src, first in result["acceptance"][0]["per_source"].items():
            lens = [a["per_source"][src]["mean_acceptance_length"] for a in result["acceptance"]]
            lines.append(f"| {src} | {first['n']} | " + " | ".join(f"{x:.2f}" for x in lens)
                         + " |")
    if "speed_spec" in result:
        base, spec = result["speed_no_spec"], result["speed_spec"]
        lines += ["", (f"tokens/s, median of {len(base['batch1_runs'])} runs, "
                       f"{result['speed_max_tokens']} new tokens per prompt:"), "",
                  f"| tokens/s | no speculation | EAGLE-3 k={spec['k']} | speed-up |",
                  "|---|---|---|---|"]
        for key, label in (("batch1_tok_s", "batch 1"), ("batch8_tok_s", "batch 8")):
            lines.append(f"| {label} | {base[key]:.1f} | {spec[key]:.1f} | "
                         f"{spec[key] / base[key]:.2f}x |")
    return "\n".join(lines)
