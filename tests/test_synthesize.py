"""Prompts the target writes itself (eaglenest.stages.synthesize), answered by regenerate.

Tiny random-weight targets sample nearly uniformly, so about a quarter of their "prompts" end
within 64 tokens; the real SmolLM2 writes requests a user would send.
"""

from __future__ import annotations

import json
import signal

import jsonschema
import pytest
import yaml

from eaglenest import plan, settings as settings_lib
from eaglenest.stages import ingest, regenerate, synthesize
from eaglenest.stages.prepare import TemplateError, load_tokenizer, render
from eaglenest.stages.regenerate import Generation
from conftest import DEFAULT_CONFIG, REPO, planned_jobs, run_snakemake, synthetic_conversations, tiny_workflow_config
from test_sglang_protocol import start_standin

TRANSPORT = dict(enabled=True, device="cpu", batch_rows=8, repetition_stop=3)
SMOLLM2 = REPO / "resources" / "models" / "SmolLM2-135M-Instruct"


def synthesize_to(tmp_path, model, name="self", transport=None, **settings):
    out, report = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.report.json"
    result = synthesize.synthesize_prompts(
        out, report, name, synthesize.Settings.from_config({"count": 32, "max_new_tokens": 64, **settings}),
        regenerate.Settings.from_config({**TRANSPORT, **(transport or {})}), model, "tiny-llama",
    )
    assert json.loads(report.read_text()) == result
    return [json.loads(line) for line in out.read_text().splitlines()], result


def test_the_pre_query_is_the_templates_opening_of_a_user_turn(tiny_llama):
    tokenizer = load_tokenizer(tiny_llama)
    prefix = tokenizer.decode(synthesize.pre_query_ids(tokenizer))
    rendered = render(tokenizer, [{"role": "user", "content": "What is a lake?"}], add_generation_prompt=False)
    assert rendered.startswith(prefix + "What is a lake?")
    assert prefix.endswith("user\n") and "What" not in prefix


def test_every_requested_prompt_is_kept_or_counted_and_the_file_is_reproducible(tmp_path, tiny_llama):
    records, report = synthesize_to(tmp_path, tiny_llama)
    outcomes = ("kept", "failed", "empty", "unfinished", "looped", "duplicates")
    assert sum(report[k] for k in outcomes) == report["requested"] == 32
    assert 0 < report["kept"] == len(records) < 32 and report["unfinished"] > 0
    assert report["generated_tokens"] > report["kept_tokens"] > 0
    tokenizer = load_tokenizer(tiny_llama)
    assert report["pre_query_tokens"] == len(synthesize.pre_query_ids(tokenizer))
    ids = [r["id"] for r in records]
    assert len(set(ids)) == len(ids) and ids == sorted(ids, key=int)
    for record in records:
        (message,) = record["messages"]
        assert message["role"] == "user" and message["content"].strip() == message["content"] != ""
    # Each prompt has its own seed: the same settings give the same file; another seed, others.
    again, _ = synthesize_to(tmp_path, tiny_llama, name="again")
    assert again == records
    other, _ = synthesize_to(tmp_path, tiny_llama, name="other", seed=1)
    assert other != records


def test_system_prompts_steer_each_prompt_in_turn_and_the_kept_prompt_is_the_users_text(tmp_path, tiny_llama):
    """synthesize.system_prompts (Magpie's control tasks): prompt i is written after a system
    turn holding system_prompts[i mod n]; what is kept is the user's text alone."""
    tokenizer = load_tokenizer(tiny_llama)
    default = tokenizer.decode(synthesize.pre_query_ids(tokenizer))
    steered = tokenizer.decode(synthesize.pre_query_ids(tokenizer, "The user asks about lakes."))
    assert "The user asks about lakes." in steered and "The user asks about lakes." not in default
    assert steered.endswith("user\n") and default.endswith("user\n") and steered != default
    systems = ["The user asks about lakes.", "The user asks for a poem."]
    records, report = synthesize_to(tmp_path, tiny_llama, system_prompts=systems)
    assert report["pre_query_tokens"] == [len(synthesize.pre_query_ids(tokenizer, system)) for system in systems]
    assert sum(report["kept_by_system_prompt"]) == report["kept"] == len(records) > 0
    assert all(len(record["messages"]) == 1 and record["messages"][0]["role"] == "user" for record in records)
    plain, plain_report = synthesize_to(tmp_path, tiny_llama, name="plain")
    assert "kept_by_system_prompt" not in plain_report and isinstance(plain_report["pre_query_tokens"], int)
    assert records != plain
    again, _ = synthesize_to(tmp_path, tiny_llama, name="again", system_prompts=systems)
    assert again == records
    # a template that drops system turns cannot be steered: refused, not ignored
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n"
                               "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}")
    with pytest.raises(TemplateError, match="does not render a system message"):
        synthesize.pre_query_ids(tokenizer, "The user asks about lakes.")


