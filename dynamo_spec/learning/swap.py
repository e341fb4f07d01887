"""Load another EAGLE-3 draft into the running engine, between two engine steps, without a restart.

Two halves, in two processes:

- **In vLLM's worker** (``DraftSwapExtension``, mixed into the worker class through vLLM's
  ``ParallelConfig.worker_extension_cls``, set by ``engine/args.py``): ``dynamo_spec_load_draft``
  reads a draft directory's safetensors and loads them into ``model_runner.drafter.model`` the
  way vLLM reloads weights in place (``model_executor/model_loader/reload``: every layer of the
  draft is rebuilt on the meta device, loaded with the model's own ``load_weights``, processed
  again, e.g. the CPU's packed oneDNN weights, and copied into the tensors the engine already
  holds, so CUDA graphs keep their addresses). Only the draft's own tensors: an EAGLE-3 head
  that shares the target's embeddings or lm_head (vLLM shares them at load when the draft has
  none, or identical ones) never writes into the target's; ``t2d`` is skipped as vLLM's loader
  skips it; ``d2t`` is loaded.
- **In the API process** (``DraftSwapper``, behind ``serving``'s ``/admin/draft``,
  ``draft_admin.py``): the structural checks before anything is loaded (preflight's draft
  checks against the target, then the shape the engine's draft was built with: a swap cannot
  change the draft's shape, its vocabulary or the target layers it reads), the
  ``collective_rpc`` call, and what is served (path, version, when loaded, gate figures).

Why it is never half-loaded: the engine core runs a ``collective_rpc`` as a utility request in
its busy loop (``v1/engine/core.py`` ``run_busy_loop``: ``_process_input_queue`` handles
utility requests, then ``_process_engine_step`` runs one step; vLLM 0.32), and each worker runs
RPCs one at a time on its main thread, so a step runs wholly with the old draft or wholly with
the new one. The first verification after a swap checks the tokens the previous draft proposed
at the end of the step before (the V1 runner proposes for step n+1 at the end of step n);
output is the target's either way.

vLLM's own draft weight update (``start_draft_weight_update``, ``update_weights``,
``finish_weight_update`` in ``v1/worker/gpu_worker.py``) is not used: it needs a
``weight_transfer_config`` at start and a trainer pushing tensors through a transfer engine,
and every engine vLLM 0.32 ships moves CUDA tensors (NCCL, CUDA IPC), so none runs on the CPU
worker (which inherits those methods). It loads the same way underneath (layerwise reload).

Runners: the V1 model runner (vLLM's CPU build; on a GPU with ``VLLM_USE_V2_MODEL_RUNNER=0``).
Model Runner V2 keeps its drafter elsewhere (``v1/worker/gpu/spec_decode/``): the route refuses
there with one line (``engine/features.py`` ``DRAFT_SWAP``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynamo_spec.config import eagle3_format
from dynamo_spec.config.problems import Problem
from dynamo_spec.vllm_patches import suffix_mix

logger = logging.getLogger("dynamo_spec.learning.swap")

WORKER_METHOD = "dynamo_spec_load_draft"
EXTENSION = "dynamo_spec.learning.swap.DraftSwapExtension"
MANIFEST = "manifest.json"
# Figures a learn cycle's gate writes (``learn-draft``'s last line); shown by GET /admin/draft.
GATE_KEYS = ("promoted", "heldout_al_before", "heldout_al_after", "everyday_al_before", "everyday_al_after",
             "rows", "seconds")


# --- the draft's shape ------------------------------------------------------------------------


def structure(cfg: dict[str, Any]) -> dict[str, Any]:
    """What an engine builds its EAGLE-3 draft from (``llama_eagle3.py``), with vLLM's defaults
    filled in: two configs with the same structure load into the same model. ``cfg``: a
    config.json as vLLM sees it (``eagle3_format.vllm_view``), or the engine's own draft config."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    eagle = cfg.get("eagle_config") or {}
    return {
        "hidden_size": h,
        "target_hidden_size": cfg.get("target_hidden_size") or h,
        "intermediate_size": cfg.get("intermediate_size"),
        "num_hidden_layers": cfg.get("num_hidden_layers", 1),
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": cfg.get("head_dim") or h // heads,
        "vocab_size": cfg.get("vocab_size"),
        "draft_vocab_size": cfg.get("draft_vocab_size") or cfg.get("vocab_size"),
        "aux_hidden_state_layer_ids": eagle3_format.aux_ids_of(cfg) or None,  # None: vLLM's default
        "use_aux_hidden_state": bool(eagle.get("use_aux_hidden_state", True)),
        "norm_before_fc": bool(eagle.get("norm_before_fc", cfg.get("norm_before_fc", False))),
        "norm_before_residual": bool(cfg.get("norm_before_residual", False)),
        "fc_norm": bool(cfg.get("fc_norm", False)),
        "norm_output": bool(cfg.get("norm_output", False)),
    }


