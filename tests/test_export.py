"""Drafter exports for SGLang and vLLM: round trips, and names/ids against the pinned engine sources.

The engine checks execute the real functions from the pinned wheels (sglang==0.5.23,
vllm==0.33.0), downloaded with ``pip download --no-deps`` and never installed: SGLang's
``set_eagle3_layers_to_capture`` and ``LlamaForCausalLMEagle3.load_weights``, vLLM's
speculators config reader ``update_eagle3``. Only the module they are bound to is a
stand-in: a namespace holding the attributes those functions touch.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import typing
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eaglenest.stages import export
from eaglenest.formats import vocab
from eaglenest.model.drafter import Eagle3Drafter, build_drafter

SGLANG = "sglang==0.5.23"
VLLM = "vllm==0.33.0"
SGLANG_MEMBERS = [
    "sglang/srt/models/llama_eagle3.py",
    "sglang/srt/models/llama.py",
    "sglang/srt/models/qwen2.py",
    "sglang/srt/models/deepseek_v2.py",
    "sglang/srt/models/kimi_k25.py",
]
VLLM_MEMBERS = [
    "vllm/model_executor/models/llama_eagle3.py",
    "vllm/transformers_utils/configs/speculators/algos.py",
]
TINY_AUX_LAYERS = [2, 3, 4]  # the default [2, N//2, N-3] of the 7-layer tiny targets


def _pinned_sources(requirement: str, members: list[str]) -> Path:
    """Unpack ``members`` of a pinned wheel into a cache, downloading the wheel once."""
    cache = Path(os.environ.get("EAGLENEST_PINNED_SOURCES", Path.home() / ".cache" / "eaglenest" / "pinned-sources"))
    root = cache / requirement.replace("==", "-")
    if all((root / m).exists() for m in members):
        return root
    wheel_dir = cache / "wheels"
    wheels = sorted(wheel_dir.glob(requirement.split("==")[0] + "-" + requirement.split("==")[1] + "-*.whl"))
    if not wheels:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(wheel_dir), requirement],
            capture_output=True,
            text=True,
        )
        wheels = sorted(wheel_dir.glob(requirement.split("==")[0] + "-*.whl"))
        if result.returncode != 0 or not wheels:
            pytest.skip(f"cannot fetch the {requirement} wheel: {result.stderr[-500:]}")
    with zipfile.ZipFile(wheels[0]) as archive:
        for member in members:
            target = root / member
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.read(member))
    return root


@pytest.fixture(scope="session")
def sglang_source() -> Path:
    return _pinned_sources(SGLANG, SGLANG_MEMBERS)


@pytest.fixture(scope="session")
def vllm_source() -> Path:
    return _pinned_sources(VLLM, VLLM_MEMBERS)


def _class_method(path: Path, class_name: str, method: str) -> ast.FunctionDef:
    """A method's AST from a source file, following base classes defined in the same file."""
    classes = {n.name: n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)}
    name = class_name
    while name in classes:
        for node in classes[name].body:
            if isinstance(node, ast.FunctionDef) and node.name == method:
                return node
        bases = [b.id for b in classes[name].bases if isinstance(b, ast.Name) and b.id in classes]
        name = bases[0] if bases else None
    raise LookupError(f"{class_name}.{method} not found in {path}")


def _compile_function(node: ast.FunctionDef, namespace: dict):
    node = ast.fix_missing_locations(ast.Module(body=[node], type_ignores=[]))
    scope = {**vars(typing), "torch": torch, **namespace}
    exec(compile(node, "<pinned source>", "exec"), scope)
    return scope[node.body[0].name]


def _sglang_capture(sglang_source: Path, architecture: str, num_layers: int, ids: list[int]) -> list[int]:
    """Run the pinned set_eagle3_layers_to_capture of ``architecture``; the layers it captures."""
    files = {
        "LlamaForCausalLM": "llama.py",
        "Qwen2ForCausalLM": "qwen2.py",
        "DeepseekV3ForCausalLM": "deepseek_v2.py",
        "KimiK25ForConditionalGeneration": "kimi_k25.py",
    }
    path = sglang_source / "sglang/srt/models" / files[architecture]
    function = _compile_function(_class_method(path, architecture, "set_eagle3_layers_to_capture"), {})
    model = SimpleNamespace(
        pp_group=SimpleNamespace(is_last_rank=True),
        config=SimpleNamespace(num_hidden_layers=num_layers),
        model=SimpleNamespace(layers_to_capture=[]),
    )
    if architecture == "KimiK25ForConditionalGeneration":
        # Kimi-K2.5 hands the ids to its DeepseekV3 language model.
        inner = model
        deepseek = sglang_source / "sglang/srt/models/deepseek_v2.py"
        inner_fn = _compile_function(_class_method(deepseek, "DeepseekV3ForCausalLM", "set_eagle3_layers_to_capture"), {})
        model = SimpleNamespace(language_model=inner)
        inner.set_eagle3_layers_to_capture = lambda layer_ids=None: inner_fn(inner, layer_ids)
        function(model, ids)
        return inner.model.layers_to_capture
    function(model, ids)
    # SGLang captures the residual stream entering each listed layer: HF hidden_states[i].
    return model.model.layers_to_capture