def test_outcomes_and_duplicates_are_told_apart(monkeypatch, tmp_path, tiny_llama):
    made = [
        Generation("Tell me about lakes.", "stop", 5, generated_tokens=6),
        Generation("tell me   about LAKES.", "stop", 5, generated_tokens=6),  # the same prompt
        Generation("A b c", "length", 64, generated_tokens=64),
        Generation("la la", "repetition", 2, generated_tokens=30),
        Generation("", "stop", 0, generated_tokens=1),
        Generation(None, attempts=3, error="HTTP 503: busy"),
        Generation("What is rain?", "stop", 4, generated_tokens=5),
    ]
    monkeypatch.setattr(synthesize, "generate", lambda *args: made)
    records, report = synthesize_to(tmp_path, tiny_llama, count=len(made))
    assert [r["messages"][0]["content"] for r in records] == ["Tell me about lakes.", "What is rain?"]
    assert [r["id"] for r in records] == ["0", "6"]
    expected = {"kept": 2, "duplicates": 1, "unfinished": 1, "looped": 1, "empty": 1, "failed": 1}
    assert {k: report[k] for k in expected} == expected
    assert report["failures"] == [{"index": 5, "attempts": 3, "error": "HTTP 503: busy"}]
    assert report["generated_tokens"] == 112 and report["kept_tokens"] == 9


def test_nothing_kept_is_an_error_that_writes_nothing(monkeypatch, tmp_path, tiny_llama):
    monkeypatch.setattr(synthesize, "generate", lambda *args: [Generation("x y", "length", 64)] * 3)
    with pytest.raises(RuntimeError, match="no prompt kept out of 3"):
        synthesize_to(tmp_path, tiny_llama, count=3)
    assert not list(tmp_path.iterdir())


@pytest.mark.integration
def test_a_server_continues_the_pre_query_as_the_target_does_in_process(tmp_path, tiny_llama):
    """OpenAIBackend.complete_ids sends raw ids to SGLang's /generate; greedy, the stand-in
    server's continuation is the in-process one (the SGLang server on the node is the same route)."""
    process, url, _ = start_standin(tmp_path, tiny_llama, "--mode", "serve")
    try:
        greedy = regenerate.Settings.from_config({**TRANSPORT, "temperature": 0.0, "max_new_tokens": 12,
                                                   "repetition_stop": 0})
        served = regenerate.make_backend(tiny_llama, regenerate.Settings.from_config(
            {**TRANSPORT, "temperature": 0.0, "max_new_tokens": 12, "repetition_stop": 0, "backend": "openai",
             "api": "generate", "url": url}), "tiny-llama")
        local = regenerate.make_backend(tiny_llama, greedy, "tiny-llama")
        prefix = synthesize.pre_query_ids(local.tokenizer)
        (expected,) = local._generate_group([prefix], seed=0)
        assert served.complete_ids(prefix, seed=0).text == expected.text != ""
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    with pytest.raises(ValueError, match="api: generate"):
        synthesize_to(tmp_path, tiny_llama, transport={"backend": "openai", "api": "chat", "url": url})


def test_a_conversation_that_ends_in_a_user_turn_gets_its_answer_or_is_dropped(tmp_path, tiny_llama):
    raw = synthetic_conversations(tmp_path / "raw.jsonl", 4, seed=3)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "messages": [{"role": "user", "content": f"Question {i}?"}]}) + "\n"
                               for i in range(3)))
    conversations = tmp_path / "conversations.jsonl"
    sources = [{"name": "synthetic", "path": str(raw)}, {"name": "self", "path": str(prompts), "synthesize": {"count": 3}}]
    ingested = ingest.ingest(sources, conversations, tmp_path / "ingest.json", max_conversations=10)
    assert ingested.kept == 7
    rows = {c["sample_id"]: c for c in ingest.read_conversations(conversations)}
    assert [m["role"] for m in rows["self:0"]["messages"]] == ["user"]
    settings = regenerate.Settings.from_config({**TRANSPORT, "temperature": 1.0, "max_new_tokens": 8})
    kept, counts = regenerate.regenerate_conversations(list(rows.values()), regenerate.make_backend(tiny_llama, settings, "t"),
                                                       settings, max_len=256, seed=0)
    answered = {c["sample_id"]: c for c in kept}
    assert counts["open_ended"] == 3 and counts["failed"] == 0 and len(answered) == 7
    for i in range(3):
        messages = answered[f"self:{i}"]["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"] and messages[1]["content"]
        assert answered[f"self:{i}"]["regenerated_turns"] == [1]
    # No server: every answer fails; the originals keep their text, the prompts have none to keep.
    down = regenerate.Settings.from_config({**TRANSPORT, "backend": "openai", "url": "http://127.0.0.1:9", "retries": 0,
                                            "backoff_s": 0.0})
    kept, counts = regenerate.regenerate_conversations(list(rows.values()), regenerate.make_backend(tiny_llama, down, "t"),
                                                       down, max_len=256, seed=0)
    assert sorted(c["sample_id"] for c in kept) == sorted(s for s in rows if s.startswith("synthetic:"))
    assert counts["dropped_conversations"] == ["self:0", "self:1", "self:2"]


