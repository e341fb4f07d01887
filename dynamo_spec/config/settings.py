"""The settings model: the single source of truth for a dynamo-spec deployment.

Values come from four layers, highest first: command-line overrides
(``--speculative.num_speculative_tokens 3``), environment variables
(``DYNAMO_SPEC_SPECULATIVE__NUM_SPECULATIVE_TOKENS=3``), one YAML file, and the
defaults below. :func:`dynamo_spec.config.loader.load_settings` layers them and
records where each value came from.
"""

from __future__ import annotations

import difflib
import typing
from typing import Any, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from dynamo_spec.config import schedule, vllm_names
from dynamo_spec.sampling import dry

ENV_PREFIX = "DYNAMO_SPEC_"
ENV_DELIMITER = "__"

# Methods that load a draft checkpoint from `speculative.model`.
DRAFT_MODEL_METHODS = {"eagle", "eagle3", "draft_model", "medusa", "mlp_speculator"}


def did_you_mean(name: str, choices: typing.Iterable[str]) -> str:
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"; did you mean '{match[0]}'?" if match else ""


def engine_arg_names() -> frozenset[str]:
    """Field names of vLLM's AsyncEngineArgs (config/vllm_names.py: without importing vLLM)."""
    return frozenset(vllm_names.names()["engine_args"])


def frontend_arg_names() -> frozenset[str]:
    """Options of vLLM's OpenAI frontend (`vllm serve` flags, snake_case) that are not
    engine arguments: chat template, tool-call and reasoning parsers, response role, ..."""
    return frozenset(vllm_names.names()["frontend_args"])


# Frontend options this project sets itself (typed fields elsewhere or fixed by the router).
FRONTEND_OWNED = {"host": "server.host", "port": "server.port", "api_key": "server.api_key",
                  "served_model_name": "server.served_model_name", "model": "engine.model", "tokenizer": "engine.tokenizer"}


def speculative_field_names() -> frozenset[str]:
    """User-settable fields of vLLM's SpeculativeConfig."""
    return frozenset(vllm_names.names()["speculative_fields"])


def speculative_methods() -> tuple[str, ...]:
    return tuple(vllm_names.names()["speculative_methods"])


def _check_passthrough(extra: dict[str, Any], known: frozenset[str], typed: set[str], section: str) -> None:
    for key in extra:
        if key in typed:
            raise ValueError(f"'{key}' is a typed field: set {section}.{key} instead of {section}.extra.{key}")
        if key not in known:
            raise ValueError(f"'{key}' is not a vLLM option{did_you_mean(key, known)}")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ServerSettings(_Section):
    host: str = Field("0.0.0.0", description="Interface the HTTP server binds to.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port (API, /health and /metrics).")
    served_model_name: str | None = Field(None, description="Model name clients send; defaults to engine.model.")
    api_key: SecretStr | None = Field(None, description="If set, /v1/* requires 'Authorization: Bearer <key>'.")
    metrics_require_api_key: bool = Field(False, description="Also require the API key on /metrics.")
    admin_api_key: SecretStr | None = Field(
        None, description="If set, /admin/* requires 'Authorization: Bearer <this key>' and refuses api_key (the users' "
        "key): who may swap the draft, erase captures and trees, pin the guard. Unset: /admin takes api_key.")
    shutdown_grace_seconds: float = Field(
        30.0, ge=0, description="On SIGTERM: how long in-flight requests may take to finish (new ones get 503). "
        "Match Kubernetes' terminationGracePeriodSeconds.",
    )
    engine_stop_seconds: float = Field(
        30.0, ge=6, description="After the drain: how long the engine's processes get to exit before they are "
        "killed (its workers get all but 5 s of it). A compiled engine's exit can take 10 s on a busy CPU host.",
    )
    keep_alive_seconds: float = Field(
        75.0, gt=0, description="How long an idle HTTP connection is kept open for the client's next request. Longer "
                                "than clients and load balancers keep theirs (httpx 5 s, AWS ALB 60 s), so the server "
                                "never closes one that a client is reusing at that moment.")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    frontend: dict[str, Any] = Field(
        default_factory=dict, description="vLLM OpenAI-frontend options, as `vllm serve` flags in snake_case: "
        "chat_template, enable_auto_tool_choice, tool_call_parser, reasoning_parser, response_role, ...",
    )

    @field_validator("frontend")
    @classmethod
    def _known_frontend_options(cls, frontend: dict[str, Any]) -> dict[str, Any]:
        for key in frontend:
            if key in FRONTEND_OWNED:
                raise ValueError(f"'{key}': set {FRONTEND_OWNED[key]} instead of server.frontend.{key}")
            if key in engine_arg_names():
                where = f"engine.{key}" if key in EngineSettings.model_fields else f"engine.extra.{key}"
                raise ValueError(f"'{key}' is an engine argument: set {where}")
            if key not in frontend_arg_names():
                raise ValueError(f"'{key}' is not a vLLM frontend option{did_you_mean(key, frontend_arg_names())}")
        return frontend