def structure_problems(served: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Where ``new``'s structure differs from the served draft's (the engine was built for that)."""
    problems = []
    for key, have in served.items():
        if new.get(key) == have:
            continue
        if key == "aux_hidden_state_layer_ids":
            problems.append(f"it reads the target's layers {new[key] or 'at vLLM default ids'} but the engine feeds "
                            f"the draft layers {have or 'at vLLM default ids'} (a draft for another target, or other "
                            "layers)")
        else:
            problems.append(f"its {key} is {new.get(key)} but the served draft's is {have}")
    return problems


def checkpoint_name(name: str) -> str:
    """A tensor's name in our format (``midlayer.``; the speculators format's ``layers.0.``)."""
    name = name.removeprefix("model.")
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def expected_tensors(cfg: dict[str, Any]) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...] | None]]:
    """The tensors a draft of this config must hold and those it may hold (name -> shape; None:
    any). A draft over the whole vocabulary may leave lm_head out (vLLM then shares the target's);
    embed_tokens is the draft's own when present; t2d is skipped by vLLM's loader."""
    shape = structure(cfg)
    need: dict[str, tuple[int, ...]] = eagle3_format.tensor_shapes(cfg)
    may: dict[str, tuple[int, ...] | None] = {"t2d": None, "embed_tokens.weight": (shape["vocab_size"], shape["hidden_size"])}
    if shape["draft_vocab_size"] != shape["vocab_size"]:
        need["d2t"] = (shape["draft_vocab_size"],)
    else:
        may["lm_head.weight"] = need.pop("lm_head.weight")
    if not shape["use_aux_hidden_state"]:
        need.pop("fc.weight")
    if shape["norm_before_fc"]:
        need["input_norm.weight"] = (shape["target_hidden_size"] * len(shape["aux_hidden_state_layer_ids"] or "abc"),)
    if shape["fc_norm"]:
        n_aux = len(shape["aux_hidden_state_layer_ids"] or "abc")
        need.update({f"fc_norm.{i}.weight": (shape["target_hidden_size"],) for i in range(n_aux)})
    return need, may


def tensor_problems(cfg: dict[str, Any], shapes: dict[str, list[int]]) -> list[str]:
    """What is wrong with a checkpoint's tensors (name -> shape) for a draft of config ``cfg``."""
    need, may = expected_tensors(cfg)
    have = {checkpoint_name(n): tuple(s) for n, s in shapes.items()}
    if not have:
        return ["it has no *.safetensors file (the swap loads safetensors only)"]
    problems = [f"it lacks the tensor {n}" for n in need if n not in have]
    for name, got in have.items():
        if name not in need and name not in may:
            problems.append(f"its tensor {name} is not one an EAGLE-3 draft of this shape has")
        elif (want := need.get(name) or may.get(name)) is not None and got != want:
            problems.append(f"its {name} is {list(got)} but the engine's draft takes {list(want)}")
    return problems


# --- in vLLM's worker ---------------------------------------------------------------------------


class DraftSwapExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); reached with
    ``AsyncLLM.collective_rpc("dynamo_spec_load_draft", args=(path,))`` on every rank. vLLM
    refuses an extension attribute the worker already has, hence the prefix."""

    def dynamo_spec_load_draft(self, path: str) -> dict[str, Any]:
        return load_draft(self.model_runner, self.vllm_config, path)  # type: ignore[attr-defined]

    # The suffix mix's trees live beside the draft in the worker (dynamo_spec/vllm_patches/suffix_mix.py).
    def dynamo_spec_suffix_clear(self) -> dict[str, Any]:
        return suffix_mix.clear_worker_trees(self)

    def dynamo_spec_suffix_stats(self) -> dict[str, Any] | None:
        return suffix_mix.worker_tree_stats(self)


def _refused(problem: str) -> dict[str, Any]:
    return {"ok": False, "problem": problem}


def load_draft(runner: Any, vllm_config: Any, path: str) -> dict[str, Any]:
    """Load the draft at ``path`` into ``runner``'s drafter, in place. Refuses, with the model
    untouched, anything it cannot load whole: every tensor is read and checked first."""
    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    start = time.perf_counter()
    drafter = getattr(runner, "drafter", None)
    model = getattr(drafter, "model", None)
    if model is None or not hasattr(model, "load_weights"):
        return _refused(f"{type(runner).__name__} has no V1 EAGLE drafter to load into")
    spec = vllm_config.speculative_config
    files = sorted(Path(path).glob("*.safetensors"))
    try:
        weights = {name: tensor for file in files for name, tensor in load_file(str(file)).items()}
    except Exception as exc:  # a truncated or corrupt file: nothing touched yet
        return _refused(f"its safetensors could not be read ({type(exc).__name__}: {exc})")
    problems = tensor_problems(model.config.to_dict(), {n: list(t.shape) for n, t in weights.items()})
    d2t = next((t for n, t in weights.items() if n.endswith("d2t")), None)
    if d2t is not None and d2t.is_floating_point():
        problems.append(f"its d2t is {d2t.dtype}, not an integer map")
    weights, shared = _own_tensors(model, _target_language_model(runner.get_model()), weights, problems)
    if problems:
        return _refused("; ".join(problems))
    with set_current_vllm_config(vllm_config), torch.no_grad(), _quiet_restores():
        initialize_layerwise_reload(model)
        try:
            model.load_weights(iter(weights.items()))
        finally:
            finalize_layerwise_reload(model, spec.draft_model_config)
    return {"ok": True, "tensors": len(weights), "shared_with_target": shared,
            "seconds": round(time.perf_counter() - start, 3)}


@contextlib.contextmanager
def _quiet_restores():
    """Leave out vLLM's "<Layer>: Failed to load weights" during a swap: the checks above make sure
    every tensor of the draft's own layers is loaded, and the layers it names are those with none to
    load (rotary caches, the modules shared with the target), which the reload puts back as they were."""
    class Filter(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "Failed to load weights" not in record.getMessage()

    layerwise, quiet = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise"), Filter()
    layerwise.addFilter(quiet)
    try:
        yield
    finally:
        layerwise.removeFilter(quiet)


def _target_language_model(target: Any) -> Any:
    from vllm.model_executor.models.interfaces import supports_multimodal

    return target.get_language_model() if supports_multimodal(target) else target


def _own_tensors(model: Any, target: Any, weights: dict[str, Any],
                 problems: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The draft's own tensors of ``weights``: those of a module the draft shares with the target
    (vLLM's ``_maybe_share_embeddings`` / ``_maybe_share_lm_head``, by identity) are dropped when
    they equal the target's (as at load) and refused when they differ (the draft would need its
    own memory: a restart)."""
    import torch

    inner = getattr(target, "model", None)
    modules = {"embed_tokens.weight": (getattr(model.model, "embed_tokens", None), getattr(inner, "embed_tokens", None)),
               "lm_head.weight": (getattr(model, "lm_head", None), getattr(target, "lm_head", None))}
    own, shared = dict(weights), []
    for name, (draft_module, target_module) in modules.items():
        key = next((n for n in weights if checkpoint_name(n) == name), None)
        is_shared = draft_module is not None and draft_module is target_module
        if is_shared:
            shared.append(name)
        if key is None:
            if draft_module is not None and not is_shared:
                problems.append(f"it has no {name} but the served draft has its own (a restart loads it)")
            continue
        if is_shared:
            if torch.equal(weights[key].to(target_module.weight.dtype), target_module.weight.detach().cpu()):
                del own[key]
            else:
                problems.append(f"its {name} differs from the target's, which the served draft shares "
                                "(a restart loads it)")
    return own, shared


