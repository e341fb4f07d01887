"""The training corpus kept in the repository: the target's answers, round by round.

Answers cost hours of CPU to generate, hidden states are cheap to recompute from them
(one prefill pass) and too big to keep. So a round keeps only token ids: one gzipped
JSON-lines file per round, ``rounds/round-NNN.jsonl.gz``, one row per answer::

    {"id", "source", "round", "temperature", "prompt_ids", "answer_ids"}

and ``manifest.json`` says, per round, where the rows came from (sources and
licences), how they were generated, which target wrote them (:func:`target_checksum`),
their token counts, and what the evaluation filter dropped. Rows whose prompt contains a
user turn of the evaluation set (``rows.EVERYDAY_EVAL``) are dropped when a round is
written and again whenever it is read. A round written by another target than the one
being trained is refused.

The hidden states of a round are recomputed by :func:`corpus_states` and cached under
``.cache/`` by target checksum and round, never committed.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from .rows import EVERYDAY_EVAL, eval_texts, read_jsonl, write_jsonl

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
ROW_KEYS = ("id", "source", "round", "temperature", "prompt_ids", "answer_ids")


class CorpusError(ValueError):
    """A corpus that cannot be used as asked (another target's round, a damaged file)."""


# ------------------------------------------------------------------ target identity


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


SAMPLING_FIELDS = ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def sampling_defaults(target: Path) -> dict:
    """The sampling fields the target's ``generation_config.json`` sets besides the
    temperature (what a round generated at the shipped defaults was sampled with)."""
    path = Path(target) / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    return {k: config[k] for k in SAMPLING_FIELDS if k in config}


# config.json fields that name the writer, not the model: another transformers version
# writes the same target with another value.
WRITER_CONFIG_KEYS = ("transformers_version", "_commit_hash", "_name_or_path")


def _config_digest(path: Path) -> str:
    config = {k: v for k, v in json.loads(path.read_text()).items() if k not in WRITER_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _tensor_digests(path: Path) -> dict[str, str] | None:
    """``name -> sha256`` over each tensor's dtype, shape and bytes in a safetensors file,
    or None when the file is not one."""
    import torch
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            digests = {}
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                t = f.get_tensor(name)
                h = hashlib.sha256(f"{t.dtype}\0{list(t.shape)}\n".encode())
                h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
                digests[name] = h.hexdigest()
            return digests
    except SafetensorError:
        return None


def target_checksum(target: Path) -> str:
    """``sha256:<hex>`` over what the target computes with: its ``config.json`` without
    the writer's fields (:data:`WRITER_CONFIG_KEYS`), and its tensors by name (dtype,
    shape, bytes) however the safetensors files split and order them; other weight files
    (``*.bin``) by their bytes. The same for any copy of the model, wherever it lies and
    whichever transformers version wrote it."""
    target = Path(target)
    weights = sorted({p for pattern in ("*.safetensors", "*.bin") for p in target.glob(pattern)})
    if not weights or not (target / "config.json").is_file():
        raise FileNotFoundError(f"{target}: a target needs config.json and weight files (*.safetensors or *.bin)")
    h = hashlib.sha256()
    h.update(f"config.json\0{_config_digest(target / 'config.json')}\n".encode())
    tensors: dict[str, str] = {}
    for path in weights:
        found = _tensor_digests(path) if path.suffix == ".safetensors" else None
        if found is None:
            h.update(f"{path.name}\0{_file_sha256(path)}\n".encode())
        else:
            tensors.update(found)
    for name in sorted(tensors):
        h.update(f"tensor {name}\0{tensors[name]}\n".encode())
    return "sha256:" + h.hexdigest()


# ------------------------------------------------------------------ evaluation filter


def normal_text(text: str) -> str:
    """Whitespace runs as one space, case folded: how prompts are compared with the evaluation set."""
    return " ".join(text.split()).casefold()


class EvalFilter:
    """Drops rows whose prompt contains a user turn of the evaluation set (compared on
    the decoded prompt, case and whitespace ignored), whatever turn of the prompt it is."""

    RULE = "the decoded prompt contains a user turn of the evaluation set (case and whitespace ignored)"

    def __init__(self, tokenizer, path: Path = EVERYDAY_EVAL):
        self.tokenizer = tokenizer
        self.path = Path(path)
        self.texts = sorted({normal_text(t) for t in eval_texts(self.path) if t.strip()})

    def matches(self, prompts: list[list[int]]) -> list[bool]:
        decoded = self.tokenizer.batch_decode(prompts, skip_special_tokens=False)
        return [any(t in normal_text(d) for t in self.texts) for d in decoded]

    def split(self, rows: list[dict]) -> tuple[list[dict], int]:
        """The rows that pass, and how many were dropped."""
        hit = self.matches([r["prompt_ids"] for r in rows]) if rows else []
        return [r for r, h in zip(rows, hit) if not h], sum(hit)

    def describe(self, dropped: int) -> dict:
        return {"eval_set": self.path.name, "eval_set_sha256": _file_sha256(self.path), "eval_prompts": len(self.texts),
                "rule": self.RULE, "dropped": dropped}


# ------------------------------------------------------------------ files


def _write_atomic(path: Path, data: bytes) -> None:
    """Write all of ``data`` or nothing: a temp file beside ``path``, then a rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rows_bytes(rows: Iterable[dict]) -> bytes:
    """Gzipped JSON lines, byte-for-byte reproducible (no name or time in the header)."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        for r in rows:
            gz.write((json.dumps({k: r[k] for k in ROW_KEYS}, separators=(",", ":")) + "\n").encode())
    return buf.getvalue()


def load_manifest(root: Path) -> dict:
    path = Path(root) / MANIFEST
    if not path.exists():
        return {"format": FORMAT_VERSION, "rounds": []}
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT_VERSION:
        raise CorpusError(f"{path}: format {manifest.get('format')!r}, this code reads format {FORMAT_VERSION}")
    return manifest


def write_manifest(root: Path, manifest: dict) -> None:
    _write_atomic(Path(root) / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())


def _read_round_file(root: Path, entry: dict) -> list[dict]:
    path = Path(root) / entry["file"]
    if not path.exists():
        raise CorpusError(f"round {entry['round']}: {path} is missing")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CorpusError(f"round {entry['round']}: {path} does not match the sha256 in {MANIFEST}")
    return [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line]


# ------------------------------------------------------------------ writing a round


def source_licences() -> dict[str, dict]:
    """Every prompt source's package and licence, by source name."""
    from .data import source_table
    from .self_prompts import SOURCE

    table = {s["name"]: s for s in source_table()}
    table[SOURCE] = {"name": SOURCE, "package": "the target itself", "licence": "the target's"}
    return table


def work_rows(work: Path) -> list[dict]:
    """The answers of a ``train-draft`` work dir as corpus rows (round not set yet); each
    answer's sampling temperature comes from the prompt rows (0.0: greedy)."""
    temperature = {}
    for name in ("prompts.jsonl", "self_prompts.jsonl", "second_turn_prompts.jsonl"):
        if (work / name).exists():
            temperature.update({r["id"]: float(r.get("temperature") or 0.0) for r in read_jsonl(work / name)})
    rows = []
    for r in read_jsonl(work / "answers.jsonl"):
        if r["id"] not in temperature:
            raise CorpusError(f"{work}: answer {r['id']!r} has no prompt row (its temperature is unknown)")
        rows.append({"id": r["id"], "source": r["source"], "round": None, "temperature": temperature[r["id"]],
                     "prompt_ids": r["prompt_ids"], "answer_ids": r["answer_ids"]})
    return rows


def _counts(rows: list[dict]) -> dict:
    return {"rows": len(rows), "prompt_tokens": sum(len(r["prompt_ids"]) for r in rows),
            "answer_tokens": sum(len(r["answer_ids"]) for r in rows)}


def _key(row: dict) -> tuple:
    return tuple(row["prompt_ids"]), tuple(row["answer_ids"])


def add_round(root: Path, rows: list[dict], target: Path, generator: dict) -> dict | None:
    """Append ``rows`` (prompt/answer ids, temperature, source) as the next round of the
    corpus at ``root``; returns its manifest entry, or None when no row was new.

    Dropped first: rows matching the evaluation set, rows already in a round of the
    same target or twice in ``rows`` (same prompt and answer). ``generator`` (generator,
    dtype, max_new_tokens, seed) goes into the manifest with the rows' temperatures.
    The round file is written before the manifest names it, each atomically."""
    from transformers import AutoTokenizer

    root = Path(root)
    licences = source_licences()
    unknown = sorted({r["source"] for r in rows} - set(licences))
    if unknown:
        raise CorpusError(f"sources without a known licence: {', '.join(unknown)} (see data.SOURCES)")
    checksum = target_checksum(target)
    manifest = load_manifest(root)
    eval_filter = EvalFilter(AutoTokenizer.from_pretrained(target))
    kept, dropped = eval_filter.split(rows)
    seen = {_key(r) for e in manifest["rounds"] if e["target"]["checksum"] == checksum
            for r in _read_round_file(root, e)}
    new = []
    for r in kept:
        if _key(r) not in seen:
            seen.add(_key(r))
            new.append(r)
    if not new:
        logger.info("corpus %s: no new rows (%d given, %d matched the evaluation set)", root, len(rows), dropped)
        return None
    number = max((e["round"] for e in manifest["rounds"]), default=0) + 1
    new = [{**r, "round": number} for r in new]
    data = _rows_bytes(new)
    file = f"rounds/round-{number:03d}.jsonl.gz"
    _write_atomic(root / file, data)
    groups = []
    for name in sorted({r["source"] for r in new}):
        part = [r for r in new if r["source"] == name]
        groups.append({"source": name, "package": licences[name]["package"], "licence": licences[name]["licence"],
                       "temperatures": sorted({r["temperature"] for r in part}), **_counts(part)})
    entry = {
        "round": number,
        "file": file,
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "target": {"name": Path(target).resolve().name, "checksum": checksum},
        "generator": {**generator, "temperatures": sorted({r["temperature"] for r in new})},
        "tokens": _counts(new),
        "groups": groups,
        "eval_filter": eval_filter.describe(dropped),
        "duplicates_dropped": len(kept) - len(new),
    }
    manifest["rounds"].append(entry)
    write_manifest(root, manifest)
    logger.info("corpus %s: round %d, %d rows (%d answer tokens, %d bytes); %d dropped by the evaluation filter, "
                "%d duplicates", root, number, len(new), entry["tokens"]["answer_tokens"], len(data), dropped,
                entry["duplicates_dropped"])
    return entry


# ------------------------------------------------------------------ reading


def select_rounds(root: Path, checksum: str, rounds: Iterable[int] | None = None) -> list[dict]:
    """The manifest entries of ``rounds`` (default: all), each checked to be the work
    of the target with ``checksum``."""
    manifest = load_manifest(root)
    by_number = {e["round"]: e for e in manifest["rounds"]}
    wanted = sorted(by_number) if not rounds else sorted(set(rounds))
    missing = [n for n in wanted if n not in by_number]
    if missing:
        raise CorpusError(f"{Path(root) / MANIFEST}: no round {', '.join(map(str, missing))} "
                          f"(it has {', '.join(map(str, sorted(by_number))) or 'none'})")
    for n in wanted:
        theirs = by_number[n]["target"]
        if theirs["checksum"] != checksum:
            raise CorpusError(f"round {n} of {Path(root) / MANIFEST} was generated by target {theirs['name']!r} with "
                              f"checksum {theirs['checksum']}, but the target being trained has checksum {checksum}; "
                              "leave the round out (--rounds) or train that target")
    return [by_number[n] for n in wanted]


def read_round(root: Path, entry: dict, eval_filter: EvalFilter) -> tuple[list[dict], int]:
    """A round's rows without those matching the evaluation set, and how many those were."""
    return eval_filter.split(_read_round_file(root, entry))


def read_corpus(root: Path, target: Path, rounds: Iterable[int] | None = None) -> list[dict]:
    """Every row of the chosen rounds (default: all) in round order, evaluation-set
    prompts left out; a round of another target is refused (:class:`CorpusError`)."""
    from transformers import AutoTokenizer

    entries = select_rounds(root, target_checksum(target), rounds)
    eval_filter = EvalFilter(AutoTokenizer.from_pretrained(target))
    rows = []
    for e in entries:
        kept, dropped = read_round(root, e, eval_filter)
        if dropped:
            logger.warning("round %d: %d rows match the evaluation set and are left out", e["round"], dropped)
        rows += kept
    return rows


# ------------------------------------------------------------------ hidden states


def corpus_states(root: Path, target: Path, *, aux_layers: tuple[int, ...], dtype: str,
                  cache_root: Path, rounds: Iterable[int] | None = None) -> tuple[list[dict], dict]:
    """The training sequences of the chosen rounds, their hidden states recomputed by one
    prefill pass of the target (:func:`.hidden_states.extract_hidden_states`) and cached
    under ``cache_root/<target checksum>/round-NNN/<aux layers, dtype, rows>/``, so a
    re-run loads them. Returns the sequences (as :func:`.hidden_states.load_shards`) and
    what was read and computed, tokens/s of the prefill pass included."""
    from transformers import AutoTokenizer

    from .hidden_states import extract_hidden_states, load_shards

    checksum = target_checksum(target)
    entries = select_rounds(root, checksum, rounds)
    eval_filter = EvalFilter(AutoTokenizer.from_pretrained(target))
    seqs, info = [], {"rounds": [], "rows": 0, "eval_rows_dropped": 0, "states_tokens": 0, "states_seconds": 0.0}
    sources: dict[str, dict] = {}
    for e in entries:
        rows, dropped = read_round(root, e, eval_filter)
        body = "".join(json.dumps({k: r[k] for k in ROW_KEYS}) + "\n" for r in rows)
        key = "{}-{}-{}".format("-".join(map(str, aux_layers)), dtype, hashlib.sha256(body.encode()).hexdigest()[:12])
        round_dir = Path(cache_root) / checksum.split(":")[1][:16] / f"round-{e['round']:03d}"
        out = round_dir / key
        if not (out / "rows.jsonl").exists():
            write_jsonl(out / "rows.jsonl", rows)
        done = extract_hidden_states(target, out / "rows.jsonl", out / "hidden", tuple(aux_layers), dtype=dtype)
        for stale in round_dir.glob("*"):  # states of an earlier version of this round's rows
            if stale != out and stale.name.startswith(key.rsplit("-", 1)[0] + "-"):
                logger.info("removing stale cached states %s", stale)
                shutil.rmtree(stale, ignore_errors=True)
        seqs += load_shards(out / "hidden")
        info["rounds"].append(e["round"])
        info["rows"] += len(rows)
        info["eval_rows_dropped"] += dropped
        info["states_tokens"] += done.tokens
        info["states_seconds"] += done.seconds
        for g in e["groups"]:
            sources.setdefault(g["source"], {"name": g["source"], "package": g["package"], "licence": g["licence"]})
    seconds = info["states_seconds"]
    info["states_seconds"] = round(seconds, 2)
    info["states_tokens_per_s"] = round(info["states_tokens"] / seconds) if seconds > 0 else None
    info["sources"] = [sources[k] for k in sorted(sources)]
    return seqs, info