class LimitsSettings(_Section):
    """What one request, and the server as a whole, may ask for. Beyond a limit: 400/413/429 at once."""

    max_in_flight: int | None = Field(
        256, ge=1, description="Generation requests served at once; more get 429 with Retry-After. null: no bound."
    )
    request_timeout_seconds: float | None = Field(
        600.0, gt=0, description="A generation request running longer is aborted in the engine and answered 504. "
        "null: no timeout.",
    )
    max_body_bytes: ByteSize = Field(ByteSize(4 * 2**20), ge=1, description="Largest request body (413 beyond).")
    max_json_depth: int = Field(
        64, ge=2, le=512, description="Deepest nesting of arrays/objects in a request body (400 beyond).",
    )
    max_n: int = Field(8, ge=1, description="Largest n (and best_of): choices per request.")
    max_tokens: int | None = Field(
        None, ge=1, description="Largest max_tokens / max_completion_tokens; null: only the context length bounds it.",
    )
    max_stop_sequences: int = Field(16, ge=0, description="Most stop strings per request.")
    max_top_logprobs: int = Field(20, ge=0, description="Largest top_logprobs / logprobs / prompt_logprobs.")
    max_prompts: int = Field(64, ge=1, description="Most prompts in one completions request.")


class EngineSettings(_Section):
    model: str = Field(description="Target model: a local directory or a Hugging Face id.")
    tokenizer: str | None = Field(None, description="Tokenizer directory or id; defaults to the model's.")
    dtype: Literal["auto", "bfloat16", "float16", "float32", "half", "float"] = "auto"
    max_model_len: int | None = Field(None, ge=16, description="Context length; defaults to the model's.")
    tensor_parallel_size: int = Field(1, ge=1, description="Ranks (GPUs; on CPU, processes) the target is split over.")
    pipeline_parallel_size: int = Field(1, ge=1, description="Pipeline stages (layers split over ranks, or nodes).")
    data_parallel_size: int = Field(1, ge=1, description="Engine replicas inside one server (MoE models mostly).")
    distributed_executor_backend: Literal["mp", "ray"] | None = Field(
        None, description="How vLLM starts its ranks: mp (one node) or ray (several nodes); null: vLLM's choice."
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="GPU only: fraction of GPU memory for vLLM.")
    kv_cache_memory_bytes: ByteSize | None = Field(
        None, description="KV-cache size, e.g. '512MiB'. Required on CPU (automatic sizing fails there)."
    )
    enforce_eager: bool = Field(False, description="Skip graph capture/compilation: faster start, slower decode.")
    max_num_seqs: int | None = Field(None, ge=1, description="Maximum concurrent sequences.")
    cpu_preload: bool = Field(
        True, description="CPU only: LD_PRELOAD Intel OpenMP (PyPI intel-openmp) and tcmalloc (Debian "
        "libtcmalloc-minimal4) into vLLM's engine processes where installed, as vLLM's CPU worker asks."
    )
    seed: int = 0
    allow_unpatched_vllm: bool = Field(
        False, description="Serve on a vLLM that dynamo-spec's correctness fixes (vllm_patches) were not checked "
        "on: they stay off and the bugs they fix come back (sampled CPU output, seeded CPU requests).")
    per_request_spec_decode_metrics: Literal["none", "summary", "detailed"] = Field(
        "summary", description="Speculative stats on each response (metrics.speculative_decoding)."
    )
    extra: dict[str, Any] = Field(
        default_factory=dict, description="Any other vLLM AsyncEngineArgs field, passed through as is."
    )

    @field_validator("extra")
    @classmethod
    def _known_engine_args(cls, extra: dict[str, Any]) -> dict[str, Any]:
        typed = set(cls.model_fields) - {"extra"}
        _check_passthrough(extra, engine_arg_names(), typed | {"speculative_config", "served_model_name"}, "engine")
        return extra


