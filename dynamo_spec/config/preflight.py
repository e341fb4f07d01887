"""Preflight: catch a wrong target/draft pairing in seconds, before a slow load.

Each check reads config.json files (and safetensors headers, which are small)
and reports problems as one line each: what is wrong and how to fix it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

from dynamo_spec.config import eagle3_format, schedule
from dynamo_spec.config.problems import Problem
from dynamo_spec.config.settings import Settings
from dynamo_spec.engine.host import on_cpu as host_on_cpu

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
EAGLE3_ARCHS = {"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "PEagleDraftModel", "PeagleLlamaForCausalLM"}


class Tensor(NamedTuple):
    shape: list[int]
    nbytes: int


@dataclass
class Checkpoint:
    """What preflight knows about a model reference."""

    ref: str
    config: dict[str, Any]
    directory: Path | None  # None for a hub id
    snapshot: Path | None = None  # a hub id: its folder in the local Hugging Face cache (where config.json is)

    @cached_property
    def tensors(self) -> dict[str, Tensor]:
        """Every tensor of the safetensors files, from their headers only (never the weights):
        a directory's files; for a hub id the cached ones, else the Hub's headers."""
        if self.directory is not None:
            return _read_headers(sorted(self.directory.glob("*.safetensors")))
        return _hub_tensors(self.ref, self.snapshot)

    def safetensors_shapes(self) -> dict[str, list[int]]:
        return {name: tensor.shape for name, tensor in self.tensors.items()}

    def weight_bytes(self) -> int | None:
        """What the weights take: dtype x shape of each tensor (so a cache holding only the
        headers gives the true size), else the size of the .bin files."""
        if self.tensors:
            return sum(tensor.nbytes for tensor in self.tensors.values()) or None
        return self._bin_bytes

    @cached_property
    def _bin_bytes(self) -> int | None:
        if self.directory is not None:
            return _file_bytes(self.directory.glob("*.bin"))
        return _hub_bin_bytes(self.ref, self.snapshot)


def run_preflight(settings: Settings, *, on_cpu: bool | None = None) -> list[Problem]:
    problems: list[Problem] = []
    if on_cpu is None:
        on_cpu = host_on_cpu()
    target = _load(settings.engine.model, "engine.model", problems)
    spec = settings.speculative
    draft = None
    if spec.enabled and spec.model:
        draft = _load(spec.model, "speculative.model", problems)
    if target is not None:
        problems += _check_target(target, on_cpu)
    if draft is not None:
        draft_problems, draft = check_draft(target, draft, spec.method, spec.aux_hidden_state_layer_ids, on_cpu)
        problems += draft_problems
    if spec.enabled and spec.num_speculative_tokens_per_batch_size is not None:
        max_num_seqs = effective_max_num_seqs(settings, on_cpu)
        where = "engine.max_num_seqs" if settings.engine.max_num_seqs else "vLLM's default max_num_seqs here"
        value = spec.num_speculative_tokens_per_batch_size
        for field, entry in schedule.entries(value):
            problems += [Problem("error", line)
                         for line in schedule.problems(entry, spec.num_speculative_tokens, max_num_seqs, where, field)]
    problems += check_features_on_path(settings, on_cpu)
    problems += check_patches(settings, on_cpu)
    if not on_cpu:
        problems += check_driver(*_cuda_versions())
    problems += check_parallel(settings, on_cpu, None if on_cpu else _gpu_count())
    problems += check_tp_split(settings, target, draft)
    problems += _check_memory(settings, target, draft, on_cpu)
    return problems


def load_checkpoint(ref: str, field: str, problems: list[Problem]) -> Checkpoint | None:
    """A checkpoint's config.json and safetensors headers (local folder or the hub's cache), or None
    with a problem naming `field`."""
    return _load(ref, field, problems)


def check_draft(target: Checkpoint | None, draft: Checkpoint, method: str, aux_layer_ids: list[int] | None,
                on_cpu: bool) -> tuple[list[Problem], Checkpoint]:
    """A draft against its method and target, from config.json and the safetensors headers only:
    the speculators format's type and verifier, the method, then (EAGLE and EAGLE-3) hidden size,
    vocabulary, ``d2t``, head size and aux layer ids. Preflight and the live swap
    (``learning/swap.py``) both call it. Returns the problems and the draft in vLLM's view."""
    problems: list[Problem] = []
    if eagle3_format.is_speculators(draft.config):
        problems += _check_speculators(draft, target, method)
        draft = dataclasses.replace(draft, config=eagle3_format.vllm_view(draft.config))
    if method in ("eagle", "eagle3"):
        method_problems = _check_method(draft, method)
        problems += method_problems
        if target is not None:
            # With the wrong method, the EAGLE-3 layer checks would only repeat the same mistake.
            eagle3 = method == "eagle3" and not method_problems
            problems += _check_pairing(target, draft, eagle3, aux_layer_ids, on_cpu)
    return problems, draft


