"""The gate of a learn cycle: a new draft version is promoted only when it is better.

Better means: its mean acceptance length on the held-out captures (the newest tenth of the
cycle's captures, never trained on) beats the served draft's by at least ``learning.min_gain``,
and on the everyday evaluation set (``training/everyday_eval.jsonl``) it loses at most
``learning.max_loss``. Both drafts are measured on one engine (the config's target, the dtype
serving resolves on this host, the same k, no schedule): the served draft first, then the new
version loaded in its place by the live swap's worker method (``swap.py``); greedy requests,
seeded by their index, sampled as a request that sets only its temperature (the model's
defaults for the fields it leaves out). The served draft's figures on the same sets are kept
(``learning.dir/gate-figures.json``), so a cycle re-run with other training options measures
only its new version.

Before anything is loaded, the new version passes preflight's structural checks (the same as
``dynamo-spec check``: the draft against the target, its aux layers, its vocabulary maps) and
has the served draft's config.json and tensor shapes, so a running engine can load it in its
place (``POST /admin/draft``). A version that fails them is refused without being measured.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..config.eagle3_format import UNTRAINED_KEY
from ..config.settings import Settings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Figures:
    """Mean acceptance lengths of one draft (1 + accepted / drafts) on the two sets."""

    heldout: float
    everyday: float
    heldout_drafts: int = 0
    everyday_drafts: int = 0


@dataclass(frozen=True)
class Verdict:
    promoted: bool
    reason: str
    gain: float | None = None  # held-out acceptance length, after - before
    loss: float | None = None  # everyday acceptance length, before - after
    problems: list[str] = field(default_factory=list)


def decide(before: Figures, after: Figures, min_gain: float, max_loss: float) -> Verdict:
    """Promote when the held-out gain is at least ``min_gain`` and the everyday loss at most
    ``max_loss`` (figures compared as measured, to 1e-9)."""
    gain, loss = after.heldout - before.heldout, before.everyday - after.everyday
    eps = 1e-9
    if gain < min_gain - eps:
        return Verdict(False, f"held-out acceptance length {before.heldout:.3f} -> {after.heldout:.3f}: "
                              f"{gain:+.3f}, below learning.min_gain {min_gain:g}", gain, loss)
    if loss > max_loss + eps:
        return Verdict(False, f"everyday acceptance length {before.everyday:.3f} -> {after.everyday:.3f}: "
                              f"{-loss:+.3f}, a loss above learning.max_loss {max_loss:g}", gain, loss)
    return Verdict(True, f"held-out {gain:+.3f} (learning.min_gain {min_gain:g}), everyday {-loss:+.3f} "
                         f"(learning.max_loss {max_loss:g})", gain, loss)


# ------------------------------------------------------------------ structural checks


def _with_draft(settings: Settings, draft: Path) -> Settings:
    spec = settings.speculative.model_copy(update={"model": str(draft)})
    return settings.model_copy(update={"speculative": spec})


def _tensor_layout(draft: Path) -> dict[str, tuple[str, list[int]]]:
    from safetensors import safe_open

    with safe_open(str(Path(draft) / "model.safetensors"), "pt") as f:
        return {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118


def structural_problems(settings: Settings, version: Path, served: Path) -> list[str]:
    """What stops ``version`` from replacing ``served`` in a running engine, before any load:
    preflight's errors that the served draft does not have, and any difference from the served
    draft's config.json (besides the untrained marker) and tensor names, dtypes and shapes."""
    from ..config.preflight import run_preflight

    def errors(draft: Path) -> set[str]:
        return {p.message.replace(str(draft), "DRAFT") for p in run_preflight(_with_draft(settings, draft))
                if p.level == "error"}

    problems = sorted(m.replace("DRAFT", str(version)) for m in errors(version) - errors(served))
    if problems:
        return problems
    config = {k: v for k, v in json.loads((version / "config.json").read_text()).items() if k != UNTRAINED_KEY}
    theirs = {k: v for k, v in json.loads((served / "config.json").read_text()).items() if k != UNTRAINED_KEY}
    if config != theirs:
        changed = sorted(k for k in config.keys() | theirs.keys() if config.get(k) != theirs.get(k))
        problems.append(f"{version}: config.json differs from the served draft's ({', '.join(changed)})")
    mine, served_layout = _tensor_layout(version), _tensor_layout(served)
    if mine != served_layout:
        changed = sorted(k for k in mine.keys() | served_layout.keys() if mine.get(k) != served_layout.get(k))
        problems.append(f"{version}: tensors differ from the served draft's in name, dtype or shape ({', '.join(changed)})")
    return problems


# ------------------------------------------------------------------ measuring


@dataclass(frozen=True)
class EvalSet:
    """Prompts (token ids) and how many new tokens each may take."""

    prompts: list[list[int]]
    max_tokens: list[int]


def heldout_set(rows: list[dict], max_tokens: int, max_model_len: int) -> EvalSet:
    """The held-out captures as greedy requests: each prompt, for as many tokens as its answer
    had (at most ``max_tokens``); prompts that leave no room within ``max_model_len`` are left out."""
    prompts, budgets = [], []
    for r in rows:
        room = max_model_len - len(r["prompt_ids"]) - 1
        n = min(max(len(r["answer_ids"]), 1), max_tokens, room)
        if n >= 1:
            prompts.append(list(r["prompt_ids"]))
            budgets.append(n)
    return EvalSet(prompts, budgets)


