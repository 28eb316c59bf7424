"""The SGLang patch against the pinned sglang source, without importing sglang.

sglang cannot be installed here (it pins torch 2.14.1 and GBs of CUDA kernels), but its
wheel downloads without dependencies. These tests read its source: every symbol the
patch replaces exists with the signature the replacement copies, the launcher's flags
exist, and the pinned functions that decide layer ids and hidden-state rows are
executed on CPU against our own functions.
"""

from __future__ import annotations

import __future__
import ast
import enum
import functools
import os
import subprocess
import sys
import typing
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from conftest import REPO
from eaglenest.target_model import layer_ids
from eaglenest.sglang import launch as sglang_launch, patch as sglang_patch, spool

CACHE = Path(os.environ.get("EAGLENEST_CACHE", Path.home() / ".cache" / "eaglenest")) / "wheels"


@functools.lru_cache(maxsize=None)
def _sglang_source(version: str, root: Path) -> Path:
    """The package source of sglang ``version`` (wheel downloaded once, cached)."""
    pattern = f"sglang-{version}-*.whl"
    wheels = sorted(CACHE.glob(pattern))
    if not wheels:
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(CACHE), f"sglang=={version}"],
            check=True,
        )
        wheels = sorted(CACHE.glob(pattern))
    root = root / version
    with zipfile.ZipFile(wheels[0]) as archive:
        archive.extractall(root, [name for name in archive.namelist() if name.startswith("sglang/") and name.endswith(".py")])
    return root / "sglang"


@pytest.fixture(scope="session")
def sglang_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sglang-src")


@pytest.fixture(scope="session")
def sglang_src(sglang_root) -> Path:
    """The pinned (production) sglang source."""
    return _sglang_source(sglang_patch.SGLANG_VERSION, sglang_root)


@pytest.fixture(scope="session")
def sglang_0514_src(sglang_root) -> Path:
    """sglang 0.5.14, the release that runs on the H200 image's torch 2.11."""
    return _sglang_source("0.5.14", sglang_root)


@pytest.fixture(scope="session", params=sglang_patch.SUPPORTED_SGLANG_VERSIONS)
def any_sglang_src(request, sglang_root) -> Path:
    return _sglang_source(request.param, sglang_root)


def module_file(src: Path, module: str) -> Path:
    return src.parent / (module.replace(".", "/") + ".py")


def find_node(tree: ast.Module, attr_path: str):
    """The ast node of ``Class.method`` or a module-level def/assignment."""
    *parents, name = attr_path.split(".")
    body = tree.body
    for parent in parents:
        body = next(node.body for node in body if isinstance(node, ast.ClassDef) and node.name == parent)
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node
        if isinstance(node, ast.ImportFrom) and any((alias.asname or alias.name) == name for alias in node.names):
            return node
    raise LookupError(attr_path)