# ------------------------------------------------------------------ a tiny trained-looking drafter


def _random_drafter(target_dir: Path, seed: int = 0) -> Eagle3Drafter:
    config = json.loads((target_dir / "config.json").read_text())
    generator = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 50, (config["vocab_size"],), generator=generator)
    d2t, t2d = vocab.build_draft_vocab(counts, draft_vocab_size=96)
    drafter = build_drafter(target_dir, {"d2t": d2t, "t2d": t2d}, TINY_AUX_LAYERS, target_name="tiny", seed=seed)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name != "embed_tokens.weight":  # the frozen copy of the target's stays the target's
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2 + (1.0 if "norm" in name else 0.0))
    return drafter


@pytest.fixture(scope="module")
def drafter_dir(tiny_llama, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("drafter")
    _random_drafter(tiny_llama).save(directory)
    return directory


def _inputs(drafter: Eagle3Drafter, length: int = 12, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, drafter.config.vocab_size, (2, length), generator=generator)
    aux = torch.randn(2, length, 3 * drafter.config.target_hidden_size, generator=generator)
    return ids, aux


def _logits_two_steps(drafter: Eagle3Drafter, ids, aux) -> torch.Tensor:
    """Logits of a plain step and of a step that feeds its own hidden state back."""
    with torch.no_grad():
        logits, hidden = drafter(ids, aux)
        logits_fed_back, _ = drafter(ids.roll(-1, dims=1), hidden)
    return torch.stack([logits, logits_fed_back])


def _export(kind: str, drafter_dir: Path, target: Path, out: Path, **kwargs) -> Path:
    drafter = Eagle3Drafter.from_checkpoint(drafter_dir)
    identity = export.target_identity(target, "tiny")
    dtype = kwargs.pop("dtype", torch.float32)
    writer = export.write_sglang_export if kind == "sglang" else export.write_vllm_export
    return writer(out, drafter.state_dict(), drafter.config.to_dict(), identity, dtype=dtype, **kwargs)


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_fp32_export_loads_back_with_identical_logits(kind, drafter_dir, tiny_llama, tmp_path):
    original = Eagle3Drafter.from_checkpoint(drafter_dir)
    out = _export(kind, drafter_dir, tiny_llama, tmp_path / kind)
    reloaded = export.drafter_from_export(out, tiny_llama)
    assert reloaded.config == original.config
    ids, aux = _inputs(original)
    assert torch.equal(_logits_two_steps(reloaded, ids, aux), _logits_two_steps(original, ids, aux))


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_bf16_export_equals_the_drafter_with_bf16_rounded_weights(kind, drafter_dir, tiny_llama, tmp_path):
    original = Eagle3Drafter.from_checkpoint(drafter_dir)
    out = _export(kind, drafter_dir, tiny_llama, tmp_path / kind, dtype=torch.bfloat16)
    reloaded = export.drafter_from_export(out, tiny_llama)
    rounded = Eagle3Drafter.from_checkpoint(drafter_dir)
    with torch.no_grad():
        for name, param in rounded.named_parameters():
            if name != "embed_tokens.weight":  # left out of the export, taken from the target as is
                param.copy_(param.to(torch.bfloat16).float())
    ids, aux = _inputs(original)
    assert torch.equal(_logits_two_steps(reloaded, ids, aux), _logits_two_steps(rounded, ids, aux))
    # ...and the rounding is visible, so the comparison above is not vacuous.
    assert not torch.equal(_logits_two_steps(reloaded, ids, aux), _logits_two_steps(original, ids, aux))


def test_embedding_is_left_out_unless_asked_and_then_round_trips(drafter_dir, tiny_llama, tmp_path):
    from safetensors import safe_open

    lean = _export("vllm", drafter_dir, tiny_llama, tmp_path / "lean")
    full = _export("vllm", drafter_dir, tiny_llama, tmp_path / "full", include_embed_tokens=True)
    with safe_open(str(lean / "model.safetensors"), "pt") as f:
        assert "embed_tokens.weight" not in f.keys()
    with safe_open(str(full / "model.safetensors"), "pt") as f:
        assert "embed_tokens.weight" in f.keys()
    with pytest.raises(ValueError, match="pass the target directory"):
        export.read_export(lean)
    _, tensors = export.read_export(full)
    assert torch.equal(tensors["embed_tokens.weight"], Eagle3Drafter.from_checkpoint(drafter_dir).embed_tokens.weight)


def test_vllm_export_uses_layers_0_names_and_writes_norm_before_residual_false(drafter_dir, tiny_llama, tmp_path):
    from safetensors import safe_open

    out = _export("vllm", drafter_dir, tiny_llama, tmp_path / "vllm")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "layers.0.self_attn.q_proj.weight" in names and not any(n.startswith("midlayer.") for n in names)
    config = json.loads((out / "config.json").read_text())
    assert config["norm_before_residual"] is False
    assert config["eagle_aux_hidden_state_layer_ids"] == TINY_AUX_LAYERS


def test_export_refuses_a_state_dict_with_missing_or_unknown_tensors(drafter_dir, tiny_llama, tmp_path):
    drafter = Eagle3Drafter.from_checkpoint(drafter_dir)
    identity = export.target_identity(tiny_llama, "tiny")
    state = drafter.state_dict()
    broken = {k: v for k, v in state.items() if k != "fc.weight"}
    with pytest.raises(ValueError, match="lacks.*fc.weight"):
        export.write_sglang_export(tmp_path / "a", broken, drafter.config.to_dict(), identity)
    with pytest.raises(ValueError, match="no export format knows"):
        export.write_vllm_export(tmp_path / "b", {**state, "midlayer.extra": state["norm.weight"]},
                                 drafter.config.to_dict(), identity)


def test_export_drafter_writes_both_formats_and_a_report(drafter_dir, tiny_llama, tmp_path):
    report = export.export_drafter(drafter_dir, tiny_llama, "tiny", tmp_path / "sglang", tmp_path / "vllm",
                                   tmp_path / "report.json")
    assert json.loads((tmp_path / "report.json").read_text()) == report
    assert report["sglang"]["captures_hf_layers"] == TINY_AUX_LAYERS
    # Llama's SGLang hook adds one to every id.
    assert report["sglang"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in TINY_AUX_LAYERS]
    for kind in ("sglang", "vllm"):
        assert export.drafter_from_export(tmp_path / kind, tiny_llama).config.aux_layer_ids == TINY_AUX_LAYERS


# ------------------------------------------------------------------ against the pinned SGLang source


@pytest.mark.integration
@pytest.mark.parametrize(
    "architecture, num_layers, hf_ids",
    [
        ("LlamaForCausalLM", 30, [2, 15, 27]),  # SmolLM2-135M
        ("Qwen2ForCausalLM", 6, TINY_AUX_LAYERS),
        ("DeepseekV3ForCausalLM", 61, [2, 30, 58]),
        ("KimiK25ForConditionalGeneration", 61, [2, 30, 58]),  # Kimi-K2.5 default
        ("KimiK25ForConditionalGeneration", 61, [3, 30, 58]),  # first id not 1 after translation
    ],
)
def test_sglang_config_ids_make_pinned_sglang_capture_our_hf_layers(sglang_source, architecture, num_layers, hf_ids):
    shape = {"aux_layer_ids": hf_ids}
    config = export.sglang_config(
        {**_shape_stub(), **shape}, {"name": "t", "architecture": architecture, "name_or_path": "t"}, torch.bfloat16
    )
    ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert _sglang_capture(sglang_source, architecture, num_layers, ids) == hf_ids


@pytest.mark.integration
def test_passing_hf_ids_untranslated_to_pinned_sglang_llama_would_shift_every_layer(sglang_source):
    # The pitfall the translation exists for: HF ids given as is capture the next layers.
    assert _sglang_capture(sglang_source, "LlamaForCausalLM", 30, [2, 15, 27]) == [3, 16, 28]


def _shape_stub() -> dict:
    return dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                rms_norm_eps=1e-6, max_position_embeddings=2048, rope_theta=10000.0, vocab_size=320,
                draft_vocab_size=96, target_hidden_size=64)