def everyday_set(target: Path, n: int, max_tokens: int) -> EvalSet:
    from ..training.evaluate import held_out_prompts
    from ..training.rows import EVERYDAY_EVAL

    _, prompts = held_out_prompts(target, EVERYDAY_EVAL, n)
    return EvalSet(prompts, [max_tokens] * len(prompts))


def serving_dtype(settings: Settings) -> str:
    """The dtype the config's engine runs in on this host (``engine.dtype``, ``auto`` resolved as serving does)."""
    from ..engine.host import detect_host, resolve_dtype

    return resolve_dtype(settings.engine.dtype, detect_host())[0]


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else json.dumps(part, sort_keys=True, default=str).encode())
        h.update(b"\0")
    return h.hexdigest()


def measurement_key(settings: Settings, draft: Path, k: int, heldout: EvalSet, everyday: EvalSet) -> str:
    """What a measurement depends on: the draft's files, the sets, k and the engine settings used."""
    draft = Path(draft)
    engine = settings.engine
    return _digest((draft / "config.json").read_bytes(), (draft / "model.safetensors").read_bytes(), k,
                   [heldout.prompts, heldout.max_tokens, everyday.prompts, everyday.max_tokens],
                   [str(Path(engine.model).resolve()), serving_dtype(settings), engine.max_model_len,
                    settings.speculative.draft_penalties])


def measure_both(settings: Settings, served: Path, version: Path, k: int, heldout: EvalSet, everyday: EvalSet,
                 cache: Path) -> tuple[Figures, Figures, bool]:
    """Figures of the served draft and of the new version, on one engine: started with the served
    draft, measured, the version loaded in its place (the live swap's worker method,
    ``swap.WORKER_METHOD``), measured. The served draft's figures on the same sets with the same
    settings are taken from ``cache`` when an earlier cycle measured them (a cycle re-run with
    other training options measures only its version); the third value says so."""
    from .swap import WORKER_METHOD

    key = measurement_key(settings, served, k, heldout, everyday)
    known = json.loads(cache.read_text()) if cache.exists() else {}
    if key in known:
        logger.info("figures of the served draft %s on these sets: from %s", served, cache)
        with _engine(settings, version, k, heldout, everyday) as llm:
            return Figures(**known[key]), _measure(llm, k, heldout, everyday), True
    with _engine(settings, served, k, heldout, everyday) as llm:
        before = _measure(llm, k, heldout, everyday)
        _remember(cache, key, before)
        loaded = llm.collective_rpc(WORKER_METHOD, args=(str(version),))
        refused = [r.get("problem") for r in loaded if not r.get("ok")]
        if not refused:
            return before, _measure(llm, k, heldout, everyday), False
    logger.warning("the engine did not load %s in place (%s): measuring it on an engine of its own", version,
                   "; ".join(map(str, refused)))
    with _engine(settings, version, k, heldout, everyday) as llm:
        return before, _measure(llm, k, heldout, everyday), False


def _remember(cache: Path, key: str, figures: Figures) -> None:
    known = json.loads(cache.read_text()) if cache.exists() else {}
    known[key] = asdict(figures)
    tmp = cache.with_name(f".{cache.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(dict(list(known.items())[-CACHE_ENTRIES:]), indent=1) + "\n")
    os.replace(tmp, cache)


CACHE_ENTRIES = 16


@contextlib.contextmanager
def _engine(settings: Settings, draft: Path, k: int, heldout: EvalSet, everyday: EvalSet):
    """An offline engine of the config's target with ``draft`` at k, in the dtype serving resolves here."""
    from ..training.offline_llm import offline_llm

    engine = settings.engine
    n = len(heldout.prompts) + len(everyday.prompts)
    with offline_llm(Path(engine.model), draft=draft, k=k, dtype=serving_dtype(settings),
                     kv_cache_bytes=int(engine.kv_cache_memory_bytes or 512 * 2**20),
                     max_num_seqs=max(8, min(n, 256)), max_model_len=engine.max_model_len or 2048,
                     per_request_spec_decode_metrics="summary",
                     draft_penalties=settings.speculative.draft_penalties) as llm:
        yield llm


def _measure(llm, k: int, heldout: EvalSet, everyday: EvalSet) -> Figures:
    """Both sets in one batch of greedy requests, seeded by index."""
    from vllm.inputs import TokensPrompt

    from ..training.evaluate import acceptance
    from ..training.offline_llm import request_params

    prompts = heldout.prompts + everyday.prompts
    budgets = heldout.max_tokens + everyday.max_tokens
    params = [request_params(llm, temperature=0.0, max_tokens=m, seed=i) for i, m in enumerate(budgets)]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    held, every = outputs[:len(heldout.prompts)], outputs[len(heldout.prompts):]
    a, b = acceptance(held, k), acceptance(every, k)
    return Figures(a["mean_acceptance_length"], b["mean_acceptance_length"], a["drafts"], b["drafts"])