# --- in the API process -------------------------------------------------------------------------


@dataclass(frozen=True)
class ServedDraft:
    """A draft the engine serves or served."""

    path: str
    version: str
    loaded_at: float  # Unix time; for the draft the server started with: the server's start
    how: str  # "start" or "swap"
    gate: dict[str, Any] | None = None

    def as_json(self) -> dict[str, Any]:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.loaded_at))
        return {"path": self.path, "version": self.version, "loaded_at": stamp, "loaded_by": self.how,
                "gate": self.gate}


def _manifest(directory: Path) -> dict[str, Any] | None:
    """The draft's manifest: ``manifest.json`` in its directory, else its entry in the parent's
    (``learn-draft``'s ``drafts/manifest.json``: a list under ``versions`` whose entry names this
    directory by ``path`` or ``version``)."""
    with contextlib.suppress(OSError, ValueError):
        own = json.loads((directory / MANIFEST).read_text())
        if isinstance(own, dict):
            return own
    with contextlib.suppress(OSError, ValueError):
        parent = json.loads((directory.parent / MANIFEST).read_text())
        for entry in (parent.get("versions") or []) if isinstance(parent, dict) else []:
            if not isinstance(entry, dict):
                continue
            where = entry.get("path")
            if entry.get("version") == directory.name or (
                    where and (directory.parent / where).resolve() == directory.resolve()):
                return entry
    return None


