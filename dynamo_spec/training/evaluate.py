"""``eval-draft``: acceptance and speed of an EAGLE-3 draft on held-out prompts, and how
much the answers loop.

Acceptance (one engine per k; for each sampling setting: a temperature, 0 for greedy, or
``default``, a request that sets no sampling field; each request takes the model's
defaults from ``generation_config.json`` for the fields it leaves out, as vLLM's server
does, and is seeded by its prompt's index): mean acceptance length (1 + accepted /
drafts, counting the bonus token, as vLLM defines it), acceptance rate (accepted /
drafted) and per-position acceptance (drafts whose first i + 1 tokens were accepted /
drafts), from vLLM's per-request speculative metrics summed over the prompts. Beside
each: the answers' degeneration (``degeneration``: repeated 4-gram share, looping
answers) and the acceptance on the answers that do not loop, since a loop is easy to
predict and inflates acceptance.
Calibration (``calibration=True``): the draft's own confidence in each token it proposed
against what the target accepted, per k and sampling setting (:mod:`.calibration`).
Speed: tokens/s at batch 1 (prompts one after another) and batch 8 (one batch), with
and without speculation, median of ``runs``; the two engines run back to back.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import statistics
import tempfile
import time
from pathlib import Path

from .answers import chat_prompt_ids
from .calibration import calibration as calibrate
from .calibration import count_lines, format_calibration, read_log
from .degeneration import degeneration
from .offline_llm import offline_llm, request_params
from .rows import interleave_sources, read_jsonl

logger = logging.getLogger(__name__)

DEFAULT = "default"  # the sampling setting of a request that sets no sampling field


def held_out_prompts(target: Path, prompts_path: Path, n: int) -> tuple[list[str], list]:
    """The first ``n`` prompts of the eval split, interleaving sources so any prefix is
    a mix: their sources, and their token ids with the target's chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    mixed = interleave_sources(read_jsonl(prompts_path, split="eval"))[:n]
    return [r["source"] for r in mixed], [chat_prompt_ids(tok, r["messages"]) for r in mixed]


def acceptance(outputs, k: int) -> dict:
    """Pooled over ``outputs``; the histogram as long as vLLM's (its k: longer than ``k`` with the
    suffix mix, whose tree drafts up to ``speculative.suffix.max_tokens``)."""
    hist = [0] * (k + 1)
    drafted = 0
    for out in outputs:
        m = out.outputs[0].spec_decode_metrics
        if m is None:
            continue
        d = m.to_dict()
        theirs = d["acceptance_histogram"]
        hist += [0] * (len(theirs) - len(hist))
        hist = [a + b for a, b in zip(hist, theirs + [0] * (len(hist) - len(theirs)))]
        drafted += d["num_draft_tokens"]
    steps = sum(hist)
    accepted = sum(j * c for j, c in enumerate(hist))
    per_pos = [sum(hist[i + 1:]) / steps if steps else 0.0 for i in range(k)]
    return {"k": k, "mean_acceptance_length": 1 + accepted / steps if steps else 1.0,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "per_position": per_pos, "drafts": steps, "histogram": hist}


def answer_ids(output) -> list[int]:
    """The answer's token ids without the end-of-sequence token that stopped it."""
    comp = output.outputs[0]
    ids = list(comp.token_ids)
    return ids[:-1] if comp.finish_reason == "stop" and ids else ids


def _generate(llm, prompt_ids, max_tokens, temperature: float | str = 0.0):
    from vllm.inputs import TokensPrompt

    # Seeded per prompt, so a draft and its successor see the same draws.
    params = [request_params(llm, temperature=None if temperature == DEFAULT else temperature,
                             max_tokens=max_tokens, seed=i) for i in range(len(prompt_ids))]
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params,
                        use_tqdm=False)