class TenantSettings(_Section):
    """What one tenant's requests get by default (the tenant named by metrics.tenant_header)."""

    max_draft_tokens: int | None = Field(
        None, ge=0, description="Most draft tokens verified per step for this tenant's requests (0: none); "
        "a request's vllm_xargs.max_draft_tokens may only lower it. null: the step's k.",
    )


class GuardSettings(_Section):
    """Speculation guard: drafting stops for the whole engine while acceptance has collapsed, with probes to resume.

    A step drafting k tokens a request costs about 1 + c k plain steps and yields 1 + r k tokens
    (r: acceptance rate), so it gains exactly when r > c: ``min_acceptance_rate`` is that break-even
    c, which `dynamo-spec bench` reports per cell."""

    enabled: bool = Field(False, description="Watch acceptance and fall back to k=0 when it collapses.")
    min_acceptance_rate: float = Field(
        0.10, ge=0, le=1, description="Fall back below this acceptance rate (accepted / drafted tokens) over the "
        "window; a probe resumes at or above it. Default: the break-even rate `dynamo-spec bench` measured for "
        "the k=2-4 steps the CPU schedule drafts at one or two clients on bf16 CPU hosts (0.07-0.11).",
    )
    window_draft_tokens: int = Field(1000, ge=1, description="Trailing window: the last this many drafted tokens.")
    window_seconds: float = Field(
        30.0, gt=0, description="Judge earlier, once the window spans this long and holds min_draft_tokens.")
    min_draft_tokens: int = Field(100, ge=1, description="Fewest drafted tokens a judgement rests on.")
    probe_interval_seconds: float = Field(30.0, gt=0, description="In fallback: how long before a probe.")
    probe_draft_tokens: int = Field(200, ge=1, description="A probe drafts this many tokens, then judges them.")


# Methods whose drafts come with the draft's own probabilities (dynamo_spec/vllm_patches/draft_confidence.py).
CONFIDENCE_METHODS = {"eagle", "eagle3", "draft_model"}


# A draft token costing 1 plain step or more is never worth verifying (its survival is at most 1);
# costs are capped here so that a bench measurement on a slow or noisy host still makes a valid config.
MAX_DRAFT_TOKEN_COST = 10.0


class DraftBudgetSettings(_Section):
    """Confidence draft budget: per step, verify only the draft tokens likely to be accepted.

    Each draft token's chance of surviving verification (the draft's own probabilities, calibrated
    online against what the target accepts) is weighed against the cost of verifying it; across the
    step's requests the best tokens are kept while each adds more than it costs. The batch-size
    schedule still caps k: the budget trims below it."""

    enabled: bool = Field(False, description="Trim each request's drafts to those worth verifying.")
    draft_token_cost: list[tuple[int, float]] = Field(
        default_factory=lambda: [(1, 0.12), (4, 0.12), (8, 0.25), (16, 0.35), (32, 0.38)],
        description="Cost of verifying one more draft token, in plain steps per request (the break-even "
        "acceptance of that token), at [requests in a step, cost] points; linear between them, flat beyond. "
        "`dynamo-spec bench` measures it per concurrency ('verify cost': k=1 against the speculative engine at k=0).",
    )
    min_observations: int = Field(8, ge=0, description="Verify a draft token whose (position, confidence decile) "
                                  "cell holds fewer judgements than this, to learn its acceptance.")
    explore_every: int = Field(64, ge=0, description="Verify every this-many-th draft whole, so the calibration "
                               "follows drift (0: never).")

    @field_validator("draft_token_cost")
    @classmethod
    def _ascending_points(cls, points: list[tuple[int, float]]) -> list[tuple[int, float]]:
        if not points:
            raise ValueError("give at least one [requests, cost] point")
        xs = [x for x, _ in points]
        if any(x < 1 for x in xs) or xs != sorted(set(xs)):
            raise ValueError(f"requests must be 1 or more and strictly ascending, got {xs}")
        if any(not 0 <= c <= MAX_DRAFT_TOKEN_COST for _, c in points):
            raise ValueError(f"each cost must be between 0 and {MAX_DRAFT_TOKEN_COST:g} plain steps")
        return points