@functools.lru_cache(maxsize=None)
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def pinned_function(src: Path, module: str, attr_path: str, namespace: dict):
    """Compile one function of the pinned source on its own, with ``namespace`` as globals."""
    tree = parsed(module_file(src, module))
    node = find_node(tree, attr_path)
    code = compile(ast.Module(body=[node], type_ignores=[]), f"<sglang {module}.{attr_path}>", "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    scope = dict(namespace)
    exec(code, scope)
    return scope[node.name]


def pinned_capture_hidden_mode(src: Path):
    return pinned_function(src, "sglang.srt.model_executor.forward_batch_info", "CaptureHiddenMode", {"IntEnum": enum.IntEnum, "total_ordering": functools.total_ordering})


@pytest.mark.integration
@pytest.mark.parametrize(
    ("version", "key"), [(v, k) for v, targets in sglang_patch.PATCH_TARGETS.items() for k in sorted(targets)]
)
def test_every_symbol_the_patch_touches_exists_in_its_sglang(sglang_root, version, key):
    module, attr_path = sglang_patch.PATCH_TARGETS[version][key]
    tree = ast.parse(module_file(_sglang_source(version, sglang_root), module).read_text())
    assert find_node(tree, attr_path) is not None


def test_every_supported_version_has_hooks():
    assert set(sglang_patch.PATCH_TARGETS) == set(sglang_patch.SUPPORTED_SGLANG_VERSIONS)
    assert sglang_patch.SGLANG_VERSION in sglang_patch.SUPPORTED_SGLANG_VERSIONS


def _params(function_node: ast.FunctionDef) -> list[tuple[str, str]]:
    args = function_node.args
    return [(a.arg, "positional") for a in args.args] + [(a.arg, "keyword") for a in args.kwonlyargs]


REPLACEMENTS = [
    ("0.5.23", "append_prefill", "make_append_prefill_hidden_states"),
    ("0.5.14", "append_prefill", "make_append_prefill_hidden_states_0514"),
    ("0.5.14", "hidden_states_to_store", "make_hidden_states_to_store_0514"),
    ("0.5.14", "init_capture", "make_init_capture_0514"),
]


@pytest.mark.integration
@pytest.mark.parametrize(("version", "key", "factory"), REPLACEMENTS)
def test_replacement_keeps_the_signature_of_its_sglang(sglang_root, version, key, factory):
    module, attr_path = sglang_patch.PATCH_TARGETS[version][key]
    pinned = find_node(ast.parse(module_file(_sglang_source(version, sglang_root), module).read_text()), attr_path)
    maker = find_node(ast.parse(Path(sglang_patch.__file__).read_text()), factory)
    ours = next(node for node in maker.body if isinstance(node, ast.FunctionDef))
    assert ours.name == attr_path.split(".")[-1]
    assert _params(ours) == _params(pinned)
    assert [ast.unparse(d) if d else None for d in ours.args.kw_defaults] == [
        ast.unparse(d) if d else None for d in pinned.args.kw_defaults
    ]


@pytest.mark.integration
def test_pinned_sglang_carries_what_the_patch_reads_and_writes(sglang_src):
    def text(module):
        return module_file(sglang_src, module).read_text()

    logits = text("sglang.srt.layers.logits_processor")
    assert "    last_hidden_states: Optional[torch.Tensor] = None" in logits
    # Under full capture with aux layers, hidden_states holds the packed aux states.
    assert "hidden_states_to_store = pack_aux_hidden_states(aux_hidden_states)" in logits
    assert "self.keep_last_hidden_states = features.aux_hidden_state_capture is not None" in logits
    batch = text("sglang.srt.managers.schedule_batch")
    assert "self.customized_info: Optional[Dict[str, List[Any]]] = None" in batch
    assert "self.origin_input_ids = origin_input_ids" in batch
    streamer = text("sglang.srt.managers.scheduler_components.output_streamer")
    assert "is_request_level = self.is_request_level_customized_info_key(key)" in streamer
    tokenizer = text("sglang.srt.managers.tokenizer_manager")
    assert "meta_info[key] = accumulated" in tokenizer  # customized_info lands in meta_info
    runner = text("sglang.srt.model_executor.model_runner")
    # model_runner calls the name it imported, so the patch replaces it there.
    assert "    configure_aux_hidden_state_capture,\n" in runner
    assert "        configure_aux_hidden_state_capture(\n" in runner
    scheduler = text("sglang.srt.managers.scheduler")
    assert "get_parallel().pp_rank == 0\n            and get_parallel().attn_tp_rank == 0\n            and get_parallel().attn_cp_rank == 0" in scheduler
    assert "    load_plugins()" in scheduler  # every scheduler process loads plugins
    launcher = text("sglang.launch_server")
    assert launcher.index("load_plugins()") < launcher.index("run_server(server_args)\n    finally")
    plugins = text("sglang.srt.plugins.__init__")
    assert f'GENERAL_PLUGINS_GROUP = "{sglang_patch.PLUGIN_GROUP}"' in plugins
    assert "entry_points(group=group)" in plugins


@pytest.mark.integration
def test_every_launcher_flag_exists_in_pinned_server_args(sglang_src):
    config = {
        "run": "kimi", "target": {"name": "Kimi-K2.5", "path": "/models/kimi", "num_layers": 61, "hidden_size": 7168, "tensor_parallel": 8},
        "extract": {"layer_ids": "default", "sglang": {"architecture": "KimiK25ForConditionalGeneration", "extra_args": ["--trust-remote-code"]}},
    }
    capture = sglang_launch.capture_settings(config)
    command = sglang_launch.launch_command(config, capture, python="python", sglang_version="0.5.23")
    fields = "\n".join(p.read_text() for p in (sglang_src / "srt" / "arg_groups" / "fields").glob("*.py"))
    flags = [arg for arg in command if arg.startswith("--")]
    for flag in flags:
        assert f"    {flag[2:].replace('-', '_')}: A[" in fields, flag
    assert "Setting this to -1 means disabling chunked prefill." in fields
    validation = (sglang_src / "srt" / "arg_groups" / "validation_hook.py").read_text()
    assert '"EAGLE3' in validation and "_AUX_HIDDEN_STATE_CAPTURE_METHODS" in validation
    # bfloat16 unless the user names a dtype: SGLang's auto serves a float32 config in float16
    assert command[command.index("--dtype") + 1] == "bfloat16"
    config["extract"]["sglang"]["extra_args"] = ["--dtype", "float16"]
    command = sglang_launch.launch_command(config, capture, python="python", sglang_version="0.5.23")
    assert command.count("--dtype") == 1 and command[command.index("--dtype") + 1] == "float16"
    # no grammar backend to import unless the user names one (eaglenest sends no constraints)
    assert command[command.index("--grammar-backend") + 1] == "none"
    config["extract"]["sglang"]["extra_args"] = ["--grammar-backend", "xgrammar"]
    for mode in ("capture", "serve"):
        command = sglang_launch.launch_command(config, sglang_launch.capture_settings(config, mode), python="python", sglang_version="0.5.23")
        assert command.count("--grammar-backend") == 1 and command[command.index("--grammar-backend") + 1] == "xgrammar"


ARCHITECTURE_SOURCES = {
    "LlamaForCausalLM": "sglang.srt.models.llama",
    "Qwen2ForCausalLM": "sglang.srt.models.qwen2",
    "Qwen3ForCausalLM": "sglang.srt.models.qwen3",
    "DeepseekV2ForCausalLM": "sglang.srt.models.deepseek_v2",
}


def run_pinned_set_eagle3(src, architecture, ids, num_layers):
    function = pinned_function(src, ARCHITECTURE_SOURCES[architecture], f"{architecture}.set_eagle3_layers_to_capture",
                               {"Optional": typing.Optional, "List": typing.List})
    model = SimpleNamespace(
        pp_group=SimpleNamespace(is_last_rank=True), config=SimpleNamespace(num_hidden_layers=num_layers),
        model=SimpleNamespace(layers_to_capture=[]), capture_aux_hidden_states=False,
    )
    function(model, ids)
    assert model.capture_aux_hidden_states
    return model.model.layers_to_capture


@pytest.mark.integration
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURE_SOURCES))
@pytest.mark.parametrize("hf_ids", [[2, 30, 58], [3, 7, 9], [2, 15, 27], [5]])
def test_hf_ids_reach_pinned_sglang_as_the_same_layers(any_sglang_src, architecture, hf_ids):
    sglang_ids = layer_ids.hf_to_sglang(hf_ids, architecture)
    assert run_pinned_set_eagle3(any_sglang_src, architecture, sglang_ids, num_layers=61) == hf_ids