VOCAB_PADDING = 64  # vLLM pads a vocabulary to a multiple of this before splitting it over ranks


def check_tp_split(settings: Settings, target: Checkpoint | None, draft: Checkpoint | None) -> list[Problem]:
    """vLLM splits attention heads and the (padded) vocabulary over the tensor-parallel ranks:
    both must divide evenly, for the target and for the draft. vLLM 0.32 split the draft over
    the target's ranks even with speculative.draft_tensor_parallel_size: 1 (tried on CPU: the
    CPU default at TP 3 failed on the draft's vocabulary either way), so the draft is checked
    against engine.tensor_parallel_size."""
    tp = settings.engine.tensor_parallel_size
    if tp == 1:
        return []
    problems: list[Problem] = []
    for checkpoint in (target, draft if settings.speculative.enabled else None):
        if checkpoint is None:
            continue
        cfg = _text_config(checkpoint.config)
        heads = cfg.get("num_attention_heads")
        vocab = cfg.get("draft_vocab_size") or cfg.get("vocab_size")
        padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING if vocab else None
        for what, n in (("attention heads", heads), ("vocabulary rows (padded to a multiple of 64)", padded)):
            if n and n % tp:
                problems.append(Problem("error", f"engine.tensor_parallel_size {tp}: {checkpoint.ref} has {n} {what}, "
                                                 f"which {tp} ranks cannot split evenly (vLLM fails while loading); "
                                                 "use a size that divides it"))
    return problems


def check_parallel(settings: Settings, on_cpu: bool, visible_gpus: int | None) -> list[Problem]:
    """Ranks against the machine, the draft's TP against the target's, and what vLLM turns off."""
    engine, spec = settings.engine, settings.speculative
    problems: list[Problem] = []
    ranks = engine.tensor_parallel_size * engine.pipeline_parallel_size * engine.data_parallel_size
    layout = (f"engine.tensor_parallel_size {engine.tensor_parallel_size} x pipeline_parallel_size "
              f"{engine.pipeline_parallel_size} x data_parallel_size {engine.data_parallel_size} = {ranks} "
              f"{'ranks' if on_cpu else 'GPUs'}")
    if engine.distributed_executor_backend == "ray":
        from dynamo_spec.config import ray_cluster

        problems += ray_cluster.check(settings, on_cpu, ranks, layout)
    elif not on_cpu and visible_gpus is not None and ranks > visible_gpus:
        problems.append(Problem("error", f"{layout} but this machine shows {visible_gpus}; lower them, or "
                                         "use engine.distributed_executor_backend: ray across nodes"))
    if spec.enabled and spec.draft_tensor_parallel_size is not None \
            and spec.draft_tensor_parallel_size > engine.tensor_parallel_size:
        problems.append(Problem("error", f"speculative.draft_tensor_parallel_size {spec.draft_tensor_parallel_size} "
                                         f"exceeds engine.tensor_parallel_size {engine.tensor_parallel_size}; vLLM "
                                         "runs the draft on the target's ranks"))
    if spec.enabled and spec.num_speculative_tokens_per_batch_size is not None and engine.data_parallel_size > 1:
        problems.append(Problem("warning", f"{schedule.FIELD} is ignored with engine.data_parallel_size > 1 (vLLM "
                                           f"turns it off: ranks could pick different k); every step drafts "
                                           f"k={spec.num_speculative_tokens}"))
    return problems


# vLLM 0.32's max_num_seqs for its OpenAI server when none is set (engine/arg_utils.py;
# large GPUs such as H100 get 1024, which a schedule ending at 1024 covers too).
VLLM_DEFAULT_MAX_NUM_SEQS = {"cpu": 128, "gpu": 256}


