"""A request's DRY fields (``dynamo_spec.sampling.dry``): checked, moved into ``vllm_xargs``, and
completed with the server's default (``sampling.dry``).

vLLM's request models have no DRY fields: a top-level ``dry_multiplier`` (llama.cpp's way) is
moved into ``vllm_xargs``, which vLLM copies into ``SamplingParams.extra_args`` where the engine's
patch (``vllm_patches/dry.py``) reads it. A request that sets none gets the server's default when
that is on; one that sets some gets the rest from the default; a field set to null gets the
default's (as OpenAI's own fields do). A bad value is a 400 naming the field; so is any DRY field
on an engine that cannot apply it (``unavailable``).
"""

from __future__ import annotations

from typing import Any

from dynamo_spec.sampling import dry


class DryFieldError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _checked(name: str, value: Any, prefix: str) -> None:
    try:
        dry.parse({"dry_multiplier": 1.0, name: value} if name != "dry_multiplier" else {name: value}, prefix=prefix)
    except ValueError as exc:
        raise DryFieldError(prefix + name, str(exc)) from None


class DryFields:
    def __init__(self, default: dry.DryParams):
        self.default = default
        self.unavailable: str | None = None  # why this engine cannot apply DRY (set once it is known)

    def rewritten(self, body: Any) -> dict[str, Any] | None:
        """The body with its DRY fields in ``vllm_xargs``, complete; None when there is nothing to
        change. DryFieldError naming the field for a bad value, or a DRY field the engine cannot apply."""
        if not isinstance(body, dict):
            return None
        xargs = body.get("vllm_xargs")
        if xargs is not None and not isinstance(xargs, dict):
            return None  # vLLM refuses it
        # a null field means the server's default for that field, as for OpenAI's own fields
        nulls = [k for k in dry.FIELDS if k in body and body[k] is None]
        nulls += [k for k in dry.FIELDS if k in (xargs or {}) and xargs[k] is None]
        xargs = {k: v for k, v in (xargs or {}).items() if not (k in dry.FIELDS and v is None)}
        top = {k: body[k] for k in dry.FIELDS if body.get(k) is not None}
        if (both := [k for k in top if k in xargs]):
            raise DryFieldError(both[0], f"'{both[0]}' is set both at the top level and in 'vllm_xargs': set it once")
        own = {**{k: v for k, v in xargs.items() if k in dry.FIELDS}, **top}
        where = {k: ("" if k in top else "vllm_xargs.") for k in own}
        for name, value in own.items():  # each field checked under the name the client used
            _checked(name, value, where[name])
        if own and own.get("dry_multiplier") is None and not self.default.active:
            first = next(iter(own))
            raise DryFieldError(where[first] + first, f"'{where[first]}{first}' needs 'dry_multiplier' "
                                "(DRY is off by default on this server)")
        wanted = {**dry.as_fields(self.default), **own} if (own or self.default.active) else {}
        rest = {k: v for k, v in body.items() if k not in dry.FIELDS}
        if not wanted:
            if not nulls:
                return None
            return {**rest, "vllm_xargs": xargs} if "vllm_xargs" in body else rest
        params = dry.parse(wanted)
        if params is not None and params.active and self.unavailable:
            name = "dry_multiplier" if "dry_multiplier" in own else next(iter(own), "dry_multiplier")
            param = where.get(name, "") + name
            raise DryFieldError(param, f"'{param}': DRY is not available on this server: {self.unavailable}")
        return {**rest, "vllm_xargs": {**xargs, **wanted}}