@pytest.mark.integration
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURE_SOURCES))
@pytest.mark.parametrize("sglang_ids", [[1, 29, 57], [2, 30, 58], [0, 4], [1]])
def test_our_mirror_of_the_sglang_convention_matches_pinned_source(any_sglang_src, architecture, sglang_ids):
    assert layer_ids.sglang_captured_layers(sglang_ids, architecture) == run_pinned_set_eagle3(
        any_sglang_src, architecture, sglang_ids, num_layers=61
    )


@pytest.mark.integration
def test_kimi_k25_delegates_layer_capture_to_its_deepseek_v3_language_model(sglang_src):
    kimi = module_file(sglang_src, "sglang.srt.models.kimi_k25").read_text()
    node = find_node(ast.parse(kimi), "KimiK25ForConditionalGeneration.set_eagle3_layers_to_capture")
    assert "self.language_model.set_eagle3_layers_to_capture(layer_ids)" in ast.unparse(node)
    assert "self.language_model = DeepseekV3ForCausalLM(" in kimi
    deepseek = ast.parse(module_file(sglang_src, "sglang.srt.models.deepseek_v2").read_text())
    v3 = find_node(deepseek, "DeepseekV3ForCausalLM")
    assert [ast.unparse(b) for b in v3.bases] == ["DeepseekV2ForCausalLM"] and isinstance(v3.body[0], ast.Pass)
    # The production target: HF [2, 30, 58] for 61 layers; SpecForge configs write [1, 29, 57].
    assert layer_ids.hf_to_sglang([2, 30, 58], "KimiK25ForConditionalGeneration") == [2, 30, 58]
    assert layer_ids.sglang_to_hf([1, 29, 57], "KimiK25ForConditionalGeneration") == [2, 30, 58]
    assert layer_ids.hf_to_sglang([2, 15, 27], "LlamaForCausalLM") == [1, 14, 26]  # SmolLM2