# Methods whose drafter the suffix tree is mixed with (dynamo_spec/vllm_patches/suffix_mix.py: the EAGLE proposer).
SUFFIX_MIX_METHODS = {"eagle", "eagle3"}
# The tree's longest draft: vLLM's num_speculative_tokens bound (SpeculativeSettings.num_speculative_tokens).
MAX_SUFFIX_TOKENS = 32


class SuffixSettings(_Section):
    """Suffix-tree drafts from the served answers, mixed with the EAGLE-3 draft per request and step.

    A suffix tree of earlier answers (and of the request's own prompt) drafts the continuation of
    the longest match, with a score that estimates how many of its tokens will be accepted; where
    the score reaches ``min_score`` that draft replaces the EAGLE-3 draft for the step. Lossless: the
    target verifies every draft token. The trees live in the engine's memory only (never on disk);
    DELETE /admin/learning/captures empties them."""

    enabled: bool = Field(False, description="Mix suffix-tree drafts (arctic-inference's tree) with the EAGLE-3 draft.")
    max_tokens: int = Field(16, ge=1, le=MAX_SUFFIX_TOKENS, description="The tree's longest draft (tokens).")
    min_score: float = Field(2.0, ge=0, description="The tree's score (its expected accepted tokens) at which its "
                             "draft replaces the EAGLE-3 draft.")
    max_cached_requests: int = Field(2000, ge=1, description="Finished answers kept per tree, the oldest evicted first "
                                     "(~34 kB an answer of 160 tokens: `dynamo-spec config` shows the bound).")
    scope: Literal["tenant", "global"] = Field(
        "tenant", description="tenant: one tree per tenant of metrics.tenant_header (requests without the header "
        "share one); global: one tree for all.")
    include_prompt: bool = Field(True, description="The request's own prompt in its tree (drafts that copy from it).")


class SpeculativeSettings(_Section):
    enabled: bool = Field(True, description="Turn speculative decoding off to serve the target alone.")
    method: str = Field("eagle3", description="vLLM speculative method (eagle3, eagle, ngram, draft_model, ...).")
    model: str | None = Field(None, description="Draft checkpoint: a local directory or a Hugging Face id.")
    num_speculative_tokens: int = Field(3, ge=1, le=32, description="Tokens the draft proposes per step (k).")
    num_speculative_tokens_per_batch_size: schedule.Setting | None = Field(
        None,
        description="Batch-size schedule of k: entries [lo, hi, k], inclusive ranges of the number of requests "
        "in an engine step; k=0 turns speculation off in that range; k <= num_speculative_tokens. "
        "Or one schedule per host kind, keyed by the resolved engine.dtype (bfloat16, float16, float32; "
        "`default` for any other): the entry for the dtype the engine runs in applies. "
        "`dynamo-spec bench` derives one for a host.",
    )
    draft_tensor_parallel_size: int | None = Field(None, ge=1)
    aux_hidden_state_layer_ids: list[int] | None = Field(
        None,
        description="EAGLE-3: target layers whose hidden states feed the draft. vLLM reads them from the "
        "draft's config.json; when set here, preflight checks the draft agrees.",
    )
    draft_penalties: bool = Field(
        True, description="The draft drafts under the request's repetition, frequency and presence penalties, as "
        "the target will verify (lossless: only the proposals change). V1 runner (CPU); inactive on Model Runner V2.")
    guard: GuardSettings = Field(default_factory=GuardSettings)
    draft_budget: DraftBudgetSettings = Field(default_factory=DraftBudgetSettings)
    suffix: SuffixSettings = Field(default_factory=SuffixSettings)
    tenants: dict[str, TenantSettings] = Field(
        default_factory=dict, description="Defaults per tenant, keyed by the value of the header "
        "metrics.tenant_header: {batch: {max_draft_tokens: 0}}.",
    )
    extra: dict[str, Any] = Field(
        default_factory=dict, description="Any other vLLM SpeculativeConfig field, passed through as is."
    )

    @property
    def longest_draft(self) -> int:
        """The most draft tokens a request may have verified in one step: k, or the tree's longest
        draft where the suffix mix is on (vLLM's num_speculative_tokens)."""
        return max(self.num_speculative_tokens, self.suffix.max_tokens if self.suffix.enabled else 0)

    @field_validator("method")
    @classmethod
    def _known_method(cls, method: str) -> str:
        methods = speculative_methods()
        if method not in methods:
            hint = did_you_mean(method, methods) or " (common: eagle3, eagle, ngram, draft_model, mtp, suffix)"
            raise ValueError(f"unknown method '{method}'{hint}")
        return method

    @field_validator("extra")
    @classmethod
    def _known_speculative_fields(cls, extra: dict[str, Any]) -> dict[str, Any]:
        typed = {"method", "model", "num_speculative_tokens", "num_speculative_tokens_per_batch_size",
                 "draft_tensor_parallel_size"}
        _check_passthrough(extra, speculative_field_names(), typed, "speculative")
        return extra


