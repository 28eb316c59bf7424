"""Synthesize: user prompts written by the target itself (a source of ``data.sources``).

A chat model fine-tuned on conversations has learned what follows the template's opening of
a user turn: a user's request. Sent only that opening (the rendered template up to where the
user's text starts, the "pre-query"), the target writes a user prompt and ends it with the
template's end-of-turn token. This is the Magpie method; its reference code samples the
instruction at temperature 1.0 and top-p 1.0 (magpie-align/magpie at b734a36,
``exp/gen_ins.py:26-27``, ``scripts/magpie.sh:3-4``) and answers it greedily
(``scripts/magpie.sh:6``). Here the answers come from the regenerate stage, which
treats a conversation that ends in a user turn as one more turn to answer.

Why: the drafter learns the target's answers to whatever prompts the data holds. Prompts the
target writes follow the distribution of its own fine-tuning data rather than one web source's.

The pre-query is the template's own rendering of a user turn, the default system turn
included where the template adds one (SmolLM2's does): the opening every served
conversation starts with. A prompt is kept when the target ended it itself, it holds
text, it is no loop (``regenerate.repetition_stop``) and no earlier prompt had the same
text; every other outcome is counted in the report.

``system_prompts`` steers what the prompts are about, as Magpie's control tasks do: its
pre-query for a task opens with a system turn that says what the user will ask about
(magpie-align/magpie at 4dc3304, ``exp/gen_ins.py:33, 96-97``, ``configs/model_configs.json:21-23``).
Prompt i is written after ``system_prompts[i mod n]`` in place of the template's default system
turn. The kept prompt is the user's text alone: it is answered, and drafted on, under the
default system turn as every served conversation is.

Output (docs/formats.md): JSONL of ``{"id", "messages": [{"role": "user", "content"}]}`` in
order of the prompt's index, and a JSON report; both written atomically, the report first.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

from eaglenest import settings as settings_lib
from eaglenest.formats import atomic
from eaglenest.stages.prepare import TemplateError, render
from eaglenest.stages.regenerate import Generation, OpenAIBackend, Settings as RegenerateSettings, make_backend

PROBE = "EAGLENEST_USER_PROBE"


@dataclasses.dataclass
class Settings:
    """The ``synthesize`` object of a ``data.sources`` entry; config/schema.yaml holds every default."""

    count: int
    seed: int
    temperature: float
    top_p: float
    max_new_tokens: int
    system_prompts: list[str] | None = None

    @classmethod
    def from_config(cls, section: dict) -> "Settings":
        """The object checked against the schema and completed with its defaults."""
        node = settings_lib.section_schema("data", "sources")["items"]["properties"]["synthesize"]
        return cls(**settings_lib.checked(section, node, "synthesize"))


def pre_query_ids(tokenizer, system: str | None = None) -> list[int]:
    """Token ids of the chat template up to where a user's first message starts, after a system
    turn holding ``system`` when one is given (else the template's default, if it has one)."""
    messages = [{"role": "user", "content": PROBE}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    text = render(tokenizer, messages, add_generation_prompt=False)
    if text.count(PROBE) != 1:
        raise TemplateError("the chat template does not render a user message verbatim")
    if system is not None and system not in text:
        raise TemplateError("the chat template does not render a system message: no system prompt to steer with")
    prefix = text[: text.index(PROBE)]
    if not prefix:
        raise TemplateError("the chat template puts nothing before a user message: no pre-query to send")
    return tokenizer(prefix, add_special_tokens=False)["input_ids"]


def normalised(text: str) -> str:
    """The text as duplicates are judged: case and runs of white space ignored."""
    return " ".join(text.split()).casefold()


def sampling(transport: RegenerateSettings, settings: Settings) -> RegenerateSettings:
    """The regenerate section's transport (backend, server, retries) with the prompts' sampling."""
    return dataclasses.replace(transport, temperature=settings.temperature, top_p=settings.top_p,
                               max_new_tokens=settings.max_new_tokens)


def prompt_seed(seed: int, index: int) -> int:
    # On a server each prompt has its own seed (a prompt does not change with the count or what
    # runs beside it); in process each batch, from its first prompt's index.
    return (seed * 1_000_003 + index) % 2**31


def generate(backend, prefixes: list[list[int]], count: int, seed: int, concurrency: int) -> list[Generation]:
    """``count`` continuations, prompt i of ``prefixes[i mod n]``, each sampled with ``prompt_seed``."""
    if isinstance(backend, OpenAIBackend):
        def one(index: int) -> Generation:
            return backend.complete_ids(prefixes[index % len(prefixes)], prompt_seed(seed, index))

        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            return list(pool.map(one, range(count)))
    # transformers: a batch holds one prefix's prompts, rows of the same ids with no padding
    rows = backend.settings.batch_rows
    out: list[Generation | None] = [None] * count
    for which, prefix in enumerate(prefixes):
        indices = list(range(which, count, len(prefixes)))
        for start in range(0, len(indices), rows):
            batch = indices[start:start + rows]
            for index, generation in zip(batch, backend._generate_group([list(prefix)] * len(batch), prompt_seed(seed, batch[0]))):
                out[index] = generation
    return out


def synthesize_prompts(
    output_path: str | os.PathLike,
    report_path: str | os.PathLike,
    source_name: str,
    settings: Settings,
    transport: RegenerateSettings,
    model_path: str | os.PathLike,
    model_name: str,
    threads: int = 1,
    concurrency: int | None = None,
) -> dict:
    """Write ``settings.count`` prompts' survivors and the report. ``concurrency``: requests in
    flight on a server (default ``transport.concurrency``)."""
    if transport.backend == "openai" and transport.api != "generate":
        raise ValueError("synthesized prompts need regenerate.api: generate (token ids in, no chat template applied)")
    started = time.monotonic()
    backend = make_backend(model_path, sampling(transport, settings), model_name, threads)
    systems = settings.system_prompts or [None]
    prefixes = [pre_query_ids(backend.tokenizer, system) for system in systems]
    generations = generate(backend, prefixes, settings.count, settings.seed, concurrency or transport.concurrency)
    kept_by_system = [0] * len(systems)
    counts = {"requested": settings.count, "kept": 0, "failed": 0, "empty": 0, "unfinished": 0, "looped": 0,
              "duplicates": 0, "generated_tokens": 0, "kept_tokens": 0}
    seen, records, errors = set(), [], []
    for index, generation in enumerate(generations):
        counts["generated_tokens"] += generation.generated_tokens
        reason = outcome(generation)
        if reason == "kept" and normalised(generation.text) in seen:
            reason = "duplicates"
        counts[reason] += 1
        if reason == "failed":
            errors.append({"index": index, "attempts": generation.attempts, "error": generation.error})
        if reason != "kept":
            continue
        seen.add(normalised(generation.text))
        kept_by_system[index % len(systems)] += 1
        counts["kept_tokens"] += generation.new_tokens
        records.append({"id": str(index), "messages": [{"role": "user", "content": generation.text}]})
    report = {
        "source": source_name,
        "target": model_name,
        "backend": transport.backend,
        "settings": dataclasses.asdict(settings),
        "repetition_stop": transport.repetition_stop,
        "pre_query_tokens": [len(prefix) for prefix in prefixes] if settings.system_prompts else len(prefixes[0]),
        **counts,
        **({"kept_by_system_prompt": kept_by_system} if settings.system_prompts else {}),
        "seconds": round(time.monotonic() - started, 3),
        "failures": errors,
    }
    if not records:
        raise RuntimeError(f"no prompt kept out of {settings.count}: {counts}")
    atomic.write_json(report_path, report)
    atomic.write_text(output_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return report


def outcome(generation: Generation) -> str:
    """Which count a generated prompt adds to."""
    if generation.text is None and generation.error:
        return "failed"
    if generation.finish_reason == "repetition":
        return "looped"
    if generation.finish_reason == "length":
        return "unfinished"
    if not (generation.text or "").strip():
        return "empty"
    return "kept"