def effective_max_num_seqs(settings: Settings, on_cpu: bool) -> int:
    """The largest batch the engine will run: engine.max_num_seqs, else vLLM's default here."""
    return settings.engine.max_num_seqs or VLLM_DEFAULT_MAX_NUM_SEQS["cpu" if on_cpu else "gpu"]
# --- loading -----------------------------------------------------------------


def _load(ref: str, field: str, problems: list[Problem]) -> Checkpoint | None:
    path = Path(ref).expanduser()
    if path.exists():
        if not path.is_dir():
            problems.append(Problem("error", f"{field}: {ref} is a file; point it at the checkpoint directory"))
            return None
        config_file = path / "config.json"
        if not config_file.is_file():
            problems.append(Problem("error", f"{field}: {ref} has no config.json; is it a Hugging Face checkpoint directory?"))
            return None
        try:
            return Checkpoint(ref, json.loads(config_file.read_text()), path)
        except json.JSONDecodeError as exc:
            problems.append(Problem("error", f"{field}: {config_file} is not valid JSON ({exc.msg}, line {exc.lineno})"))
            return None
    if ref.startswith(("/", "./", "../", "~")) or ref.count("/") != 1:
        problems.append(Problem("error", f"{field}: directory {ref} does not exist (and it is not a Hugging Face id)"))
        return None
    return _load_from_hub(ref, field, problems)


def _load_from_hub(ref: str, field: str, problems: list[Problem]) -> Checkpoint | None:
    config_file, reason = _hub_config(ref)
    if config_file is None:
        problems.append(
            Problem(
                "error",
                f"{field}: {ref} is not a local directory and its config.json could not be fetched from the "
                f"Hugging Face Hub ({reason}); download it (huggingface-cli download {ref} --local-dir DIR) "
                f"and set {field} to DIR, or set HF_TOKEN for a gated model",
            )
        )
        return None
    return Checkpoint(ref, json.loads(config_file.read_text()), None, snapshot=config_file.parent)


def _hub_config(ref: str) -> tuple[Path | None, str]:
    """config.json from the local Hugging Face cache, else (unless offline) from the Hub, and
    why not. All through huggingface_hub, as vLLM downloads: it honours HF_TOKEN, HTTPS_PROXY,
    HF_ENDPOINT, HF_HUB_OFFLINE and the cache's location, which a socket of our own would not."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url

    with contextlib.suppress(Exception):
        return Path(hf_hub_download(ref, "config.json", local_files_only=True)), ""
    if constants.HF_HUB_OFFLINE:
        return None, "HF_HUB_OFFLINE is set"
    try:
        # One request without retries first: on a failing connection hf_hub_download retries for ~25 s.
        get_hf_file_metadata(hf_hub_url(ref, "config.json"))
        return Path(hf_hub_download(ref, "config.json")), ""
    except Exception as exc:  # gated, missing, network: all mean "cannot check"
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


# --- safetensors headers -----------------------------------------------------
# The checks on tensor shapes and the memory estimate read headers only: a few kB per file,
# whether the file is local, cached by huggingface_hub, or on the Hub.

DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
               "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}
SAFETENSORS_FILE, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"


def _tensor(dtype: str, shape: list[int], offsets: list[int] | tuple[int, int]) -> Tensor:
    """A tensor's bytes from dtype x shape; a dtype not listed (sub-byte ones) from the header's offsets."""
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype] if dtype in DTYPE_BYTES else offsets[1] - offsets[0]
    return Tensor(list(shape), nbytes)


def _read_headers(files: list[Path]) -> dict[str, Tensor]:
    """The 8-byte little-endian length, then the JSON header: the weights after it are never read,
    so a file holding only its header reads the same."""
    tensors: dict[str, Tensor] = {}
    for file in files:
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        tensors.update({name: _tensor(v["dtype"], v["shape"], v["data_offsets"])
                        for name, v in header.items() if name != "__metadata__"})
    return tensors


def _cached_safetensors(snapshot: Path) -> list[Path] | None:
    """The safetensors files of a cached snapshot, or None unless all of them are there
    (a cache may hold config.json alone, or some shards)."""
    index = snapshot / SAFETENSORS_INDEX
    if index.is_file():
        files = sorted({snapshot / name for name in json.loads(index.read_text()).get("weight_map", {}).values()})
    elif (snapshot / SAFETENSORS_FILE).is_file():
        files = [snapshot / SAFETENSORS_FILE]
    else:
        return None
    return files if files and all(f.is_file() for f in files) else None


def _hub_tensors(ref: str, snapshot: Path | None) -> dict[str, Tensor]:
    """A hub id's tensors: from the cache when it holds every safetensors file, else (unless
    offline) the Hub's headers, which get_safetensors_metadata fetches alone, shards included."""
    from huggingface_hub import HfApi, constants

    cached = _cached_safetensors(snapshot) if snapshot is not None else None
    if cached is not None:
        return _read_headers(cached)
    if constants.HF_HUB_OFFLINE:
        return {}
    try:
        metadata = HfApi().get_safetensors_metadata(ref)
    except Exception:  # .bin weights, gated, network: the checks that need shapes are skipped
        return {}
    return {name: _tensor(info.dtype, info.shape, info.data_offsets)
            for file in metadata.files_metadata.values() for name, info in file.tensors.items()}


