"""Run phases of requests through an offline vLLM engine; print what came out.

A subprocess of tests/integration/test_zero_draft_steps.py (an engine of its own, with
the dynamo-spec vLLM plugin loaded as in a server): offline ``LLM.generate`` adds every
request of a phase before the first step, so the batch sizes, and with them the k the
schedule picks, are known exactly.

    python -m tests.integration.zero_draft_probe SPEC_JSON  ->  one JSON line on stdout

Also used by tests/integration/test_draft_caps.py (requests with ``max_draft_tokens``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run(spec: dict, env: dict | None = None) -> dict:
    """Run the probe in a subprocess (env added to this one's); what it printed."""
    proc = subprocess.run([sys.executable, "-m", "tests.integration.zero_draft_probe", json.dumps(spec)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("PROBE "):])


def drafts_counter(llm) -> float:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts")


def count_calls() -> dict:
    """Count the rejection sampler's and take_draft_token_ids' calls and keep every
    non-empty draft handed to the scheduler. Only meaningful with the engine in this
    process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the test)."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    calls: dict = {"rejection_sampler": 0, "take_draft_token_ids": 0, "drafts": []}
    sample, take = RejectionSampler.forward, GPUModelRunner.take_draft_token_ids

    def counting_sample(*args, **kwargs):
        calls["rejection_sampler"] += 1
        return sample(*args, **kwargs)

    def recording_take(self):
        calls["take_draft_token_ids"] += 1
        drafts = take(self)
        if drafts is not None:
            calls["drafts"] += [ids for ids in drafts.draft_token_ids if ids]
        return drafts

    RejectionSampler.forward = counting_sample
    GPUModelRunner.take_draft_token_ids = recording_take
    return calls


def skip_k0_draft_pass() -> None:
    """The control of the KV-cache test: k=0 steps write nothing to the draft's KV cache
    (what skipping the draft pass would do). In-process engine only."""
    from dynamo_spec.vllm_patches import zero_draft_steps

    zero_draft_steps._write_draft_kv = lambda *args, **kwargs: None


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    kwargs = dict(model=spec["target"], dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=256 << 20,
                  enforce_eager=not spec.get("compiled"), disable_log_stats=False, seed=0,
                  **({"max_num_batched_tokens": spec["max_num_batched_tokens"]}
                     if spec.get("max_num_batched_tokens") else {}))
    if spec.get("draft"):
        kwargs["speculative_config"] = {"method": "eagle3", "model": spec["draft"],
                                        "num_speculative_tokens": spec["k"],
                                        "num_speculative_tokens_per_batch_size": spec.get("schedule")}
        kwargs["per_request_spec_decode_metrics"] = "summary"
    if spec.get("switches") is not None:  # this project's switches of the engine (engine.args.engine_switches)
        kwargs["additional_config"] = {"dynamo_spec": spec["switches"]}
    llm = LLM(**kwargs)
    calls = count_calls() if spec.get("count_calls") else {}
    if spec.get("skip_k0_draft_pass"):
        skip_k0_draft_pass()
    phases = []
    for requests in spec["phases"]:
        before = drafts_counter(llm)
        calls_before = {name: calls[name] for name in ("rejection_sampler", "take_draft_token_ids")
                        if name in calls}
        params = [SamplingParams(max_tokens=r["max_tokens"], temperature=r.get("temperature", 0.0),
                                 seed=r.get("seed"), logprobs=r.get("logprobs"), ignore_eos=True,
                                 extra_args=({"max_draft_tokens": r["max_draft_tokens"]}
                                             if "max_draft_tokens" in r else None))
                  for r in requests]
        outputs = llm.generate([r["prompt"] for r in requests], params, use_tqdm=False)
        phases.append({
            "drafts": drafts_counter(llm) - before,
            "calls": {name: calls[name] - n for name, n in calls_before.items()},
            "outputs": [{"token_ids": list(o.outputs[0].token_ids),
                         "logprobs": [{str(t): lp.logprob for t, lp in step.items()}
                                      for step in (o.outputs[0].logprobs or [])],
                         "spec": (o.outputs[0].spec_decode_metrics.to_dict()
                                  if getattr(o.outputs[0], "spec_decode_metrics", None) else None)}
                        for o in outputs],
        })
    print("PROBE " + json.dumps({"phases": phases, "calls": calls}), flush=True)


if __name__ == "__main__":
    main()