def test_unreachable_hf_layers_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="turns a leading 1 into 2"):
        layer_ids.hf_to_sglang([1, 30, 58], "DeepseekV3ForCausalLM")
    with pytest.raises(ValueError, match="embeddings"):
        layer_ids.hf_to_sglang([0, 3], "LlamaForCausalLM")
    with pytest.raises(ValueError, match="no SGLang layer-id convention known for architecture 'MistralForCausalLM'"):
        layer_ids.hf_to_sglang([2, 3], "MistralForCausalLM")


def make_batch(n_tokens, hidden=8, aux_layers=3):
    torch.manual_seed(0)
    return SimpleNamespace(
        hidden_states=torch.randn(n_tokens, aux_layers * hidden, dtype=torch.bfloat16),
        last_hidden_states=torch.randn(n_tokens, hidden, dtype=torch.bfloat16),
    )


def make_req(rid, ids, mode=True):
    return SimpleNamespace(rid=rid, origin_input_ids=ids, return_hidden_states=mode, customized_info=None, hidden_states=[])


@pytest.mark.integration
@pytest.mark.parametrize("background", [False, True], ids=["written-here", "spool-writer"])
def test_patched_prefill_spools_each_request_of_a_batch_by_request_id(sglang_src, tmp_path, background):
    mode = pinned_capture_hidden_mode(sglang_src)
    original = pinned_function(sglang_src, *sglang_patch.PATCH_TARGETS["0.5.23"]["append_prefill"], {"CaptureHiddenMode": mode, "Req": object})
    writer = spool.SpoolWriter(2) if background else None
    patched = sglang_patch.make_append_prefill_hidden_states(original, {"spool_dir": str(tmp_path)}, lambda: True, writer)
    output = make_batch(12)
    first, second = make_req("r-1", [5, 6, 7, 8, 9]), make_req("r-2", list(range(7)))
    offset = patched(None, req=first, logits_output=output, hidden_state_offset=0, capture_hidden_mode=mode.FULL, extend_input_len=5)
    offset = patched(None, req=second, logits_output=output, hidden_state_offset=offset, capture_hidden_mode=mode.FULL, extend_input_len=7)
    assert offset == 12
    if writer is not None:
        writer.flush()
    for req, rows in ((first, slice(0, 5)), (second, slice(5, 12))):
        (descriptor,) = req.customized_info[sglang_patch.SPOOL_KEY]
        assert descriptor["path"] == str(tmp_path / f"{req.rid}.safetensors")
        assert descriptor["tensors"]["aux_hidden"] == {"shape": [rows.stop - rows.start, 24], "dtype": "bfloat16"}
        spooled, metadata = spool.read_spool_file(descriptor["path"])
        assert torch.equal(spooled["aux_hidden"], output.hidden_states[rows])
        assert torch.equal(spooled["last_hidden"], output.last_hidden_states[rows])
        assert spooled["input_ids"].tolist() == list(req.origin_input_ids)
        assert metadata == {"rid": req.rid, "finite": "1"}
        assert req.hidden_states == []  # no JSON float lists
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r-1.safetensors", "r-2.safetensors"]