@pytest.mark.integration
@pytest.mark.parametrize("with_embedding", [False, True])
def test_pinned_sglang_load_weights_fills_every_drafter_parameter(sglang_source, drafter_dir, tiny_llama, tmp_path,
                                                                  with_embedding):
    out = _export("sglang", drafter_dir, tiny_llama, tmp_path / "sglang")
    _, tensors = export.read_export(out, tiny_llama)
    if not with_embedding:
        del tensors["embed_tokens.weight"]  # not in the export: SGLang sets the target's embedding
    # Parameter names of SGLang's LlamaForCausalLMEagle3 module tree (llama_eagle3.py):
    # model.{embed_tokens,fc,layers.0.*,norm} and lm_head, q/k/v and gate/up fused.
    loaded: dict[str, list] = {}

    def recorder(name):
        def weight_loader(param, weight, shard_id=None):
            loaded.setdefault(name, []).append((shard_id, tuple(weight.shape)))
        return weight_loader

    names = ["model.embed_tokens.weight", "model.fc.weight", "model.norm.weight", "lm_head.weight"] + [
        f"model.layers.0.{n}.weight"
        for n in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj",
                  "input_layernorm", "post_attention_layernorm", "hidden_norm")
    ]
    params = {name: SimpleNamespace(weight_loader=recorder(name)) for name in names}
    model = SimpleNamespace(named_parameters=lambda: params.items(), hot_token_id=None)
    path = sglang_source / "sglang/srt/models/llama_eagle3.py"
    load_weights = _compile_function(_class_method(path, "LlamaForCausalLMEagle3", "load_weights"),
                                     {"default_weight_loader": None})
    load_weights(model, tensors.items())

    # An export with the embedding (add-embedding) loads it too; the draft worker then sets the
    # target's over it either way (srt/speculative/eagle_worker_v2.py:363 in the pinned 0.5.23, :329 in 0.5.14).
    assert set(loaded) == set(names) - (set() if with_embedding else {"model.embed_tokens.weight"})
    assert sorted(s for s, _ in loaded["model.layers.0.self_attn.qkv_proj.weight"]) == ["k", "q", "v"]
    assert sorted(s for s, _ in loaded["model.layers.0.mlp.gate_up_proj.weight"]) == [0, 1]
    assert loaded["model.fc.weight"] == [(None, tuple(tensors["fc.weight"].shape))]
    # d2t holds offsets: SGLang's hot token ids must be the draft vocab's target ids.
    assert torch.equal(model.hot_token_id, vocab.draft_to_target(tensors["d2t"]))


