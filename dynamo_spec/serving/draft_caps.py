"""A request's cap on draft tokens, ``vllm_xargs.max_draft_tokens``: checked, and merged with its tenant's default.

vLLM's OpenAI layer copies ``vllm_xargs`` into ``SamplingParams.extra_args``, where the
engine's draft admission (``dynamo_spec.vllm_patches.draft_admission``) reads it. Here a
value that is not a non-negative integer is refused (400 naming the field), and the
default of the request's tenant (``speculative.tenants``, the tenant named by the header
``metrics.tenant_header``) is written into the body; the request's own value may only
lower it. ``dynamo_spec.serving.admission`` calls both.
"""

from __future__ import annotations

from typing import Any

from dynamo_spec.config.settings import Settings

FIELD = "max_draft_tokens"  # the name the engine reads (draft_admission.MAX_DRAFT_TOKENS)
PARAM = f"vllm_xargs.{FIELD}"


def requested_cap(body: Any) -> int | None:
    """The request's own cap, or None if it sets none; ValueError (its message names the
    field) if the value is not a non-negative integer: a bool, a float, a string, a negative number."""
    if not isinstance(body, dict):
        return None
    xargs = body.get("vllm_xargs")
    if not isinstance(xargs, dict) or xargs.get(FIELD) is None:
        return None  # a vllm_xargs that is not an object is vLLM's own 400
    value = xargs[FIELD]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"'{PARAM}' must be an integer >= 0 (0: no draft tokens), not {value!r}")
    return value


def unavailable(on_cpu: bool) -> str | None:
    """Why the engine cannot honour caps here (a patch the caps' feature declares stays off on this
    vLLM), or None: a request that sets one is then refused rather than silently drafting the step's k."""
    from dynamo_spec.engine import features
    from dynamo_spec.vllm_patches import unapplied

    patch = features.unpatched(features.DRAFT_CAPS, unapplied(on_cpu))
    return features.why_off(patch) if patch else None


class TenantDraftCaps:
    """The tenants' default caps (``speculative.tenants``), keyed by the tenant header's value."""

    def __init__(self, defaults: dict[str, int], header: str):
        self.defaults = defaults
        self.header = header.lower().encode("latin-1")

    @classmethod
    def from_settings(cls, settings: Settings) -> TenantDraftCaps | None:
        defaults = {name: t.max_draft_tokens for name, t in settings.speculative.tenants.items()
                    if t.max_draft_tokens is not None}
        if not defaults or not settings.metrics.tenant_header:
            return None
        return cls(defaults, settings.metrics.tenant_header)

    def default_for(self, headers: list[tuple[bytes, bytes]]) -> int | None:
        tenant = next((v.decode("latin-1") for k, v in headers if k == self.header), None)
        return self.defaults.get(tenant) if tenant is not None else None

    def merged(self, body: Any, headers: list[tuple[bytes, bytes]]) -> dict[str, Any] | None:
        """The body with the tenant's default in ``vllm_xargs`` (the smaller of it and the
        request's own value), or None when there is nothing to change."""
        default = self.default_for(headers)
        if default is None or not isinstance(body, dict):
            return None
        xargs = body.get("vllm_xargs")
        if xargs is None:
            xargs = {}
        elif not isinstance(xargs, dict):
            return None  # vLLM refuses it
        own = requested_cap(body)
        if own is not None and own <= default:
            return None
        return {**body, "vllm_xargs": {**xargs, FIELD: default}}