@pytest.mark.integration
def test_patched_prefill_leaves_last_token_requests_and_other_ranks_alone(sglang_src, tmp_path):
    mode = pinned_capture_hidden_mode(sglang_src)
    original = pinned_function(sglang_src, *sglang_patch.PATCH_TARGETS["0.5.23"]["append_prefill"], {"CaptureHiddenMode": mode, "Req": object})
    on_rank_1 = sglang_patch.make_append_prefill_hidden_states(original, {"spool_dir": str(tmp_path)}, lambda: False)
    output = make_batch(4)
    req = make_req("r-9", [1, 2, 3, 4])
    assert on_rank_1(None, req=req, logits_output=output, hidden_state_offset=0, capture_hidden_mode=mode.FULL, extend_input_len=4) == 4
    assert req.customized_info is None and list(tmp_path.iterdir()) == []
    # return_hidden_states="last" keeps SGLang's own (pinned) behaviour: the last row as a list.
    last_req = make_req("r-10", [1, 2, 3, 4], mode="last")
    on_rank_1(None, req=last_req, logits_output=output, hidden_state_offset=0, capture_hidden_mode=mode.FULL, extend_input_len=4)
    assert last_req.hidden_states == [output.hidden_states[3].tolist()]


def test_a_partial_prefill_is_reported_not_spooled(tmp_path):
    aux, last = torch.zeros(3, 6), torch.zeros(3, 2)
    descriptor = sglang_patch.spool_prefill_rows(tmp_path, "r-1", [1, 2, 3, 4, 5], {"aux_hidden": aux, "last_hidden": last})
    assert "radix cache or chunked prefill is on" in descriptor["error"]
    assert list(tmp_path.iterdir()) == []
    descriptor = sglang_patch.spool_prefill_rows(tmp_path, "r-1", [1, 2, 3], {"aux_hidden": aux, "last_hidden": None})
    assert "no last_hidden" in descriptor["error"]


def test_request_ids_that_are_not_plain_file_names_are_refused(tmp_path):
    for rid in ("../escape", "a/b", "", ".hidden", "x" * 201):
        with pytest.raises(ValueError, match="not usable as a spool file name"):
            sglang_patch.spool_path(tmp_path, rid)
    assert sglang_patch.spool_path(tmp_path, "eaglenest-shard-00003-7-ab12") == tmp_path / "eaglenest-shard-00003-7-ab12.safetensors"


def test_load_time_check_stops_a_server_capturing_other_layers():
    kimi = SimpleNamespace(language_model=SimpleNamespace(model=SimpleNamespace(layers_to_capture=[2, 30, 58])))
    sglang_patch.check_captured_layers(kimi, [2, 30, 58])
    llama = SimpleNamespace(model=SimpleNamespace(layers_to_capture=[3, 16, 28]))
    with pytest.raises(sglang_patch.CaptureError, match=r"captures layers \[3, 16, 28\] but eaglenest asked for HF layers \[2, 15, 27\]"):
        sglang_patch.check_captured_layers(llama, [2, 15, 27])


def test_request_level_key_wrapper_marks_only_our_key():
    wrapped = sglang_patch.make_is_request_level_key(lambda self, key: key == "theirs")
    assert wrapped(None, sglang_patch.SPOOL_KEY) and wrapped(None, "theirs") and not wrapped(None, "other")


# ---------------------------------------------------------------- sglang 0.5.14 (the H200 image's torch 2.11)


