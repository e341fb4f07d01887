"""How well a draft's own confidence predicts what the target accepts (``eval-draft --calibration``).

The engine records, for every verified draft, the draft's probability of each token it
proposed (its top-1 softmax probability at that position) and how many of them the target
accepted (``draft_confidence`` and ``draft_admission``'s confidence log). Two questions:

- **per token**: given that the tokens before it were accepted, is the token at position i
  accepted? Predicted by its confidence c_i. Positions after the first rejection were not
  judged and are left out.
- **survival**: are the first i + 1 tokens all accepted? Predicted by the running product
  c_0 ... c_i, the figure a draft budget ranks draft slots by.

Each is binned into deciles of the prediction (equal counts) and summarised by the Brier
score, the expected calibration error (the count-weighted mean of |predicted - observed| over
the bins) and, to say how well it ranks, the AUC (the chance that an accepted token was given
a higher prediction than a rejected one).
"""

from __future__ import annotations

import json
from pathlib import Path


def read_log(path: Path, start: int = 0) -> list[dict]:
    """The records of a confidence log from line ``start`` on."""
    with open(path) as f:
        return [json.loads(line) for i, line in enumerate(f) if i >= start and line.strip()]


def count_lines(path: Path) -> int:
    if not path.exists():
        return 0
    with open(path) as f:
        return sum(1 for _ in f)


def pairs(records: list[dict]) -> dict[str, list[tuple[float, bool, int]]]:
    """(prediction, outcome, position) for the per-token and the survival question."""
    token, survival = [], []
    for r in records:
        product = 1.0
        for i, c in enumerate(r["confidence"]):
            product *= c
            accepted = i < r["accepted"]
            survival.append((product, accepted, i))
            if i <= r["accepted"]:
                token.append((c, accepted, i))
    return {"token": token, "survival": survival}


def _auc(rows: list[tuple[float, bool, int]]) -> float | None:
    """Mann-Whitney AUC with ties counted half."""
    ranked = sorted(rows, key=lambda r: r[0])
    positives = sum(1 for r in ranked if r[1])
    negatives = len(ranked) - positives
    if not positives or not negatives:
        return None
    rank_sum, i = 0.0, 0
    while i < len(ranked):
        j = i
        while j < len(ranked) and ranked[j][0] == ranked[i][0]:
            j += 1
        mid_rank = (i + 1 + j) / 2  # 1-based average rank of the tie group
        rank_sum += mid_rank * sum(1 for r in ranked[i:j] if r[1])
        i = j
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def table(rows: list[tuple[float, bool, int]], bins: int = 10) -> dict:
    """Deciles of the prediction: range, count, mean prediction, observed share; and the scores."""
    ranked = sorted(rows, key=lambda r: r[0])
    n = len(ranked)
    deciles = []
    for b in range(bins):
        part = ranked[b * n // bins:(b + 1) * n // bins]
        if not part:
            continue
        deciles.append({"low": part[0][0], "high": part[-1][0], "n": len(part),
                        "predicted": sum(r[0] for r in part) / len(part),
                        "observed": sum(r[1] for r in part) / len(part)})
    positions = sorted({r[2] for r in rows})
    by_position = [{"position": p, "n": len(mine), "predicted": sum(r[0] for r in mine) / len(mine),
                    "observed": sum(r[1] for r in mine) / len(mine)}
                   for p in positions for mine in [[r for r in rows if r[2] == p]]]
    return {"n": n,
            "brier": sum((r[0] - r[1]) ** 2 for r in rows) / n if n else None,
            "ece": sum(d["n"] * abs(d["predicted"] - d["observed"]) for d in deciles) / n if n else None,
            "auc": _auc(rows),
            "deciles": deciles, "by_position": by_position}


def calibration(records: list[dict], bins: int = 10) -> dict:
    return {"drafts": len(records), **{kind: table(rows, bins) for kind, rows in pairs(records).items()}}


LABELS = {"token": "per token: accepted given the tokens before it were (its confidence)",
          "survival": "survival: the first i + 1 tokens all accepted (the running product)"}


def format_calibration(result: dict, title: str = "") -> list[str]:
    lines = [f"draft confidence against acceptance{title}: {result['drafts']} verified drafts"]
    for kind in ("token", "survival"):
        t = result[kind]
        if not t["n"]:
            continue
        scores = f"Brier {t['brier']:.3f}, calibration error {t['ece']:.3f}" + (
            f", AUC {t['auc']:.3f}" if t["auc"] is not None else "")
        lines += ["", f"{LABELS[kind]}; {t['n']} tokens, {scores}", "",
                  "| decile | prediction range | tokens | mean prediction | accepted |", "|---|---|---|---|---|"]
        lines += [f"| {i + 1} | {d['low']:.3f}-{d['high']:.3f} | {d['n']} | {d['predicted']:.3f} | "
                  f"{d['observed']:.3f} |" for i, d in enumerate(t["deciles"])]
        lines += ["", "| position | tokens | mean prediction | accepted |", "|---|---|---|---|"]
        lines += [f"| {p['position'] + 1} | {p['n']} | {p['predicted']:.3f} | {p['observed']:.3f} |"
                  for p in t["by_position"]]
    return lines
