"""One learn cycle (``dynamo-spec learn-draft``): the served draft, fine-tuned on the captures.

Stages, each timed into the version's manifest entry:

1. ``captures``: the rows not yet learnt from (``learn-state.json``), of this target only (a
   capture of another target is refused as a ``data/`` round of another target is), without the
   everyday evaluation set's prompts and without repeats (same prompt and answer); the newest
   tenth is held out for the gate and never trained on.
2. ``replay``: a slice of the ``data/`` rounds of the same target (``replay`` x the captured
   training tokens, seeded), so that everyday acceptance holds; none where there is no round.
3. ``states``: the target's hidden states over those rows, by one prefill pass (the corpus
   pipeline's, ``training/hidden_states.py``), in the host's dtype (``training/precision.py``).
4. ``train``: from the served draft (the promoted version in ``drafts/manifest.json``, else
   ``speculative.model``), keeping its vocabulary (``lm_head``, ``d2t``) and config, so the
   new draft loads in its place.
5. ``write``: the new version ``drafts/vNNN/`` (written beside, fsynced, renamed).
6. ``gate`` (``gate.py``): structural checks, then acceptance of both drafts on the held-out
   captures and the everyday set; promoted when it gains ``learning.min_gain`` and loses at most
   ``learning.max_loss``.
7. The manifest entry (parent, captures used, tokens, figures, stage timings, dtype) and, when
   promoted, ``current``: one atomic write; the live swap loads ``current`` (``POST /admin/draft``).
   Rows become learnt once a promoted version was trained on them; a refused cycle's rows are
   learnt again, with the next captures, by the next cycle.

A cycle killed at any point promotes nothing: the manifest is the last thing written. The
cycle's own files (the captures' hidden states, the checkpoint) live in ``work/`` (0700) and are
removed when it ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from ..config.settings import Settings
from . import captures as capture_files
from . import gate

logger = logging.getLogger(__name__)

DRAFTS = "drafts"
MANIFEST = "manifest.json"
STATE = "learn-state.json"
WORK = "work"
REPLAY_STATES = "replay-states"
LOCK = "learn.lock"
GATE_FIGURES = "gate-figures.json"
FORMAT_VERSION = 1
VERSION_RE = re.compile(r"^v(\d{3,})$")
PRIVATE = 0o700
# the gate's figures, also at the top of a version's manifest entry (swap.GATE_KEYS reads them there)
FIGURES = ("promoted", "heldout_al_before", "heldout_al_after", "everyday_al_before", "everyday_al_after", "rows",
           "seconds")

EXIT_PROMOTED, EXIT_ERROR, EXIT_BAD_INPUT, EXIT_REFUSED = 0, 1, 2, 3


class LearnInputError(ValueError):
    """Input a cycle cannot learn from (no captures, another target's, a draft it cannot start
    from): one line, exit 2."""


@dataclass
class LearnOptions:
    """A cycle's knobs besides the ``learning`` settings (``learn-draft``'s options; the defaults live here)."""

    steps: int | None = None  # optimizer steps; None: ``epochs`` passes over the training rows
    epochs: float = 2.0
    lr: float = 5e-4
    replay: float = 1.0  # replayed data/ tokens per captured training token (0: none)
    corpus: Path = Path("data")  # where the data/ rounds are
    heldout_share: float = 0.1
    k: int | None = None  # draft tokens per step when measuring; None: speculative.num_speculative_tokens
    everyday_prompts: int = 68  # of the everyday set (68: all)
    max_tokens: int = 128  # new tokens per measured request at most
    seed: int = 0


# ------------------------------------------------------------------ files


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """All of ``data`` or nothing: a temp file beside ``path``, fsync, rename, fsync of the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _json(obj) -> bytes:
    return (json.dumps(obj, indent=1, default=str) + "\n").encode()


def load_manifest(root: Path) -> dict:
    """``drafts/manifest.json`` under ``learning.dir`` (an empty one when there is none)."""
    path = Path(root) / DRAFTS / MANIFEST
    if not path.exists():
        return {"format": FORMAT_VERSION, "current": None, "versions": []}
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT_VERSION:
        raise LearnInputError(f"{path}: format {manifest.get('format')!r}, this code reads {FORMAT_VERSION}")
    return manifest