def _file_bytes(files) -> int | None:
    return sum(f.stat().st_size for f in files) or None


def _hub_bin_bytes(ref: str, snapshot: Path | None) -> int | None:
    """A hub id without safetensors files (.bin weights): the cached files' sizes, else the Hub's."""
    from huggingface_hub import HfApi, constants

    cached = _file_bytes(snapshot.glob("*.bin")) if snapshot is not None else None
    if cached or constants.HF_HUB_OFFLINE:
        return cached
    try:  # bounded: the Hub may have just failed get_safetensors_metadata for want of a network
        siblings = HfApi().model_info(ref, files_metadata=True, timeout=constants.HF_HUB_ETAG_TIMEOUT).siblings or []
    except Exception:
        return None
    return sum(s.size or 0 for s in siblings if s.rfilename.endswith(".bin") and "/" not in s.rfilename) or None


# --- checks ------------------------------------------------------------------


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config", config)


def _head_size(config: dict[str, Any]) -> int | None:
    cfg = _text_config(config)
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    if cfg.get("hidden_size") and cfg.get("num_attention_heads"):
        return cfg["hidden_size"] // cfg["num_attention_heads"]
    return None


def _check_target(target: Checkpoint, on_cpu: bool) -> list[Problem]:
    head = _head_size(target.config)
    if on_cpu and head is not None and head not in CPU_HEAD_SIZES:
        return [Problem("error", f"engine.model: head size {head} is not supported by vLLM's CPU attention "
                                 f"(supported: {', '.join(map(str, CPU_HEAD_SIZES))}); use a GPU or another model")]
    return []


def is_eagle3_checkpoint(config: dict[str, Any]) -> bool:
    archs = set(config.get("architectures") or [])
    eagle_config = config.get("eagle_config") or {}
    return bool(
        archs & EAGLE3_ARCHS
        or "draft_vocab_size" in config
        or "eagle_aux_hidden_state_layer_ids" in eagle_config
    )


def _check_method(draft: Checkpoint, method: str) -> list[Problem]:
    eagle3 = is_eagle3_checkpoint(draft.config)
    archs = ", ".join(draft.config.get("architectures") or ["none listed"])
    if method == "eagle" and eagle3:
        return [Problem("error", f"speculative.method is 'eagle' but {draft.ref} is an EAGLE-3 checkpoint ({archs}); "
                                 "set speculative.method: eagle3 (vLLM would fail with KeyError: 'd2t')")]
    if method == "eagle3" and not eagle3:
        return [Problem("error", f"speculative.method is 'eagle3' but {draft.ref} is not an EAGLE-3 checkpoint ({archs}); "
                                 "set speculative.method: eagle, or use an EAGLE-3 draft")]
    return []