@pytest.mark.integration
def test_sglang_0514_carries_what_its_hooks_read_and_write(sglang_0514_src):
    def text(module):
        return module_file(sglang_0514_src, module).read_text()

    logits = text("sglang.srt.layers.logits_processor")
    # Full capture with aux layers stores the packed aux states only (no last_hidden_states field).
    assert "                    aux_hidden_states = torch.cat(aux_hidden_states, dim=-1)\n                    hidden_states_to_store = aux_hidden_states" in logits
    assert "last_hidden_states" not in logits
    assert "hidden_states_to_store = self._get_hidden_states_to_store(\n            hidden_states,\n            hidden_states_before_norm," in logits
    batch = text("sglang.srt.managers.scheduler_components.batch_result_processor")
    assert "hidden_state_offset = self._append_prefill_hidden_states(" in batch
    # 0.5.14 slices customized_info per output token: a one-element list survives a one-token request.
    streamer = text("sglang.srt.managers.scheduler_components.output_streamer")
    assert "self.customized_info[k].append(v[send_token_offset : len(output_ids_)])" in streamer
    assert "meta_info[k] = state.customized_info_accumulated[k]" in text("sglang.srt.managers.tokenizer_manager")
    schedule = text("sglang.srt.managers.schedule_batch")
    assert "self.customized_info: Optional[Dict[str, List[Any]]] = None" in schedule
    assert "self.extend_input_len = extend_input_len" in schedule
    runner = text("sglang.srt.model_executor.model_runner")
    assert "        self.init_aux_hidden_state_capture()\n" in runner
    assert "self.is_draft_worker = is_draft_worker" in runner
    assert "    load_plugins()" in text("sglang.srt.managers.scheduler")
    launcher = text("sglang.launch_server")
    assert launcher.index("load_plugins()") < launcher.index("run_server(server_args)\n    finally")
    plugins = text("sglang.srt.plugins.__init__")
    assert f'GENERAL_PLUGINS_GROUP = "{sglang_patch.PLUGIN_GROUP}"' in plugins and "entry_points(group=group)" in plugins
    # The target passes its aux states to the logits processor whenever it captures them.
    llama = text("sglang.srt.models.llama")
    assert "        if self.capture_aux_hidden_states:\n            hidden_states, aux_hidden_states = hidden_states" in llama


@pytest.mark.integration
def test_every_launcher_flag_exists_in_sglang_0514_server_args(sglang_0514_src):
    config = {"run": "smol", "target": {"name": "SmolLM2", "path": "/m", "num_layers": 30, "hidden_size": 576},
              "extract": {"layer_ids": "default", "sglang": {"architecture": "LlamaForCausalLM"}}}
    capture = sglang_launch.capture_settings(config)
    command = sglang_launch.launch_command(config, capture, python="python", sglang_version="0.5.14")
    server_args = (sglang_0514_src / "srt" / "server_args.py").read_text()
    for flag in [arg for arg in command if arg.startswith("--")]:
        assert f"    {flag[2:].replace('-', '_')}: A[" in server_args, flag
    assert "--speculative-algorithm" not in command  # EAGLE3 would want a draft model there
    assert "    return_aux_hidden_state_layer_ids: A[" not in server_args