# ------------------------------------------------------------------ against the pinned vLLM source


@pytest.mark.integration
def test_pinned_vllm_reads_our_speculators_config_as_an_hf_id_llama_eagle3(vllm_source, drafter_dir, tiny_llama, tmp_path):
    out = _export("vllm", drafter_dir, tiny_llama, tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    path = vllm_source / "vllm/transformers_utils/configs/speculators/algos.py"
    tree = ast.parse(path.read_text())
    update = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "update_eagle3")
    update.decorator_list = []
    update_eagle3 = _compile_function(update, {})
    pre_trained = dict(config["transformer_layer_config"])
    update_eagle3(config_dict=config, pre_trained_config=pre_trained)
    assert pre_trained["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert pre_trained["norm_before_residual"] is False
    assert pre_trained["eagle_aux_hidden_state_layer_ids"] == TINY_AUX_LAYERS
    assert pre_trained["draft_vocab_size"] == 96


@pytest.mark.integration
def test_vllm_export_names_fit_the_pinned_vllm_eagle3_loader(vllm_source, drafter_dir, tiny_llama, tmp_path):
    from safetensors import safe_open

    out = _export("vllm", drafter_dir, tiny_llama, tmp_path / "vllm")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    source = (vllm_source / "vllm/model_executor/models/llama_eagle3.py").read_text()
    # vLLM's Eagle3LlamaForCausalLM.load_weights: d2t -> draft_id_to_target_id, t2d skipped,
    # everything but lm_head under "model."; the layer names are those of its decoder layer.
    assert 'name.replace("d2t", "draft_id_to_target_id")' in source and '"t2d" in name' in source
    for stacked in (".q_proj", ".k_proj", ".v_proj", ".gate_proj", ".up_proj"):
        assert f'"{stacked}": (' in source
    layer = {n.removeprefix("layers.0.") for n in names if n.startswith("layers.0.")}
    assert layer == {
        "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    }
    assert names - {f"layers.0.{n}" for n in layer} == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}


# ------------------------------------------------------------------ the Snakemake rule


@pytest.mark.workflow
def test_export_rule_writes_both_exports_from_a_trained_drafter_directory(drafter_dir, tiny_llama, tmp_path):
    import shutil

    from conftest import run_snakemake, synthetic_conversations, tiny_workflow_config

    conversations = synthetic_conversations(tmp_path / "conversations.json", 4)
    configfile = tiny_workflow_config(tmp_path, tiny_llama, conversations, export={"dtype": "float32"})
    # The trained drafter where rule train puts it; only the export rule may run.
    shutil.copytree(drafter_dir, tmp_path / "results" / "tiny" / "train" / "drafter")
    run_snakemake(
        tmp_path, configfile, "--cores", "1", "--allowed-rules", "export_drafter",
        "--", "results/tiny/export/export_report.json",
    )
    report = json.loads((tmp_path / "results" / "tiny" / "export" / "export_report.json").read_text())
    assert report["dtype"] == "float32" and report["sglang"]["captures_hf_layers"] == TINY_AUX_LAYERS
    original = Eagle3Drafter.from_checkpoint(drafter_dir)
    ids, aux = _inputs(original)
    for kind in ("sglang", "vllm"):
        reloaded = export.drafter_from_export(tmp_path / "results" / "tiny" / "export" / kind, tiny_llama)
        assert torch.equal(_logits_two_steps(reloaded, ids, aux), _logits_two_steps(original, ids, aux))
    assert (tmp_path / "logs" / "tiny" / "export.log").exists()


def test_auto_writes_the_embedding_of_a_small_target_and_the_report_names_each_consumer(drafter_dir, tiny_llama, tmp_path):
    # Kimi-K2.5's embedding in bf16 is over the limit, SmolLM2's is under it.
    assert not export.resolve_include_embed_tokens("auto", 163840, 7168, torch.bfloat16)
    assert export.resolve_include_embed_tokens("auto", 49152, 576, torch.bfloat16)
    with pytest.raises(ValueError, match="true, false or auto"):
        export.resolve_include_embed_tokens("yes", 10, 10, torch.bfloat16)
    report = export.export_drafter(drafter_dir, tiny_llama, "tiny", tmp_path / "sglang", tmp_path / "vllm",
                                   tmp_path / "report.json")
    assert report["include_embed_tokens"] is True
    from safetensors.torch import load_file

    assert "embed_tokens.weight" in load_file(str(tmp_path / "sglang" / "model.safetensors"))
    assert report["consumers"]["eagle_reference"].startswith("loads as it is")
    lean = export.export_drafter(drafter_dir, tiny_llama, "tiny", tmp_path / "s2", tmp_path / "v2",
                                 tmp_path / "r2.json", include_embed_tokens=False)
    assert lean["consumers"]["eagle_reference"].startswith("needs include_embed_tokens: true")


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_add_embedding_writes_the_targets_into_an_export_and_changes_nothing_else(kind, drafter_dir, tiny_llama, tmp_path):
    from safetensors.torch import load_file

    from eaglenest import cli
    from eaglenest.target_model.weights import load_target_rows

    lean = _export(kind, drafter_dir, tiny_llama, tmp_path / "lean", dtype=torch.bfloat16)
    before = load_file(str(lean / "model.safetensors"))
    config_before = (lean / "config.json").read_bytes()
    assert "embed_tokens.weight" not in before
    assert cli.main(["add-embedding", str(lean), "--target", str(tiny_llama), "--out", str(tmp_path / "full")]) == 0
    after = load_file(str(tmp_path / "full" / "model.safetensors"))
    assert (tmp_path / "full" / "config.json").read_bytes() == config_before
    assert set(after) == set(before) | {"embed_tokens.weight"}
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())
    embed = after["embed_tokens.weight"]
    assert embed.dtype == torch.bfloat16
    assert torch.equal(embed, load_target_rows(tiny_llama, "embed").to(torch.bfloat16))
    # The export with the embedding reads back without the target, as the one without it did with it.
    assert torch.equal(export.drafter_from_export(tmp_path / "full").embed_tokens.weight,
                       export.drafter_from_export(lean, tiny_llama).embed_tokens.weight.to(torch.bfloat16).float())
    # In place; a second time is refused with the export untouched.
    export.add_embed_tokens(lean, tiny_llama)
    assert torch.equal(load_file(str(lean / "model.safetensors"))["embed_tokens.weight"], embed)
    with pytest.raises(ValueError, match="already holds"):
        export.add_embed_tokens(lean, tiny_llama)


def test_add_embedding_refuses_another_targets_embedding_and_leaves_the_export(drafter_dir, tiny_llama, tmp_path):
    lean = _export("sglang", drafter_dir, tiny_llama, tmp_path / "lean", dtype=torch.bfloat16)
    before = (lean / "model.safetensors").read_bytes()
    config = json.loads((lean / "config.json").read_text())
    config["vocab_size"] += 1  # as if the export were a larger target's
    (lean / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="another target"):
        export.add_embed_tokens(lean, tiny_llama)
    assert (lean / "model.safetensors").read_bytes() == before