def current_version(root: Path) -> dict | None:
    """The promoted version's manifest entry (``version``, ``path``, ``target``, ``figures`` ...), or None."""
    manifest = load_manifest(root)
    return next((v for v in manifest["versions"] if v["version"] == manifest["current"]), None)


def next_version(drafts: Path, manifest: dict) -> str:
    """One past every version named by the manifest or lying in the folder (a killed cycle's too)."""
    numbers = [int(m.group(1)) for v in manifest["versions"] if (m := VERSION_RE.match(v["version"]))]
    if drafts.is_dir():
        numbers += [int(m.group(1)) for p in drafts.iterdir()
                    if (m := VERSION_RE.match(p.name.split(".tmp-")[0].lstrip(".")))]
    return f"v{max(numbers, default=0) + 1:03d}"


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, PRIVATE)
    return path


@contextlib.contextmanager
def cycle_lock(root: Path) -> Iterator[None]:
    """One cycle at a time per ``learning.dir``."""
    Path(root).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(root) / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LearnInputError(f"another learn cycle is running on {root} (it holds {Path(root) / LOCK})") from None
        yield
    finally:
        os.close(fd)


# ------------------------------------------------------------------ captures


def _key(row: dict) -> tuple:
    return tuple(row["prompt_ids"]), tuple(row["answer_ids"])


def learnt_ids(root: Path) -> set[str]:
    path = Path(root) / STATE
    return set(json.loads(path.read_text())["learnt"]) if path.exists() else set()


def new_rows(root: Path, learnt: set[str]) -> tuple[list[dict], dict]:
    """The captures not learnt from yet, oldest first, each prompt and answer once; and counts."""
    seen_ids, seen_keys, rows = set(), set(), []
    counts = {"read": 0, "learnt_before": 0, "repeats": 0}
    for r in capture_files.iter_rows(root):
        counts["read"] += 1
        if r["id"] in learnt:
            counts["learnt_before"] += 1
            seen_keys.add(_key(r))  # a repeat of a learnt row teaches nothing new
            continue
        if r["id"] in seen_ids or _key(r) in seen_keys or not r["answer_ids"]:
            counts["repeats"] += 1
            continue
        seen_ids.add(r["id"])
        seen_keys.add(_key(r))
        rows.append(r)
    rows.sort(key=lambda r: r["time"])  # files are oldest first; replicas' files interleave
    return rows, counts


def check_target(root: Path, checksum: str, target_name: str) -> None:
    theirs = capture_files.target_of(root)
    if theirs is None:
        return
    if theirs.get("checksum") != checksum:
        raise LearnInputError(
            f"the captures in {capture_files.captures_dir(root)} were written by target {theirs.get('name')!r} with "
            f"checksum {theirs.get('checksum')}, but engine.model {target_name!r} has checksum {checksum}; learn with "
            "that target, or erase them (DELETE /admin/learning/captures)")