class MetricsSettings(_Section):
    enabled: bool = Field(True, description="false: /metrics serves only vLLM's own series (no dynamo_spec_*).")
    window_seconds: float = Field(60.0, gt=0, description="Trailing window of the acceptance gauges.")
    log_interval_seconds: float = Field(10.0, gt=0, description="Interval of the acceptance log line.")
    tenant_header: str | None = Field(
        None, description="Request header naming the tenant: labels request metrics and picks the "
        "speculative.tenants defaults.",
    )
    max_tenants: int = Field(20, ge=1, description="Distinct tenant label values; more fold into 'other'.")


class DrySettings(_Section):
    """The server's default DRY ("Don't Repeat Yourself") sequence-repetition control; a request overrides
    each field (``dry_multiplier``, ``dry_base``, ... top-level or in ``vllm_xargs``, llama.cpp's names).
    It penalises only the token that would extend a verbatim repeat of a sequence already in the
    context, by ``multiplier * base ** (length - allowed_length)``. Lossless under speculation: the
    target applies it at every verified position with that position's own context."""

    multiplier: float = Field(0.0, ge=0, description="Strength; 0 turns DRY off (llama.cpp suggests 0.8).")
    base: float = Field(dry.DEFAULT_BASE, ge=1, description="Growth of the penalty per token of repeat past "
                        "allowed_length.")
    allowed_length: int = Field(dry.DEFAULT_ALLOWED_LENGTH, ge=1, description="Longest repeat that goes unpenalised.")
    penalty_last_n: int = Field(dry.DEFAULT_PENALTY_LAST_N, ge=-1, description="Tokens of context scanned for "
                                "repeats; -1: all of it, 0: DRY off.")
    sequence_breakers: list[str] = Field(
        list(dry.DEFAULT_SEQUENCE_BREAKERS), description="A repeat never extends across a token containing one of these.")
    include_prompt: bool = Field(False, description="Also count repeats of the prompt (false: only the answer's, so "
                                 "an answer may quote its prompt).")

    @field_validator("sequence_breakers")
    @classmethod
    def _breakers_a_request_could_send(cls, value: list[str]) -> list[str]:
        """The request path's own rule (``dry.parse``): a default no request could send is refused here."""
        try:
            dry.parse({"dry_multiplier": 1.0, "dry_sequence_breakers": value})
        except ValueError as exc:
            raise ValueError(str(exc).replace("'dry_sequence_breakers' ", "")) from None
        return value

    def params(self) -> dry.DryParams:
        return dry.DryParams(self.multiplier, self.base, self.allowed_length, self.penalty_last_n,
                             tuple(self.sequence_breakers), self.include_prompt)


class SamplingSettings(_Section):
    dry: DrySettings = Field(default_factory=DrySettings)


