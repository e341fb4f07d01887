"""`dynamo-spec bench --together 0` (the GPU default: one server at a time) end to end on the tiny
fixtures. Its own module, so the suite's two workers can run it beside the side-by-side run
(tests/integration/test_bench.py)."""

from __future__ import annotations

import pytest

from tests.integration.test_bench import run_bench

pytestmark = pytest.mark.integration


def test_one_server_at_a_time_the_gpu_default(tiny_models, tmp_path):
    """--together 0: k=0 first, each server alone, the schedule, k=0 again; speed-ups against the
    first k=0 server, the noise between the first and the last. k=1 and the speculative engine at
    k=0 on one server, the second column's requests capped at 0 draft tokens: five servers for six
    columns. A config without a schedule of its own (its column is test_bench.py's): one server fewer."""
    result, out, stdout = run_bench(tiny_models, tmp_path, [0, 1], [1], "--together", "0", configured=None)
    cols = result["columns"]
    assert result["servers"] == {"mode": "sequential"}
    # k=1 and the speculative engine at k=0 measured: the cost of a verified draft token, and the budget's column
    assert list(cols) == ["k=0", "k=1", "k=0 (speculative engine)", "schedule", "confidence budget", "k=0 (repeat)"]
    shared, capped = cols["k=1"], cols["k=0 (speculative engine)"]
    assert capped["max_draft_tokens"] == 0 and "max_draft_tokens" not in shared
    assert capped["overrides"] == shared["overrides"] and capped["server_ready_s"] == shared["server_ready_s"]
    assert len(list((out / "logs").glob("*.log"))) == 5
    for cell in capped["cells"]["judge"].values():  # capped at 0: the steps of a speculative engine without drafts
        assert cell["drafts"] == 0 and cell["acceptance_rate"] is None
    assert [c for c, _ in result["derived"]["draft_token_cost"]] == [1]
    budget = cols["confidence budget"]["cells"]["judge"]["1"]
    assert 0 < budget["budget"]["admitted"] <= budget["budget"]["drafted"]
    assert budget["draft_tokens"] <= budget["budget"]["admitted"]  # vLLM verified what the budget admitted, less drops
    assert "## Confidence budget" in (out / "bench.md").read_text()
    assert not any("reference" in col for col in cols.values())
    for col in cols.values():
        for split, cells in col["cells"].items():
            for c, cell in cells.items():
                assert cell["failed"] == 0 and cell["requests"] == max(4, 2 * int(c)), cell["errors"]
                base = cols["k=0"]["cells"][split][c]["output_tokens_per_s"]
                assert cell["speedup"] == pytest.approx(cell["output_tokens_per_s"] / base)
    for cell in cols["k=1"]["cells"]["judge"].values():  # the partial draft: its first position only
        assert cell["acceptance_rate"] == pytest.approx(1.0) and cell["mean_acceptance_length"] == pytest.approx(2.0)
    for c, v in result["verdict"].items():
        first = cols["k=0"]["cells"]["judge"][c]["output_tokens_per_s"]
        again = cols["k=0 (repeat)"]["cells"]["judge"][c]["output_tokens_per_s"]
        assert v["noise"] == pytest.approx(abs(first - again) / ((first + again) / 2))
    assert "one at a time" in (out / "bench.md").read_text() and result["recommendation"] in stdout