def split_heldout(rows: list[dict], share: float) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows): the newest ``share`` (at least one) is held out."""
    if len(rows) < 2:
        raise LearnInputError(f"{len(rows)} new capture(s) to learn from: at least 2 are needed (one is held out)")
    n_held = min(len(rows) - 1, max(1, math.ceil(round(len(rows) * share, 6))))
    return rows[:-n_held], rows[-n_held:]


def _tokens(rows: list[dict]) -> dict:
    return {"rows": len(rows), "prompt_tokens": sum(len(r["prompt_ids"]) for r in rows),
            "answer_tokens": sum(len(r["answer_ids"]) for r in rows)}


def _ids_digest(rows: list[dict]) -> str:
    return "sha256:" + hashlib.sha256("\n".join(sorted(r["id"] for r in rows)).encode()).hexdigest()


# ------------------------------------------------------------------ replay


def replay_rows(corpus: Path, checksum: str, eval_filter, budget_tokens: int, seed: int) -> tuple[list[dict], dict]:
    """A seeded slice of the ``corpus`` rounds written by this target, about ``budget_tokens``
    (prompt and answer) in all; rounds of other targets are not used."""
    from ..training.corpus import load_manifest as corpus_manifest
    from ..training.corpus import read_round

    if budget_tokens <= 0:
        return [], {"rows": 0, "why": "replay 0"}
    if not (Path(corpus) / "manifest.json").exists():
        return [], {"rows": 0, "why": f"no corpus at {corpus}"}
    entries = [e for e in corpus_manifest(corpus)["rounds"] if e["target"]["checksum"] == checksum]
    if not entries:
        return [], {"rows": 0, "why": f"no round of this target in {corpus}"}
    pool = [r for e in entries for r in read_round(corpus, e, eval_filter)[0]]
    random.Random(seed).shuffle(pool)
    rows, used = [], 0
    for r in pool:
        if used >= budget_tokens:
            break
        rows.append(r)
        used += len(r["prompt_ids"]) + len(r["answer_ids"])
    return rows, {**_tokens(rows), "rounds": [e["round"] for e in entries], "corpus": str(corpus)}


# ------------------------------------------------------------------ the cycle


def served_draft(settings: Settings, root: Path, checksum: str) -> tuple[Path, str | None]:
    """(directory, version) of the draft being served: the promoted version of this target, else
    ``speculative.model``."""
    current = current_version(root)
    if current is not None and current["target"]["checksum"] == checksum and Path(current["path"]).is_dir():
        return Path(current["path"]), current["version"]
    model = settings.speculative.model
    if not settings.speculative.enabled or not model or settings.speculative.method != "eagle3":
        raise LearnInputError("speculative: a learn cycle fine-tunes the served EAGLE-3 draft; set speculative.method "
                              "eagle3 and speculative.model")
    if not (Path(model) / "model.safetensors").is_file():
        raise LearnInputError(f"speculative.model: {model} is not a local draft directory with model.safetensors "
                              "(download it and point the setting at the folder)")
    return Path(model), None


class _Stages:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        logger.info("learn-draft: %s ...", name)
        t0 = time.monotonic()
        yield
        self.seconds[name] = round(time.monotonic() - t0, 1)
        logger.info("learn-draft: %s done in %.1f s", name, self.seconds[name])


def _remove_leftovers(root: Path) -> None:
    """What a killed cycle left (its work folder, a half-written version); under the cycle lock
    no other cycle is running. A version folder it renamed stays: no manifest entry names it,
    and the next version is numbered past it."""
    for leftover in [*(root / WORK).glob("cycle-*"), *(root / DRAFTS).glob(".v*.tmp-*")]:
        logger.info("learn-draft: removing %s, left by a cycle that did not finish", leftover)
        shutil.rmtree(leftover, ignore_errors=True)


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fsync_dir(path)


def _states(target: Path, rows: list[dict], out: Path, aux: tuple[int, ...], dtype: str):
    from ..training.hidden_states import extract_hidden_states, load_shards
    from ..training.rows import write_jsonl

    if not rows:
        return [], None
    if not (out / "rows.jsonl").exists():
        write_jsonl(out / "rows.jsonl", rows)
    done = extract_hidden_states(target, out / "rows.jsonl", out / "hidden", aux, dtype=dtype)
    return load_shards(out / "hidden"), done


def run_cycle(settings: Settings, options: LearnOptions | None = None) -> dict:
    """One learn cycle; returns its result (the JSON line of ``learn-draft``). Raises
    :class:`LearnInputError` on input it cannot learn from."""
    from transformers import AutoTokenizer

    from ..config.eagle3_format import aux_ids_of
    from ..training.corpus import EvalFilter, target_checksum
    from ..training.precision import training_dtype
    from ..training.train import TrainConfig, pack_rows, train

    options = options or LearnOptions()
    t_start = time.monotonic()
    stage = _Stages()
    root = Path(settings.learning.dir)
    target = Path(settings.engine.model)
    if not (target / "config.json").is_file():
        raise LearnInputError(f"engine.model: {target} is not a local model directory (the cycle runs its prefill)")

    with cycle_lock(root):
        with stage("captures"):
            checksum = target_checksum(target)
            check_target(root, checksum, target.name)
            parent, parent_version = served_draft(settings, root, checksum)
            rows, counts = new_rows(root, learnt_ids(root))
            if not rows:
                raise LearnInputError(f"no captures to learn from in {capture_files.captures_dir(root)} "
                                      f"({counts['read']} read, {counts['learnt_before']} learnt before); turn "
                                      "learning.capture on and serve some traffic")
            eval_filter = EvalFilter(AutoTokenizer.from_pretrained(target))
            rows, eval_dropped = eval_filter.split(rows)
            counts["eval_set"] = eval_dropped
            train_rows, heldout_rows = split_heldout(rows, options.heldout_share)
            logger.info("learn-draft: %d new captures (%d training, %d held out; %d repeats, %d of the everyday set "
                        "left out)", len(rows), len(train_rows), len(heldout_rows), counts["repeats"], eval_dropped)

        with stage("replay"):
            budget = int(options.replay * sum(len(r["prompt_ids"]) + len(r["answer_ids"]) for r in train_rows))
            replay, replay_info = replay_rows(options.corpus, checksum, eval_filter, budget, options.seed)
            logger.info("learn-draft: replay %s", {k: v for k, v in replay_info.items() if k != "corpus"})

        dtype, dtype_why = training_dtype("auto")
        parent_cfg = json.loads((parent / "config.json").read_text())
        aux = tuple(aux_ids_of(parent_cfg)) or tuple(settings.speculative.aux_hidden_state_layer_ids or ())
        if len(aux) != 3:
            raise LearnInputError(f"{parent}: its config.json names no aux layer ids (eagle_aux_hidden_state_layer_ids)")
        drafts = root / DRAFTS
        drafts.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(root)
        work = _private_dir(root / WORK / f"cycle-{os.getpid()}")
        try:
            with stage("states"):
                seqs, captured = _states(target, train_rows, work / "captures", aux, dtype)
                replay_key = hashlib.sha256(json.dumps([r["id"] for r in replay]).encode()).hexdigest()[:16]
                replay_dir = (root / REPLAY_STATES / checksum.split(":")[1][:16]
                              / f"{'-'.join(map(str, aux))}-{dtype}-{replay_key}")
                for stale in replay_dir.parent.glob("*"):  # another cycle's slice: not read again
                    if stale != replay_dir:
                        shutil.rmtree(stale, ignore_errors=True)
                replay_seqs, replayed = _states(target, replay, replay_dir, aux, dtype)
            seqs += replay_seqs

            with stage("train"):
                if options.steps:
                    steps = options.steps
                else:
                    packed = len(pack_rows(seqs, list(range(len(seqs))), TrainConfig.row_tokens))
                    steps = max(1, math.ceil(options.epochs * packed))
                tcfg = TrainConfig(seed=options.seed, steps=steps, lr=options.lr, warmup=min(10, max(1, steps // 10)),
                                   val_sequences=0, init_from=parent, keep_vocab=True, dtype=dtype)
                eos = json.loads((target / "config.json").read_text())["eos_token_id"]
                manifest = load_manifest(root)
                version = next_version(drafts, manifest)
                tmp = drafts / f".{version}.tmp-{os.getpid()}"
                shutil.rmtree(tmp, ignore_errors=True)
                summary = train(target, seqs, tmp, work / "checkpoint.pt", tcfg,
                                eos if isinstance(eos, int) else eos[0])

            with stage("write"):
                _fsync_tree(tmp)
                out = drafts / version
                os.rename(tmp, out)
                fsync_dir(drafts)

            with stage("gate"):
                figures_before = figures_after = None
                cached = False
                problems = gate.structural_problems(settings, out, parent)
                k = options.k or settings.speculative.num_speculative_tokens
                if problems:
                    verdict = gate.Verdict(False, "structural checks: " + "; ".join(problems), problems=problems)
                else:
                    max_len = settings.engine.max_model_len or 2048
                    heldout = gate.heldout_set(heldout_rows, options.max_tokens, max_len)
                    everyday = gate.everyday_set(target, options.everyday_prompts, options.max_tokens)
                    logger.info("learn-draft: measuring the served draft, then %s (k=%d, %d held-out and %d everyday "
                                "requests, greedy)", version, k, len(heldout.prompts), len(everyday.prompts))
                    figures_before, figures_after, cached = gate.measure_both(settings, parent, out, k, heldout,
                                                                              everyday, root / GATE_FIGURES)
                    verdict = gate.decide(figures_before, figures_after, settings.learning.min_gain,
                                          settings.learning.max_loss)
                logger.info("learn-draft: %s %s: %s", version, "promoted" if verdict.promoted else "not promoted",
                            verdict.reason)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            with contextlib.suppress(OSError):
                (root / WORK).rmdir()

        seconds = round(time.monotonic() - t_start, 1)
        entry = {
            "version": version,
            "path": str(out.resolve()),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "target": {"name": target.name, "checksum": checksum},
            "parent": {"path": str(parent.resolve()), "version": parent_version},
            "captures": {**_tokens(train_rows), "heldout_rows": len(heldout_rows), "ids_sha256": _ids_digest(train_rows),
                         "first_time": train_rows[0]["time"], "last_time": heldout_rows[-1]["time"],
                         "left_out": counts},
            "replay": replay_info,
            "tokens": {"trained": summary["train_tokens"], "states": sum(s.tokens for s in (captured, replayed) if s),
                       "states_tokens_per_s": _rate(captured, replayed)},
            "training": {"steps": summary["steps"], "lr": options.lr, "train_sequences": summary["train_sequences"],
                         "seconds": summary["train_seconds"]},
            "dtype": {"training": dtype, "why": dtype_why, "serving": gate.serving_dtype(settings)},
            "gate": {"promoted": verdict.promoted, "reason": verdict.reason, "k": k, "sampling": "greedy",
                     "min_gain": settings.learning.min_gain, "max_loss": settings.learning.max_loss,
                     "before": asdict(figures_before) if figures_before else None, "before_from_cache": cached,
                     "after": asdict(figures_after) if figures_after else None},
            "timings_s": stage.seconds,
            "seconds": seconds,
            "options": {k2: str(v) if isinstance(v, Path) else v for k2, v in asdict(options).items()},
        }
        result = {
            "path": entry["path"], "version": version, "parent": entry["parent"]["path"], "promoted": verdict.promoted,
            "reason": verdict.reason,
            "heldout_al_before": _round(figures_before and figures_before.heldout),
            "heldout_al_after": _round(figures_after and figures_after.heldout),
            "everyday_al_before": _round(figures_before and figures_before.everyday),
            "everyday_al_after": _round(figures_after and figures_after.everyday),
            "rows": len(train_rows), "heldout_rows": len(heldout_rows), "replay_rows": replay_info["rows"],
            "tokens": summary["train_tokens"], "steps": summary["steps"], "dtype": dtype, "k": k,
            "timings_s": stage.seconds, "seconds": seconds,
        }
        entry.update({key: result[key] for key in FIGURES})  # what GET /admin/draft shows of the served version
        manifest = load_manifest(root)
        manifest["versions"].append(entry)
        if verdict.promoted:
            manifest["current"] = version
        write_atomic(drafts / MANIFEST, _json(manifest))
        if verdict.promoted:
            present = {r["id"] for r in capture_files.iter_rows(root)}
            learnt = (learnt_ids(root) & present) | {r["id"] for r in train_rows}
            write_atomic(root / STATE, _json({"learnt": sorted(learnt)}), mode=0o600)

    return result


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _rate(*passes) -> float | None:
    done = [p for p in passes if p and p.seconds > 0]
    seconds = sum(p.seconds for p in done)
    return round(sum(p.tokens for p in done) / seconds) if seconds else None