def test_the_regeneration_sweep_and_server_flags_name_flags_sglang_0514_has(sglang_0514_src):
    """docs/regeneration.md's CEILING_SWEEP commands and the regeneration server's flags in
    config/h200/regenerated-sampled-server.yaml: every flag is a field of 0.5.14's ServerArgs
    (its parser makes --a-b of field a_b), every environment word a variable of its environ.py."""
    import re

    lines = [line for line in (REPO / "docs" / "regeneration.md").read_text().splitlines()
             if line.lstrip().startswith(("CEILING_SWEEP=", "CEILING_PROMPTS=")) and "CEILING_SWEEP=" in line]
    assert len(lines) >= 3
    flags = set(re.findall(r"(?<![\w-])--[a-z0-9-]+", " ".join(lines)))
    assert {"--scheduler-recv-interval", "--cuda-graph-max-bs-decode", "--disable-prefill-cuda-graph"} <= flags
    environ = (sglang_0514_src / "srt" / "environ.py").read_text()
    variables = set(re.findall(r"\b(SGLANG_[A-Z0-9_]+)=", " ".join(lines)))
    assert variables == {"SGLANG_SCHEDULER_RECV_SKIPPER_WEIGHT_DEFAULT"}
    for variable in variables:
        assert f"    {variable} = Env" in environ, variable
    overlay = yaml.safe_load((REPO / "config" / "h200" / "regenerated-sampled-server.yaml").read_text())
    server_flags = {arg for arg in overlay["extract"]["sglang"]["extra_args"] if arg.startswith("--")}
    assert {"--scheduler-recv-interval", "--cuda-graph-max-bs-decode"} <= server_flags
    flags |= server_flags
    server_args = (sglang_0514_src / "srt" / "server_args.py").read_text()
    for flag in flags:
        assert f"    {flag[2:].replace('-', '_')}: A[" in server_args, flag


def pinned_0514(src, key, namespace=None):
    return pinned_function(src, *sglang_patch.PATCH_TARGETS["0.5.14"][key], {"Optional": typing.Optional, "List": typing.List,
                                                                              "Req": object, **(namespace or {})})


@pytest.mark.integration
def test_sglang_0514_hooks_spool_aux_and_final_rows_of_each_request(sglang_0514_src, tmp_path):
    mode = pinned_capture_hidden_mode(sglang_0514_src)
    store = sglang_patch.make_hidden_states_to_store_0514(pinned_0514(sglang_0514_src, "hidden_states_to_store", {"torch": torch}))
    hidden, n = 8, 12
    torch.manual_seed(0)
    final = torch.randn(n, hidden, dtype=torch.bfloat16)
    aux = [torch.randn(n, hidden, dtype=torch.bfloat16) for _ in range(3)]
    metadata = SimpleNamespace(capture_hidden_mode=mode.FULL)
    stored = store(None, final, None, aux, final, None, None, None, metadata)
    assert stored.shape == (n, 4 * hidden)
    # Without capture, or in "last" mode, 0.5.14's own result comes back unchanged.
    assert store(None, final, None, aux, final, None, [a[-1:] for a in aux], None, SimpleNamespace(capture_hidden_mode=mode.NULL)) is None
    writer = spool.SpoolWriter(2)
    append = sglang_patch.make_append_prefill_hidden_states_0514(
        pinned_0514(sglang_0514_src, "append_prefill"), {"spool_dir": str(tmp_path), "hidden_size": hidden}, lambda: True, writer
    )
    output = SimpleNamespace(hidden_states=stored)
    first, second = make_req("r-1", [5, 6, 7, 8, 9]), make_req("r-2", list(range(7)))
    first.extend_input_len, second.extend_input_len = 5, 7
    offset = append(None, req=first, logits_output=output, hidden_state_offset=0)
    assert append(None, req=second, logits_output=output, hidden_state_offset=offset) == 12
    writer.flush()
    for req, rows in ((first, slice(0, 5)), (second, slice(5, 12))):
        (descriptor,) = req.customized_info[sglang_patch.SPOOL_KEY]
        spooled = sglang_patch.read_spooled(descriptor["path"])
        # Spooled packed as 0.5.14 stores them: the aux layers, then the final state.
        assert torch.equal(spooled["hidden"], torch.cat([*aux, final], dim=-1)[rows])
        assert spooled["input_ids"].tolist() == list(req.origin_input_ids) and req.hidden_states == []
    # A prefix-cache hit (fewer computed rows than prompt tokens) is reported, not spooled.
    short = make_req("r-3", list(range(6)))
    short.extend_input_len = 4
    append(None, req=short, logits_output=output, hidden_state_offset=0)
    assert "radix cache or chunked prefill is on" in short.customized_info[sglang_patch.SPOOL_KEY][0]["error"]
    # return_hidden_states="last" keeps 0.5.14's own behaviour (float lists).
    last_req = make_req("r-4", [1, 2, 3], mode="last")
    last_req.extend_input_len = 3
    append(None, req=last_req, logits_output=SimpleNamespace(hidden_states=final), hidden_state_offset=0)
    assert last_req.hidden_states == [final[:3].tolist()] and last_req.customized_info is None