def test_only_a_synthesized_source_may_hold_prompts_without_answers(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "0", "messages": [{"role": "user", "content": "Hi?"}]}) + "\n")
    report = ingest.ingest([{"name": "plain", "path": str(prompts)}], tmp_path / "c.jsonl", tmp_path / "r.json")
    assert report.kept == 0 and report.rejected["no_assistant_turn"] == 1


def test_a_source_is_a_file_or_a_synthesis_and_the_synthesis_decides_the_samples():
    validator = jsonschema.Draft202012Validator(settings_lib.section_schema("data", "sources"))
    assert validator.is_valid([{"name": "a", "path": "x.json"}, {"name": "self", "synthesize": {"count": 5}}])
    assert not validator.is_valid([{"name": "a"}])
    assert not validator.is_valid([{"name": "a", "path": "x.json", "synthesize": {"count": 5}}])
    assert not validator.is_valid([{"name": "self", "synthesize": {"count": 5, "temperature": 0}}])
    assert validator.is_valid([{"name": "self", "synthesize": {"count": 5, "system_prompts": ["About lakes."]}}])
    assert not validator.is_valid([{"name": "self", "synthesize": {"count": 5, "system_prompts": []}}])
    assert not validator.is_valid([{"name": "self", "synthesize": {"count": 5, "system_prompts": [""]}}])
    with pytest.raises(ValueError, match="bad synthesize settings: .*'temprature' was unexpected"):
        synthesize.Settings.from_config({"count": 5, "temprature": 1.0})
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    config["data"]["sources"].append({"name": "self", "synthesize": {"count": 5}})
    before = plan.sample_selection(config)
    config["data"]["sources"][-1]["synthesize"]["seed"] = 1
    assert plan.sample_selection(config) != before


@pytest.mark.workflow
def test_synthesized_prompts_need_the_regenerate_stage(tmp_path, tiny_llama):
    conversations = synthetic_conversations(tmp_path / "conversations.jsonl", 8)
    workdir = tmp_path / "work"
    workdir.mkdir()
    configfile = tiny_workflow_config(workdir, tiny_llama, conversations)
    config = yaml.safe_load(configfile.read_text())
    config["data"]["sources"].append({"name": "self", "synthesize": {"count": 4}})
    configfile.write_text(yaml.safe_dump(config))
    result = run_snakemake(workdir, configfile, "-n", check=False)
    assert result.returncode != 0 and "set regenerate.enabled: true" in result.stdout + result.stderr


@pytest.mark.workflow
def test_the_workflow_synthesizes_ingests_and_answers_the_targets_own_prompts(tmp_path, tiny_llama):
    """In process (transformers): rule synthesize_prompts, then ingest, then regenerate; the
    prompts land in their own namespace, each answered once; a rerun plans nothing."""
    conversations = synthetic_conversations(tmp_path / "conversations.jsonl", 8)
    workdir = tmp_path / "work"
    workdir.mkdir()
    configfile = tiny_workflow_config(
        workdir, tiny_llama, conversations,
        regenerate={"enabled": True, "temperature": 1.0, "max_new_tokens": 8, "device": "cpu", "batch_rows": 8},
    )
    config = yaml.safe_load(configfile.read_text())
    config["data"]["sources"].append({"name": "self", "synthesize": {"count": 16, "max_new_tokens": 64}})
    config["data"]["max_conversations"] = 24
    configfile.write_text(yaml.safe_dump(config))
    jobs = planned_jobs(workdir, configfile, "regenerate_report")
    assert jobs["synthesize_prompts"] == 1 and "synthesize_server" not in jobs, jobs
    run_snakemake(workdir, configfile, "--cores", "2", "regenerate_report")
    synthesized = workdir / "results" / "tiny" / "data" / "synthesized"
    made = json.loads((synthesized / "self.report.json").read_text())
    prompts = [json.loads(line) for line in (synthesized / "self.jsonl").read_text().splitlines()]
    assert made["kept"] == len(prompts) > 0
    answered = [c for path in (workdir / "results" / "tiny" / "regenerated").rglob("shard-*.jsonl")
                for c in map(json.loads, path.read_text().splitlines()) if c["sample_id"].startswith("self:")]
    report = json.loads(next((workdir / "results" / "tiny" / "regenerated").rglob("regenerate_report.json")).read_text())
    assert report["open_ended"] == len(prompts)
    assert len(answered) + len(report["dropped_conversations"]) == len(prompts)
    for conversation in answered:
        assert [m["role"] for m in conversation["messages"]] == ["user", "assistant"]
    assert planned_jobs(workdir, configfile, "regenerate_report") == {}


@pytest.mark.workflow
def test_smollm2_writes_requests_a_user_would_send(tmp_path):
    """The real target, sampled as the Magpie reference samples: prompts in words, no template markers."""
    if not SMOLLM2.exists():  # the workflow converts the embedded target
        run_snakemake(REPO, DEFAULT_CONFIG, "--cores", "2", str(SMOLLM2.relative_to(REPO)))
    records, report = synthesize_to(tmp_path, SMOLLM2, count=6, transport={"threads": 2})
    assert report["kept"] >= 3, report
    assert all(len(r["messages"][0]["content"].split()) >= 3 and "<|im_" not in r["messages"][0]["content"] for r in records)