def weights_hash(directory: Path) -> str:
    """sha256 of config.json and the safetensors files, in name order (12 hex digits)."""
    digest = hashlib.sha256()
    for file in [directory / "config.json", *sorted(directory.glob("*.safetensors"))]:
        with contextlib.suppress(OSError), file.open("rb") as f:
            for block in iter(lambda f=f: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:12]


def describe(ref: str, how: str, loaded_at: float | None = None) -> ServedDraft:
    """``ref``'s version (its manifest's ``version``, else ``sha256:`` of its files; a Hugging Face
    id: its cached snapshot's revision) and gate figures (``learn-draft``'s, at the top of its
    manifest entry, else the entry's ``gate``)."""
    directory = Path(ref).expanduser()
    loaded_at = time.time() if loaded_at is None else loaded_at
    if not directory.is_dir():
        return ServedDraft(ref, _hub_revision(ref), loaded_at, how)
    manifest = _manifest(directory) or {}
    gate = {k: manifest[k] for k in GATE_KEYS if k in manifest} or (
        manifest["gate"] if isinstance(manifest.get("gate"), dict) else None)
    version = manifest.get("version")
    return ServedDraft(str(directory.resolve()), str(version) if version else f"sha256:{weights_hash(directory)}",
                       loaded_at, how, gate)


def _hub_revision(ref: str) -> str:
    from huggingface_hub import hf_hub_download

    with contextlib.suppress(Exception):
        return "hub:" + Path(hf_hub_download(ref, "config.json", local_files_only=True)).parent.name[:12]
    return "hub:unknown"


def check_draft(settings: Any, served_config: dict[str, Any], path: str, on_cpu: bool) -> tuple[list[str], list[str]]:
    """Errors and warnings for swapping in the draft at ``path``, from config.json and the
    safetensors headers only: preflight's draft checks against the target (``config/preflight.py``:
    method, speculators verifier, hidden size, vocabulary, ``d2t``, aux layer ids, head size), then
    the shape of the engine's draft (``served_config``) and every tensor's name and shape."""
    from dynamo_spec.config import preflight

    directory = Path(path)
    if not directory.is_dir():
        return [f"{path} is not a directory"], []
    problems: list[Problem] = []
    draft = preflight.load_checkpoint(str(directory), "path", problems)
    target = preflight.load_checkpoint(settings.engine.model, "engine.model", problems)
    if draft is None or target is None:
        return [p.message for p in problems], []
    found, draft = preflight.check_draft(target, draft, "eagle3", settings.speculative.aux_hidden_state_layer_ids, on_cpu)
    problems += found
    errors = [p.message for p in problems if p.level == "error"]
    warnings = [p.message for p in problems if p.level == "warning"]
    if errors:
        return errors, warnings
    try:
        new = structure(draft.config)
    except KeyError as exc:
        return [f"{directory}/config.json lacks {exc.args[0]}"], warnings
    errors = [f"draft {directory}: {p}" for p in structure_problems(structure(served_config), new)]
    if not errors:
        errors = [f"draft {directory}: {p}" for p in tensor_problems(served_config, draft.safetensors_shapes())]
    return errors, warnings