@pytest.mark.integration
def test_sglang_0514_hooks_quantise_an_fp8_runs_rows_before_their_copy_to_the_host(sglang_0514_src, tmp_path):
    """storage_dtype float8_e4m3: 0.5.14's stored rows leave the logits processor as
    quantized_rows' uint8 (half the bytes to copy), are spooled as they are, and split into
    exactly what the client would have stored from the bf16 rows."""
    from eaglenest.stages import shard_driver

    mode = pinned_capture_hidden_mode(sglang_0514_src)
    settings = {"spool_dir": str(tmp_path), "hidden_size": 8, "storage_dtype": "float8_e4m3"}
    store = sglang_patch.make_hidden_states_to_store_0514(pinned_0514(sglang_0514_src, "hidden_states_to_store", {"torch": torch}),
                                                          settings)
    hidden, n = 8, 5
    torch.manual_seed(1)
    final = torch.randn(n, hidden, dtype=torch.bfloat16)
    aux = [torch.randn(n, hidden, dtype=torch.bfloat16) * 10 ** k for k in range(3)]
    stored = store(None, final, None, aux, final, None, None, None, SimpleNamespace(capture_hidden_mode=mode.FULL))
    assert stored.dtype == torch.uint8 and stored.shape == (n, 4 * hidden + 4 * 4)
    append = sglang_patch.make_append_prefill_hidden_states_0514(pinned_0514(sglang_0514_src, "append_prefill"), settings,
                                                                 lambda: True)
    req = make_req("r-fp8", list(range(n)))
    req.extend_input_len = n
    append(None, req=req, logits_output=SimpleNamespace(hidden_states=stored), hidden_state_offset=0)
    (descriptor,) = req.customized_info[sglang_patch.SPOOL_KEY]
    spooled = sglang_patch.read_spooled(descriptor["path"])["hidden"]
    split = sglang_patch.split_quantized_rows(spooled, hidden, num_aux_layers=3)
    expected = shard_driver.to_storage(torch.cat(aux, dim=-1), final, "float8_e4m3", 3)
    assert set(split) == set(expected)
    for name in expected:
        assert torch.equal(split[name].view(torch.uint8), expected[name].view(torch.uint8)), name


@pytest.mark.integration
def test_sglang_0514_runner_captures_our_layers_without_a_draft(sglang_0514_src):
    set_eagle3 = pinned_function(sglang_0514_src, "sglang.srt.models.llama", "LlamaForCausalLM.set_eagle3_layers_to_capture",
                                 {"Optional": typing.Optional, "List": typing.List})
    model = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True), config=SimpleNamespace(num_hidden_layers=30),
                            model=SimpleNamespace(layers_to_capture=[]), capture_aux_hidden_states=False)
    model.set_eagle3_layers_to_capture = lambda ids: set_eagle3(model, ids)
    settings = {"layer_ids": [2, 15, 27], "sglang_layer_ids": layer_ids.hf_to_sglang([2, 15, 27], "LlamaForCausalLM")}
    init = sglang_patch.make_init_capture_0514(pinned_0514(sglang_0514_src, "init_capture"), settings)
    runner = SimpleNamespace(model=model, is_draft_worker=False, eagle_use_aux_hidden_state=False, dflash_use_aux_hidden_state=False)
    init(runner)
    assert model.capture_aux_hidden_states and model.model.layers_to_capture == [2, 15, 27]
    draft = SimpleNamespace(model=SimpleNamespace(), is_draft_worker=True, eagle_use_aux_hidden_state=False, dflash_use_aux_hidden_state=False)
    init(draft)  # a draft worker keeps sglang's own settings