def _check_speculators(draft: Checkpoint, target: Checkpoint | None, method: str) -> list[Problem]:
    """A draft in the speculators format: its type against the method, its verifier against the target."""
    kind = draft.config.get(eagle3_format.SPECULATORS_KEY)
    problems: list[Problem] = []
    if method == "eagle3" and kind not in eagle3_format.SPECULATORS_EAGLE3_TYPES:
        problems.append(Problem("error", f"speculative.method is 'eagle3' but {draft.ref} is a speculators '{kind}' "
                                         "draft; set the method it was trained for"))
    verifier = eagle3_format.verifier_of(draft.config)
    wanted = set(verifier.get("architectures") or [])
    have = set((target.config.get("architectures") or []) if target is not None else [])
    if wanted and have and not wanted & have:
        problems.append(Problem("error", f"draft {draft.ref} was trained for {verifier.get('name_or_path')} "
                                         f"({', '.join(sorted(wanted))}) but the target is {', '.join(sorted(have))}; "
                                         "use a draft trained for this target"))
    return problems


def _check_pairing(
    target: Checkpoint, draft: Checkpoint, eagle3: bool, expected_aux: list[int] | None, on_cpu: bool
) -> list[Problem]:
    problems: list[Problem] = []
    tcfg, dcfg = _text_config(target.config), draft.config
    t_hidden = tcfg.get("hidden_size")
    d_target_hidden = dcfg.get("target_hidden_size", dcfg.get("hidden_size"))
    if t_hidden and d_target_hidden and t_hidden != d_target_hidden:
        problems.append(Problem("error", f"draft {draft.ref} was built for hidden size {d_target_hidden} but the target's is "
                                         f"{t_hidden}; use a draft trained for this target"))
        return problems  # the finer checks below assume matching sizes
    t_vocab, d_vocab = tcfg.get("vocab_size"), dcfg.get("vocab_size")
    if t_vocab and d_vocab and t_vocab != d_vocab:
        problems.append(Problem("error", f"vocabulary mismatch: target has {t_vocab} tokens, draft {draft.ref} {d_vocab}; "
                                         "the draft must be trained for the target's tokenizer"))
    shapes = draft.safetensors_shapes()
    draft_vocab = dcfg.get("draft_vocab_size") or d_vocab
    d2t = next((s for k, s in shapes.items() if k.endswith("d2t")), None)
    if eagle3 and d2t and draft_vocab and d2t[0] != draft_vocab:
        problems.append(Problem("error", f"draft {draft.ref}: d2t has {d2t[0]} entries but draft_vocab_size is {draft_vocab}"))
    head = _head_size(dcfg)
    if on_cpu and head is not None and head not in CPU_HEAD_SIZES:
        problems.append(Problem("error", f"draft {draft.ref}: head size {head} is not supported by vLLM's CPU attention"))
    if eagle3:
        problems += _check_aux_layers(target, draft, expected_aux, shapes)
    if dcfg.get(eagle3_format.UNTRAINED_KEY):
        problems.append(Problem("warning", f"draft {draft.ref} is UNTRAINED (random weights): nothing will be accepted and "
                                           "speculation only slows decoding; train one with `dynamo-spec train-draft`"))
    return problems


def _check_aux_layers(
    target: Checkpoint, draft: Checkpoint, expected: list[int] | None, shapes: dict[str, list[int]]
) -> list[Problem]:
    n_layers = _text_config(target.config).get("num_hidden_layers")
    if not n_layers:
        return []
    ids, where = eagle3_format.aux_layer_ids(draft.config, n_layers)
    problems: list[Problem] = []
    if expected is not None and list(expected) != ids:
        problems.append(Problem("error", f"speculative.aux_hidden_state_layer_ids is {expected} but vLLM will use {ids} from "
                                         f"{where}; fix one of them (the draft must be trained on the layers it gets)"))
    bad = eagle3_format.layers_outside(ids, n_layers)
    if bad:
        problems.append(Problem("error", f"aux layer ids {ids} ({where}) include {bad}, outside the target's {n_layers} layers "
                                         f"(0..{n_layers}); set eagle_aux_hidden_state_layer_ids in the draft's config.json"))
    elif len(set(ids)) != len(ids):
        problems.append(Problem("error", f"aux layer ids {ids} ({where}) collide for a {n_layers}-layer target: vLLM would start "
                                         "and then crash on the first request; set distinct "
                                         "eagle_aux_hidden_state_layer_ids in the draft's config.json"))
    fc = shapes.get("fc.weight") or shapes.get("model.fc.weight")
    hidden = draft.config.get("target_hidden_size", draft.config.get("hidden_size"))
    if fc and hidden and fc[1] != hidden * len(ids):
        problems.append(Problem("error", f"draft {draft.ref}: fc takes {fc[1] // hidden} hidden states but {len(ids)} aux layer "
                                         f"ids are configured ({ids})"))
    return problems