class SwapRefused(Exception):
    """A draft the engine cannot load (400): the served draft stays."""


class DraftSwapper:
    """What the engine serves, and the one way to change it: ``swap`` (one at a time)."""

    def __init__(self, settings: Any, metrics: Any | None, started_at: float | None = None):
        self.settings = settings
        self.metrics = metrics
        self.served = describe(settings.speculative.model, "start", started_at)
        self.previous: ServedDraft | None = None
        self.swaps = 0
        self._lock = asyncio.Lock()
        if metrics is not None:
            metrics.record_draft(self.served.path, self.served.version)

    def state(self) -> dict[str, Any]:
        return {**self.served.as_json(), "previous": self.previous.as_json() if self.previous else None,
                "swaps": self.swaps}

    async def swap(self, engine: Any, path: str, on_cpu: bool) -> dict[str, Any]:
        """Check the draft at ``path``, load it into every worker, and make it the served one.
        Raises SwapRefused with every problem found; the served draft then stays."""
        path = str(Path(path).expanduser().resolve())
        async with self._lock:
            served_config = _engine_draft_config(engine)
            errors, warnings = await asyncio.to_thread(check_draft, self.settings, served_config, path, on_cpu)
            if errors:
                raise SwapRefused("; ".join(errors))
            new = await asyncio.to_thread(describe, path, "swap")
            results = await self._load(engine, path)
            if problems := sorted({r["problem"] for r in results if not r.get("ok")}):
                raise SwapRefused(f"draft {path}: " + "; ".join(problems))
            self.previous, self.served = self.served, dataclasses.replace(new, loaded_at=time.time())
            self.swaps += 1
            if self.metrics is not None:
                await _settle(engine)
                self.metrics.record_draft(self.served.path, self.served.version)
            logger.info("Draft swapped: now %s (%s), in %.2f s; before: %s (%s)", self.served.path,
                        self.served.version, max(r.get("seconds", 0.0) for r in results), self.previous.path,
                        self.previous.version)
            return {**self.state(), "warnings": warnings}

    async def _load(self, engine: Any, path: str) -> list[dict[str, Any]]:
        try:
            return await engine.collective_rpc(WORKER_METHOD, args=(path,))
        except Exception:
            # A failure past the checks (they read everything first, so it should not happen): put the
            # served draft back, so that no worker is left with a mix of two drafts.
            logger.exception("Loading draft %s failed; reloading the served draft %s", path, self.served.path)
            await engine.collective_rpc(WORKER_METHOD, args=(self.served.path,))
            raise


def _engine_draft_config(engine: Any) -> dict[str, Any]:
    """The config the engine built its draft from, as vLLM read it."""
    cfg = engine.vllm_config.speculative_config.draft_model_config.hf_config.to_dict()
    cfg.pop("model", None)  # vLLM's EAGLEConfig keeps the draft's own config beside its fields
    return cfg


async def _settle(engine: Any, timeout: float = 2.0) -> None:
    """Wait until the API process has taken in the engine's outputs of the steps before the swap
    (they reach it before the swap's answer, and vLLM's output handler records their statistics
    in order), so that restarted acceptance windows hold the new draft's steps only."""
    queue = getattr(getattr(engine, "engine_core", None), "outputs_queue", None)
    deadline = time.monotonic() + timeout
    while queue is not None and not queue.empty() and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    await asyncio.sleep(0)
