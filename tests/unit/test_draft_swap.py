"""The live draft swap without an engine (dynamo_spec/learning/swap.py): the checks that run before
anything is loaded, what GET /admin/draft says a draft is, its metrics, where it runs, and the
engine argument that brings its worker extension. The swap itself: tests/integration/test_draft_swap.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from dynamo_spec.config import eagle3_format
from dynamo_spec.config.settings import Settings
from dynamo_spec.engine import features
from dynamo_spec.engine.args import engine_kwargs
from dynamo_spec.engine.paths import EnginePath
from dynamo_spec.learning import swap
from dynamo_spec.serving.metrics import DynamoSpecMetrics
from support.tiny_models import build_eagle3_draft

pytestmark = pytest.mark.unit


def settings_for(models: dict[str, Path], draft: str = "never_draft", **spec) -> Settings:
    return Settings(engine={"model": str(models["fixed_target"])},
                    speculative={"method": "eagle3", "model": str(models[draft]), **spec})


def config_of(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


def copy(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    if changes:  # None: the key removed
        cfg = {k: v for k, v in {**config_of(dst), **changes}.items() if v is not None}
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def check(models, path, served="never_draft"):
    errors, _ = swap.check_draft(settings_for(models, served), config_of(models[served]), str(path), on_cpu=True)
    return errors


def test_a_draft_of_the_served_shape_passes(tiny_models):
    assert check(tiny_models, tiny_models["always_draft"]) == []
    assert check(tiny_models, tiny_models["partial_draft"]) == []


@pytest.mark.parametrize("make, words", [
    (lambda m, d: build_eagle3_draft(d, m["fixed_target"], aux_layer_ids=(0, 1, 2)),
     "reads the target's layers [0, 1, 2] but the engine feeds the draft layers [1, 2, 3]"),
    (lambda m, d: build_eagle3_draft(d, m["fixed_target"], draft_vocab_size=128),
     "its draft_vocab_size is 128 but the served draft's is 256"),
    (lambda m, d: copy(m["always_draft"], d, num_hidden_layers=2), "its num_hidden_layers is 2 but the served draft's is 1"),
    (lambda m, d: copy(m["always_draft"], d, intermediate_size=512), "its intermediate_size is 512"),
    (lambda m, d: copy(m["always_draft"], d, hidden_size=64, target_hidden_size=64),
     "was built for hidden size 64 but the target's is 128"),
    (lambda m, d: copy(m["always_draft"], d, vocab_size=1024), "vocabulary mismatch"),
    (lambda m, d: copy(m["always_draft"], d, architectures=["LlamaForCausalLM"], draft_vocab_size=None,
                       eagle_config=None), "is not an EAGLE-3 checkpoint"),
    (lambda m, d: d / "absent", "is not a directory"),
])
def test_a_draft_the_engine_cannot_take_is_named(tiny_models, tmp_path, make, words):
    errors = check(tiny_models, make(tiny_models, tmp_path / "bad"))
    assert len(errors) == 1 and words in errors[0], errors


def test_every_tensor_is_checked_from_the_headers(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    def edited(name: str, change) -> Path:
        d = copy(tiny_models["always_draft"], tmp_path / name)
        tensors = load_file(str(d / "model.safetensors"))
        change(tensors)
        save_file(tensors, str(d / "model.safetensors"))
        return d

    missing = edited("missing", lambda t: t.pop("midlayer.mlp.up_proj.weight"))
    assert check(tiny_models, missing) == [f"draft {missing}: it lacks the tensor midlayer.mlp.up_proj.weight"]
    down = "midlayer.mlp.down_proj.weight"
    wrong = edited("wrong", lambda t: t.update({down: t[down][:, :100].contiguous()}))
    assert check(tiny_models, wrong) == [f"draft {wrong}: its {down} is [128, 100] but the engine's draft takes [128, 256]"]
    short = edited("short", lambda t: t.update(d2t=t["d2t"][:100]))  # preflight's own check
    assert check(tiny_models, short) == [f"draft {short}: d2t has 100 entries but draft_vocab_size is 256"]
    extra = edited("extra", lambda t: t.update(mask_hidden=t["norm.weight"].clone()))
    assert check(tiny_models, extra) == [f"draft {extra}: its tensor mask_hidden is not one an EAGLE-3 draft of "
                                         "this shape has"]
    empty = copy(tiny_models["always_draft"], tmp_path / "empty")
    (empty / "model.safetensors").unlink()
    assert "it has no *.safetensors file" in " ".join(check(tiny_models, empty))


def test_names_of_the_speculators_format_are_ours():
    assert swap.checkpoint_name("layers.0.mlp.up_proj.weight") == "midlayer.mlp.up_proj.weight"
    assert swap.checkpoint_name("model.fc.weight") == "fc.weight"
    assert swap.checkpoint_name("lm_head.weight") == "lm_head.weight"


def test_a_full_vocabulary_draft_may_share_the_targets_lm_head(tiny_models):
    cfg = {**config_of(tiny_models["always_draft"]), "draft_vocab_size": 512}
    shapes = {name: list(shape) for name, shape in eagle3_format.tensor_shapes(cfg).items()}
    assert swap.tensor_problems(cfg, shapes) == []
    del shapes["lm_head.weight"]  # vLLM then shares the target's; the worker checks which one it serves
    assert swap.tensor_problems(cfg, shapes) == []


def test_the_engines_draft_config_has_the_structure_of_its_config_json(tiny_models):
    """The served shape comes from the config vLLM built (its EAGLEConfig), the new draft's from its
    config.json: both through ``structure``, they agree for the same draft."""
    from dynamo_spec.engine.args import build_vllm_config

    vllm_config = build_vllm_config(settings_for(tiny_models))
    engine = SimpleNamespace(vllm_config=vllm_config)
    assert swap.structure(swap._engine_draft_config(engine)) == swap.structure(config_of(tiny_models["never_draft"]))


def test_version_and_gate_figures_come_from_a_manifest_else_a_hash(tiny_models, tmp_path):
    d = copy(tiny_models["always_draft"], tmp_path / "v1")
    plain = swap.describe(str(d), "swap")
    assert plain.version.startswith("sha256:") and plain.gate is None and plain.path == str(d.resolve())
    assert swap.describe(str(copy(d, tmp_path / "same")), "swap").version == plain.version
    other = copy(tiny_models["never_draft"], tmp_path / "other")
    assert swap.describe(str(other), "swap").version != plain.version
    # learn-draft's figures beside the draft: its own manifest, or its entry in the parent's
    (d / "manifest.json").write_text(json.dumps({"version": "v1", "gate": {"promoted": True, "heldout_al_after": 2.2}}))
    described = swap.describe(str(d), "swap")
    assert (described.version, described.gate) == ("v1", {"promoted": True, "heldout_al_after": 2.2})
    (tmp_path / "manifest.json").write_text(json.dumps({"versions": [
        {"version": "other", "path": "other", "promoted": False, "heldout_al_before": 2.0, "heldout_al_after": 2.01}]}))
    described = swap.describe(str(other), "swap")
    assert described.version == "other"
    assert described.gate == {"promoted": False, "heldout_al_before": 2.0, "heldout_al_after": 2.01}
    assert described.as_json()["loaded_at"].endswith("Z")


def test_the_draft_info_series_follows_the_swap_and_the_windows_restart():
    registry = CollectorRegistry()
    metrics = DynamoSpecMetrics(registry, model="m", draft_model="d", method="eagle3", num_speculative_tokens=3,
                                version="test")
    metrics.record_draft("/drafts/a", "sha256:a")
    metrics.record_step(drafts=4, draft_tokens=12, accepted=0, accepted_per_pos=[0, 0, 0])
    assert registry.get_sample_value("dynamo_spec_window_drafts", {"model": "m"}) == 4
    metrics.record_draft("/drafts/b", "v2")
    info = {s.labels["path"]: s.value for f in registry.collect() if f.name == "dynamo_spec_draft_info" for s in f.samples}
    assert info == {"/drafts/b": 1.0}
    assert registry.get_sample_value("dynamo_spec_window_drafts", {"model": "m"}) == 0  # restarted
    assert registry.get_sample_value("dynamo_spec_drafts_total", {"model": "m"}) == 4  # counters run on
    metrics.record_step(drafts=2, draft_tokens=6, accepted=6, accepted_per_pos=[2, 2, 2])
    assert registry.get_sample_value("dynamo_spec_acceptance_rate", {"model": "m"}) == 1.0


def test_the_swap_runs_on_the_v1_runner_and_is_refused_on_v2_only_when_asked(tiny_models):
    v1, v2 = EnginePath(False, False, "test"), EnginePath(True, True, "test")
    assert features.unavailable(features.DRAFT_SWAP, v1, ()) is None
    assert "needs the V1 model runner" in features.unavailable(features.DRAFT_SWAP, v2, ())
    # An admin action: never a reason to refuse to start.
    assert features.refusals(settings_for(tiny_models), v2, []) == []
    assert "| live draft swap | the V1 EAGLE proposer | yes | refused |" in features.readme_table()


def test_the_engine_gets_the_worker_extension_with_an_eagle3_draft(tiny_models):
    assert engine_kwargs(settings_for(tiny_models))["worker_extension_cls"] == swap.EXTENSION
    off = Settings(engine={"model": "t"}, speculative={"enabled": False})
    assert "worker_extension_cls" not in engine_kwargs(off)
    ngram = Settings(engine={"model": "t"}, speculative={"method": "ngram"})
    assert "worker_extension_cls" not in engine_kwargs(ngram)
    taken = Settings(engine={"model": "t", "extra": {"worker_extension_cls": "my.Ext"}},
                     speculative={"model": "d"})
    with pytest.raises(ValueError, match="engine.extra.worker_extension_cls"):
        engine_kwargs(taken)


def test_the_extension_adds_nothing_the_worker_already_has():
    """vLLM refuses an extension attribute its worker class has (v1/worker/worker_base.py)."""
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    added = [name for name in vars(swap.DraftSwapExtension) if not name.startswith("__")]
    assert added == [swap.WORKER_METHOD, "dynamo_spec_suffix_clear", "dynamo_spec_suffix_stats"]  # + the suffix trees
    assert not any(hasattr(worker, name) for worker in (Worker, CPUWorker) for name in added)


def test_the_route_answers_before_any_engine_work(tiny_models):
    """What /admin/draft answers without loading anything: a body without a path, no engine yet, an
    engine on Model Runner V2 (one line, 501: the server serves on), no EAGLE-3 draft."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from dynamo_spec.learning import draft_admin

    app = FastAPI()
    app.include_router(draft_admin.router(settings_for(tiny_models), None))
    app.state.engine = None
    http = TestClient(app)
    assert http.get("/admin/draft").json()["path"] == str(tiny_models["never_draft"].resolve())
    r = http.post("/admin/draft", json={"dir": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "path"
    assert http.post("/admin/draft", json={"path": str(tiny_models["always_draft"])}).status_code == 503
    v2 = SimpleNamespace(use_v2_model_runner=True, scheduler_config=SimpleNamespace(async_scheduling=True))
    app.state.engine = SimpleNamespace(vllm_config=v2)
    r = http.post("/admin/draft", json={"path": str(tiny_models["always_draft"])})
    assert r.status_code == 501 and "VLLM_USE_V2_MODEL_RUNNER=0" in r.json()["error"]["message"]
    off = FastAPI()
    off.include_router(draft_admin.router(Settings(engine={"model": "t"}, speculative={"enabled": False}), None))
    assert TestClient(off).get("/admin/draft").status_code == 404
