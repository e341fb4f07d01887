"""Run phases of requests through offline vLLM engines; print what came out.

A subprocess of tests/integration/test_zero_draft_steps.py (engines of its own, with the
dynamo-spec vLLM plugin loaded as in a server): offline ``LLM.generate`` adds every request of a
phase before the first step, so the batch sizes, and with them the k the schedule picks, are
known exactly. Given a list of specs, it runs one engine after another in this one process (each
engine's switches are its own, ``additional_config``): vLLM is imported once, not once per engine.

    python -m tests.integration.zero_draft_probe SPEC_JSON  ->  one JSON line on stdout
    (a spec: its result; a list of specs: the list of their results)

Also used by tests/integration/test_compile_cache.py (a compiled engine, one spec).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys


def run(spec: dict | list[dict], env: dict | None = None) -> dict | list[dict]:
    """Run the probe in a subprocess (env added to this one's); what it printed."""
    proc = subprocess.run([sys.executable, "-m", "tests.integration.zero_draft_probe", json.dumps(spec)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("PROBE "):])


def drafts_counter(llm) -> float:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts")


CALLS: dict = {}  # what count_calls counts, for the engine running now


def count_calls() -> dict:
    """Count the rejection sampler's and take_draft_token_ids' calls and keep every
    non-empty draft handed to the scheduler (installed once; the counts start again at each
    call). Only meaningful with the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
    set by the test)."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    CALLS.clear()
    CALLS.update({"rejection_sampler": 0, "take_draft_token_ids": 0, "drafts": []})
    if getattr(RejectionSampler.forward, "counting", False):
        return CALLS
    sample, take = RejectionSampler.forward, GPUModelRunner.take_draft_token_ids

    def counting_sample(*args, **kwargs):
        CALLS["rejection_sampler"] += 1
        return sample(*args, **kwargs)

    def recording_take(self):
        CALLS["take_draft_token_ids"] += 1
        drafts = take(self)
        if drafts is not None:
            CALLS["drafts"] += [ids for ids in drafts.draft_token_ids if ids]
        return drafts

    counting_sample.counting = True
    RejectionSampler.forward = counting_sample
    GPUModelRunner.take_draft_token_ids = recording_take
    return CALLS


@contextlib.contextmanager
def k0_draft_pass_skipped(skip: bool):
    """The control of the KV-cache test: k=0 steps write nothing to the draft's KV cache
    (what skipping the draft pass would do), while this engine runs. In-process engine only."""
    from dynamo_spec.vllm_patches import zero_draft_steps

    write = zero_draft_steps._write_draft_kv
    if skip:
        zero_draft_steps._write_draft_kv = lambda *args, **kwargs: None
    try:
        yield
    finally:
        zero_draft_steps._write_draft_kv = write


def probe(spec: dict) -> dict:
    """One engine from `spec`, its phases, shut down after."""
    from vllm import LLM

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
    try:
        calls = count_calls() if spec.get("count_calls") else {}
        with k0_draft_pass_skipped(spec.get("skip_k0_draft_pass", False)):
            phases = [run_phase(llm, requests, calls) for requests in spec["phases"]]
        return {"phases": phases, "calls": dict(calls)}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm


def run_phase(llm, requests: list[dict], calls: dict) -> dict:
    from vllm import SamplingParams

    before = drafts_counter(llm)
    calls_before = {name: calls[name] for name in ("rejection_sampler", "take_draft_token_ids") if name in calls}
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=r.get("temperature", 0.0),
                             seed=r.get("seed"), logprobs=r.get("logprobs"), ignore_eos=True,
                             extra_args=({"max_draft_tokens": r["max_draft_tokens"]}
                                         if "max_draft_tokens" in r else None))
              for r in requests]
    outputs = llm.generate([r["prompt"] for r in requests], params, use_tqdm=False)
    return {
        "drafts": drafts_counter(llm) - before,
        "calls": {name: calls[name] - n for name, n in calls_before.items()},
        "outputs": [{"token_ids": list(o.outputs[0].token_ids),
                     "logprobs": [{str(t): lp.logprob for t, lp in step.items()}
                                  for step in (o.outputs[0].logprobs or [])],
                     "spec": (o.outputs[0].spec_decode_metrics.to_dict()
                              if getattr(o.outputs[0], "spec_decode_metrics", None) else None)}
                    for o in outputs],
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    result = [probe(one) for one in spec] if isinstance(spec, list) else probe(spec)
    print("PROBE " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