def _check_memory(settings: Settings, target: Checkpoint | None, draft: Checkpoint | None, on_cpu: bool) -> list[Problem]:
    need = sum(c.weight_bytes() or 0 for c in (target, draft) if c is not None)
    if not need:
        return []
    kv = int(settings.engine.kv_cache_memory_bytes or 0)
    if on_cpu:
        available = _mem_available()
        what = "available memory"
    else:
        # Per GPU: the target's weights split over TP x PP ranks, the draft's over its own TP.
        engine, spec = settings.engine, settings.speculative
        split = engine.tensor_parallel_size * engine.pipeline_parallel_size
        draft_tp = spec.draft_tensor_parallel_size or engine.tensor_parallel_size
        target_bytes = (target.weight_bytes() or 0) if target else 0
        draft_bytes = (draft.weight_bytes() or 0) if draft else 0
        need = target_bytes // split + draft_bytes // draft_tp
        available = _gpu_memory() * engine.gpu_memory_utilization
        what = f"one GPU's memory x gpu_memory_utilization {engine.gpu_memory_utilization}"
    if not available:
        return []
    # Weights, KV cache, and ~1 GiB of runtime overhead (a tiny model's server takes ~2 GB RSS on CPU).
    estimate = need + kv + (1 << 30)
    if estimate > available:
        return [Problem("error", f"memory: weights {need / 2**30:.1f} GiB + KV cache {kv / 2**30:.1f} GiB + ~1 GiB runtime "
                                 f"exceed {what} ({available / 2**30:.1f} GiB); lower engine.kv_cache_memory_bytes "
                                 "or use a bigger machine")]
    return []


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def check_features_on_path(settings: Settings, on_cpu: bool) -> list[Problem]:
    """A feature turned on that the runner or scheduling vLLM will choose here cannot run, or a path
    vLLM would refuse (``features.refusals`` on ``paths.predict``; the server runs the same check on
    vLLM's own config before it starts)."""
    from dynamo_spec.engine import features, paths

    try:
        path = paths.predict(settings, on_cpu=on_cpu, triton=paths.has_triton(on_cpu))
    except paths.PredictionError as exc:
        return [Problem("error", str(exc))]
    return features.refusals(settings, path, [])


def check_patches(settings: Settings, on_cpu: bool) -> list[Problem]:
    """Fail closed where a patch of vLLM cannot apply (vLLM is not a version it was checked on): a
    correctness fix is an error unless engine.allow_unpatched_vllm; a feature turned on that the
    patch backs is an error (``features.refusals``, the server's check too)."""
    from dynamo_spec.engine import features
    from dynamo_spec.vllm_patches import unapplied

    return features.refusals(settings, None, unapplied(on_cpu))


def check_driver(torch_cuda: str | None, driver_cuda: int | None) -> list[Problem]:
    """The NVIDIA driver must support the CUDA version torch was built for (``torch.version.cuda``,
    e.g. "13.0"; the driver's as CUDA reports it, e.g. 12080 for 12.8): an older driver fails at
    the first kernel, minutes into the load."""
    if not torch_cuda or not driver_cuda:
        return []
    major, minor = (int(x) for x in torch_cuda.split(".")[:2])
    have = (driver_cuda // 1000, (driver_cuda % 1000) // 10)
    if have >= (major, minor):
        return []
    return [Problem("error", f"the NVIDIA driver supports CUDA {have[0]}.{have[1]}, but this torch was built for "
                             f"CUDA {torch_cuda} (the vllm wheel's): upgrade the driver (CUDA 13 needs 580 or "
                             "newer), or install a torch and vllm built for the driver's CUDA")]


def _cuda_versions() -> tuple[str | None, int | None]:
    """torch's CUDA version and the driver's (None where there is no CUDA)."""
    import torch

    try:
        return torch.version.cuda, torch._C._cuda_getDriverVersion() if torch.version.cuda else None
    except Exception:  # noqa: BLE001 - no driver at all: torch.cuda reports it in its own words
        return torch.version.cuda, None


def _gpu_count() -> int | None:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else None


def _gpu_memory() -> int:
    import torch

    return torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else 0