def _measure(outputs, sources, k: int) -> dict:
    """Acceptance and degeneration of one setting's outputs, overall and per source."""
    answers = [answer_ids(o) for o in outputs]
    deg = degeneration(answers)
    clean = [o for o, s in zip(outputs, deg["cycle_starts"]) if s is None]
    acc = {**acceptance(outputs, k), "degeneration": deg,
           "not_looping": {"n": len(clean), **{
               key: value for key, value in acceptance(clean, k).items()
               if key in ("mean_acceptance_length", "acceptance_rate")}},
           "mean_answer_tokens": sum(map(len, answers)) / len(answers) if answers else 0.0,
           "per_source": {}}
    for src in sorted(set(sources)):
        mine = [i for i, s in enumerate(sources) if s == src]
        part = acceptance([outputs[i] for i in mine], k)
        acc["per_source"][src] = {
            "n": len(mine), "mean_acceptance_length": part["mean_acceptance_length"],
            "per_position": part["per_position"],
            "repeated_ngram_share": degeneration([answers[i] for i in mine])["repeated_ngram_share"]}
    return acc


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
                   speed_max_tokens: int = 64, temperatures=(DEFAULT, 0.0),
                   generation_config: str = "auto", calibration: bool = False,
                   draft_penalties: tuple[bool, ...] = (True,), suffix: tuple[bool, ...] = (False,)) -> dict:
    """Acceptance and degeneration for each k in ``ks`` and each of ``temperatures``
    (:data:`DEFAULT` or a temperature; all ``n`` prompts in one batch), then, when
    ``speed_runs`` > 0, tokens/s (temperature 0) without speculation and with k =
    ``speed_k``. ``generation_config``: ``auto`` applies the model's sampling defaults,
    ``vllm`` drops them (vLLM's engine option). ``calibration``: also record the draft's
    confidences and tabulate them against acceptance. ``draft_penalties``: the draft drafts under the
    request's penalties (True), as vLLM drafts (False), or each (one engine each). ``suffix``: with
    the suffix-tree mix (``speculative.suffix`` at its defaults; the trees learn from the batch's
    answers as they finish), without, or each (one engine each)."""
    sources, prompts = held_out_prompts(target, prompts_path, n)
    result: dict = {"n_prompts": len(prompts), "max_tokens": max_tokens, "acceptance": [],
                    "generation_config": generation_config}
    for k, penalized, mix in itertools.product(ks, draft_penalties, suffix):
        with _confidence_log(calibration) as log, \
                offline_llm(target, draft=draft, k=k, max_num_seqs=max(len(prompts), 8),
                            per_request_spec_decode_metrics="summary", draft_penalties=penalized,
                            confidence_log=log, generation_config=generation_config,
                            suffix={"enabled": True} if mix else None) as llm:
            result["model_defaults"] = llm.model_config.get_diff_sampling_param()
            for temperature in temperatures:
                t0 = time.monotonic()
                start = count_lines(log) if log else 0
                outputs = _generate(llm, prompts, max_tokens, temperature)
                acc = {"temperature": temperature, "draft_penalties": penalized, "suffix": mix,
                       **_measure(outputs, sources, k)}
                if log:
                    acc["calibration"] = calibrate(read_log(log, start))
                acc["seconds"] = round(time.monotonic() - t0, 1)
                result["acceptance"].append(acc)
                logger.info("k=%d %s, draft-side penalties %s, suffix mix %s: %s", k, _label(temperature),
                            "on" if penalized else "off", "on" if mix else "off",
                            {key: value for key, value in acc.items() if key != "calibration"})
    if speed_runs:
        fast = prompts[:speed_prompts]
        result["speed_max_tokens"] = speed_max_tokens
        with offline_llm(target, max_num_seqs=max(speed_prompts, 8),
                         generation_config=generation_config) as llm:
            result["speed_no_spec"] = speed(llm, fast, speed_max_tokens, speed_runs)
        with offline_llm(target, draft=draft, k=speed_k, max_num_seqs=max(speed_prompts, 8),
                         generation_config=generation_config) as llm:
            result["speed_spec"] = {"k": speed_k,
                                    **speed(llm, fast, speed_max_tokens, speed_runs)}
    return result


@contextlib.contextmanager
def _confidence_log(enabled: bool):
    """A fresh confidence log for the engine started inside (``offline_llm(confidence_log=...)``),
    or None."""
    if not enabled:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="dynamo-spec-calibration-") as tmp:
        yield Path(tmp) / "confidence.jsonl"


def _label(temperature) -> str:
    return DEFAULT if temperature == DEFAULT else f"{temperature:g}"


def _on_off(acceptance: dict) -> str:
    """The draft-side penalties of one acceptance row (rows written before the option: on)."""
    return "on" if acceptance.get("draft_penalties", True) else "off"


def _mix(acceptance: dict) -> str:
    """The suffix mix of one acceptance row (rows written before the option: off)."""
    return "on" if acceptance.get("suffix") else "off"


def format_report(result: dict) -> str:
    defaults = result.get("model_defaults") or {}
    shown = ", ".join(f"{k} {v:g}" for k, v in defaults.items()) or "none"
    lines = [(f"held-out prompts: {result['n_prompts']}, max_tokens {result['max_tokens']}; "
              f"sampling: 'default' sets no field, a number sets the temperature (0: greedy), "
              f"seeded per prompt; the fields left out take the model's defaults: {shown}"), "",
             "| k | sampling | draft-side penalties | suffix mix | mean acceptance length | acceptance rate "
             "| per position | repeated 4-grams | looping answers | mean acceptance length, answers not looping |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for a in result["acceptance"]:
        pos = " / ".join(f"{p:.2f}" for p in a["per_position"])
        deg, clean = a["degeneration"], a["not_looping"]
        lines.append(f"| {a['k']} | {_label(a['temperature'])} | {_on_off(a)} | {_mix(a)} | "
                     f"{a['mean_acceptance_length']:.2f} | {a['acceptance_rate']:.2f} | {pos} | "
                     f"{deg['repeated_ngram_share']:.1%} | {deg['looping']} / {deg['answers']} | "
                     + (f"{clean['mean_acceptance_length']:.2f} ({clean['n']}) |" if clean["n"]
                        else "- (0) |"))
    cols = [f"k={a['k']} {_label(a['temperature'])} ({_on_off(a)}{', suffix mix' if a.get('suffix') else ''})"
            for a in result["acceptance"]]
    if cols:
        lines += ["", "mean acceptance length (repeated 4-grams) per source:", "",
                  "| source | prompts | " + " | ".join(cols) + " |",
                  "|---|---|" + "---|" * len(cols)]
        for src, first in result["acceptance"][0]["per_source"].items():
            cells = [a["per_source"][src] for a in result["acceptance"]]
            lines.append(f"| {src} | {first['n']} | " + " | ".join(
                f"{c['mean_acceptance_length']:.2f} ({c['repeated_ngram_share']:.0%})"
                for c in cells) + " |")
    for a in result["acceptance"]:
        if "calibration" in a:
            lines += [""] + format_calibration(a["calibration"], f", k={a['k']} {_label(a['temperature'])}")
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