class LearningSettings(_Section):
    """The draft that learns from the traffic it serves: capture (opt-in), learn, gate, swap."""

    capture: bool = Field(False, description="Keep every finished request's prompt and answer tokens (the users' "
                          "data: files 0600 under dir; DELETE /admin/learning/captures erases them).")
    dir: str = Field(".cache/learning", description="Where captures and learnt drafts are kept.")
    tenants: list[str] | None = Field(None, description="Capture only these tenants' requests; None: all.")
    max_bytes: ByteSize = Field(ByteSize(2 * 2**30), ge=1, description="Oldest captures dropped past this size.")
    retention_days: float | None = Field(30.0, gt=0, description="Captures older than this are dropped; None: kept.")
    min_gain: float = Field(0.05, ge=0, description="Gate: a new draft's held-out acceptance length must beat the "
                            "served draft's by at least this.")
    max_loss: float = Field(0.05, ge=0, description="Gate: it may lose at most this on the everyday evaluation set.")
    threads: int | None = Field(None, ge=1, description="CPU threads a learn cycle may use; None: half the cores.")
    auto: bool = Field(False, description="Run a learn cycle (learn-draft) in a child process every every_tokens "
                       "captured answer tokens and swap the draft when the gate promotes it (needs capture).")
    every_tokens: int = Field(200_000, ge=1, description="Captured answer tokens (this server's) between automatic "
                              "learn cycles.")
    max_in_flight: int = Field(4, ge=0, description="An automatic cycle starts only while fewer requests than this "
                               "are in flight (0: never).")
    learn_args: list[str] = Field(default_factory=list, description="Extra options of each automatic cycle's "
                                  "learn-draft, e.g. ['--steps', '200']; empty: its defaults.")

    @field_validator("learn_args")
    @classmethod
    def _learn_args_leave_the_config(cls, value: list[str]) -> list[str]:
        if any(a in ("--config", "-c") or a.startswith("--config=") for a in value):
            raise ValueError("the server gives learn-draft its own settings: leave --config out")
        return value


class Settings(BaseSettings):
    """Everything a deployment needs, in one model."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_DELIMITER, extra="forbid", validate_assignment=True
    )

    server: ServerSettings = Field(default_factory=ServerSettings)
    engine: EngineSettings
    speculative: SpeculativeSettings = Field(default_factory=SpeculativeSettings)
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    learning: LearningSettings = Field(default_factory=LearningSettings)

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource, *args: Any, **kwargs: Any
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # config_loader.load_settings layers file, environment and command line
        # itself (to record each value's source) and passes the result here.
        return (init_settings,)

    @model_validator(mode="after")
    def _draft_model_given(self) -> Settings:
        spec = self.speculative
        if spec.enabled and spec.method in DRAFT_MODEL_METHODS and not spec.model:
            raise ValueError(
                f"speculative.model: method '{spec.method}' needs a draft checkpoint: set speculative.model "
                "(or speculative.enabled: false to serve without speculation)"
            )
        return self

    @model_validator(mode="after")
    def _draft_budget_has_confidences(self) -> Settings:
        spec = self.speculative
        if spec.enabled and spec.draft_budget.enabled and spec.method not in CONFIDENCE_METHODS:
            raise ValueError(f"speculative.draft_budget: needs the draft's probabilities, which method "
                             f"'{spec.method}' does not give (use one of {', '.join(sorted(CONFIDENCE_METHODS))}, "
                             "or draft_budget.enabled: false)")
        return self

    @model_validator(mode="after")
    def _suffix_mix_has_an_eagle_draft(self) -> Settings:
        spec = self.speculative
        if spec.enabled and spec.suffix.enabled and spec.method not in SUFFIX_MIX_METHODS:
            raise ValueError(f"speculative.suffix: the tree's drafts are mixed with an EAGLE draft's, and method "
                             f"'{spec.method}' is not one (use eagle3, method suffix for the tree alone, "
                             "or suffix.enabled: false)")
        return self

    @model_validator(mode="after")
    def _tenant_header_given(self) -> Settings:
        if self.speculative.tenants and not self.metrics.tenant_header:
            raise ValueError("speculative.tenants: tenants are named by a request header: set "
                             "metrics.tenant_header (e.g. X-Tenant)")
        if "" in self.speculative.tenants:
            raise ValueError("speculative.tenants: a tenant's name (the header's value) cannot be empty")
        if self.learning.tenants and not self.metrics.tenant_header:
            raise ValueError("learning.tenants: tenants are named by a request header: set metrics.tenant_header")
        return self

    @model_validator(mode="after")
    def _automatic_learning_has_captures_and_a_draft(self) -> Settings:
        if not self.learning.auto:
            return self
        if not self.learning.capture:
            raise ValueError("learning.auto: automatic cycles learn from the captured traffic: set learning.capture: "
                             "true (or learning.auto: false)")
        spec = self.speculative
        if not (spec.enabled and spec.method == "eagle3" and spec.model):
            raise ValueError("learning.auto: a cycle fine-tunes the served EAGLE-3 draft: set speculative.method "
                             "eagle3 and speculative.model (or learning.auto: false)")
        return self

    @property
    def served_model_name(self) -> str:
        return self.server.served_model_name or self.engine.model
