"""Ingest: read conversation files, normalise them, count every bad record by reason.

Input formats (auto-detected per file):
  * ShareGPT JSON: a top-level array of ``{"id", "conversations": [{"from", "value"}]}``.
    Parsed streaming, record by record, so a file truncated mid-record (the shipped
    ShareGPT V3 file is) yields every complete record and a truncation note, and a
    malformed record in the middle (a missing comma) is rejected alone as ``invalid_json``,
    with its position, while every record after it is still read. A UTF-8 byte-order
    mark is skipped in both formats.
  * JSONL: one object per line, either OpenAI style ``{"id"?, "messages": [{"role",
    "content"}]}`` (``content`` a string or a list of text parts) or ShareGPT style as above.

Output (``conversations.jsonl``): one ``{"sample_id", "messages": [{"role",
"content"}]}`` per line, roles in {system, user, assistant}, in source order.
``sample_id`` is ``"{source}:{record id}"`` (or a content hash when the record has
no id) and is what sharding hashes, so it must never depend on position or order.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from eaglenest.formats import atomic

ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "system": "system",
}

READ_CHUNK = 8 << 20


# A second sample of one conversation: its original answers, kept beside the regenerated
# ones (regenerate.mix_original, stages/prepare.py). Splits go by the conversation.
ORIGINAL_SUFFIX = "@original"


def base_sample_id(sample_id: str) -> str:
    """The conversation a sample comes from: its id without the suffix of an original copy."""
    return sample_id.removesuffix(ORIGINAL_SUFFIX)


@dataclass
class IngestReport:
    files: list[dict] = field(default_factory=list)
    records_read: int = 0
    kept: int = 0
    rejected: collections.Counter = field(default_factory=collections.Counter)
    repaired: collections.Counter = field(default_factory=collections.Counter)
    capped: int = 0

    def to_json(self) -> dict:
        return {
            "files": self.files,
            "records_read": self.records_read,
            "kept": self.kept,
            "capped_out": self.capped,
            "rejected": dict(sorted(self.rejected.items())),
            "rejected_total": sum(self.rejected.values()),
            "repaired": dict(sorted(self.repaired.items())),
        }

    def console_summary(self, stage: str = "ingest") -> str | None:
        """One line for the Snakemake console when anything was rejected, capped or cut off;
        None when every record was kept. ``stage`` begins the line (an eval set's name)."""
        cut = [note["name"] for note in self.files if note.get("truncated")]
        if not (self.rejected or self.capped or cut):
            return None
        reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(self.rejected.items()))
        parts = [f"{stage}: kept {self.kept} of {self.records_read} records"]
        if self.rejected:
            parts.append(f"rejected {sum(self.rejected.values())} ({reasons})")
        if self.capped:
            parts.append(f"{self.capped} over data.max_conversations")
        if cut:
            parts.append(f"truncated source(s): {', '.join(cut)}")
        return "; ".join(parts)


class BadRecord(ValueError):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# A JSON string, or one bracket outside strings: enough to find where a top-level element ends.
ELEMENT_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]]')
# Where a top-level element that is not an object or array ends.
SCALAR_END = re.compile(r"[,\]\n]")


def element_end(buffer: str, start: int) -> int | None:
    """Index just past the top-level element that starts at ``start``, from its brackets
    alone (strings skipped), or None when the buffer ends first. A record with a syntax
    error inside (a missing comma) still closes its brackets, so parsing resumes at the
    next record instead of losing the rest of the file."""
    if buffer[start] not in "{[":
        scalar = SCALAR_END.search(buffer, start + 1)
        return scalar.start() if scalar else None
    depth = 0
    for token in ELEMENT_TOKEN.finditer(buffer, start):
        bracket = token.group()
        if bracket in "{[":
            depth += 1
        elif bracket in "}]":
            depth -= 1
            if depth <= 0:
                return token.end()
    return None


def iter_json_array(path: Path, file_note: dict) -> Iterator[object]:
    """Yield the elements of a top-level JSON array, reading in chunks.

    A truncated tail ends the iteration and is recorded in ``file_note``
    (character offset of the first unparsed character, characters left) instead of raising.
    A malformed element in the middle is yielded as ``BadRecord("invalid_json")``, its
    position listed in ``file_note["bad_json_records"]``, and parsing goes on after it.
    """
    decoder = json.JSONDecoder()
    size = os.path.getsize(path)
    # utf-8-sig: a byte-order mark (common in files saved on Windows) is not content.
    with open(path, "r", encoding="utf-8-sig", errors="replace") as handle:
        buffer = handle.read(READ_CHUNK)
        consumed = 0  # characters dropped from the front of buffer
        eof = len(buffer) < READ_CHUNK
        pos = buffer.find("[")
        if pos < 0:
            raise BadRecord("not_a_json_array")
        pos += 1
        index = 0  # position of the element in the array
        while True:
            while True:
                while pos < len(buffer) and buffer[pos] in " \t\r\n,":
                    pos += 1
                if pos < len(buffer) or eof:
                    break
                buffer, pos, consumed = buffer[pos:], 0, consumed + pos
                more = handle.read(READ_CHUNK)
                eof = len(more) < READ_CHUNK
                buffer += more
            if pos >= len(buffer):
                file_note["truncated"] = True
                file_note["unparsed_from_char"] = consumed + pos
                return
            if buffer[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError as exc:
                closed_at = element_end(buffer, pos)
                # An unterminated string or an element still open may only be cut by the
                # read chunk: read on before calling it malformed.
                if not eof and (closed_at is None or exc.msg.startswith("Unterminated string")):
                    buffer, pos, consumed = buffer[pos:], 0, consumed + pos
                    more = handle.read(READ_CHUNK)
                    eof = len(more) < READ_CHUNK
                    buffer += more
                    continue
                # Nothing after the element, or a string open to the end: the file is cut.
                if closed_at is None or exc.msg.startswith("Unterminated string") or not buffer[closed_at:].strip():
                    file_note["truncated"] = True
                    file_note["unparsed_from_char"] = consumed + pos
                    file_note["unparsed_chars"] = len(buffer) - pos
                    file_note["parse_error"] = exc.msg
                    file_note["file_bytes"] = size
                    return
                file_note.setdefault("bad_json_records", []).append(
                    {"record": index, "from_char": consumed + pos, "chars": closed_at - pos, "error": exc.msg}
                )
                obj, end = BadRecord("invalid_json"), closed_at
            yield obj
            index += 1
            pos = end


def iter_jsonl(path: Path, file_note: dict) -> Iterator[object]:
    with open(path, "r", encoding="utf-8-sig", errors="replace") as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                file_note.setdefault("bad_json_lines", []).append(line_no)
                yield BadRecord("invalid_json")


def iter_source_records(path: Path, file_note: dict) -> Iterator[object]:
    if path.suffix == ".jsonl":
        return iter_jsonl(path, file_note)
    return iter_json_array(path, file_note)


def content_hash(messages: list[dict]) -> str:
    blob = json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def text_of(content: object) -> str:
    """A turn's text: a string, or OpenAI chat's list of parts whose text parts are joined
    (with newlines, as OpenAI-compatible servers flatten them). A part that is not text (an
    image, audio) has no place in a text drafter's data: the record is rejected for it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise BadRecord("non_string_content")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type", "text") != "text":
            raise BadRecord("non_text_content" if isinstance(part, dict) else "non_string_content")
        if not isinstance(part.get("text"), str):
            raise BadRecord("non_string_content")
        texts.append(part["text"])
    return "\n".join(texts)


def normalise(
    record: object, leading_assistant: str, require_assistant: bool = True
) -> tuple[str | None, list[dict], list[str]]:
    """Return (record id or None, messages, repairs) or raise BadRecord.

    ``require_assistant``: a training conversation needs an assistant turn to learn from; an
    eval prompt (eaglenest.stages.eval_sets) does not."""
    if isinstance(record, BadRecord):
        raise record
    if not isinstance(record, dict):
        raise BadRecord("not_an_object")
    if "conversations" in record:
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
    else:
        raise BadRecord("missing_messages")
    if not isinstance(turns, list) or not turns:
        raise BadRecord("no_turns")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise BadRecord("turn_missing_field")
        role = ROLE_ALIASES.get(str(turn[role_key]).strip().lower())
        if role is None:
            raise BadRecord("unknown_role")
        content = text_of(turn[text_key])
        if not content.strip():
            raise BadRecord("empty_turn")
        messages.append({"role": role, "content": content})
    repairs = []
    system = [m for m in messages[:1] if m["role"] == "system"]
    dialog = messages[len(system):]
    if any(m["role"] == "system" for m in dialog):
        raise BadRecord("system_turn_not_first")
    if dialog and dialog[0]["role"] == "assistant":
        if leading_assistant == "reject":
            raise BadRecord("starts_with_assistant")
        while dialog and dialog[0]["role"] == "assistant":
            dialog = dialog[1:]
        repairs.append("dropped_leading_assistant_turn")
    if not dialog:
        raise BadRecord("no_user_turn")
    for previous, current in zip(dialog, dialog[1:]):
        if previous["role"] == current["role"]:
            raise BadRecord("roles_not_alternating")
    if require_assistant and not any(m["role"] == "assistant" for m in dialog):
        raise BadRecord("no_assistant_turn")
    record_id = record.get("id")
    if record_id is not None and not isinstance(record_id, (str, int)):
        raise BadRecord("bad_id")
    return (None if record_id is None else str(record_id)), system + dialog, repairs


def ingest(
    sources: Iterable[dict],
    output_path: str | os.PathLike,
    report_path: str | os.PathLike,
    max_conversations: int | None = None,
    leading_assistant: str = "drop_turn",
) -> IngestReport:
    """Normalise every source into one conversations.jsonl, with a report of what was dropped.

    ``sources``: dicts with ``name`` (namespace of sample ids) and ``path``; one with
    ``synthesize`` holds prompts the target wrote, kept without an assistant turn.
    The first ``max_conversations`` valid conversations (in source order) are kept.
    """
    report = IngestReport()
    seen = SeenRecords()
    lines: list[str] = []
    missing = [source["path"] for source in sources if not Path(source["path"]).is_file()]
    if missing:
        raise FileNotFoundError(f"conversation source(s) not found: {', '.join(missing)}")
    for source in sources:
        path = Path(source["path"])
        note: dict = {"name": source["name"], "path": str(path), "records": 0}
        report.files.append(note)
        for record in iter_source_records(path, note):
            note["records"] += 1
            report.records_read += 1
            try:
                # a synthesized source holds prompts only: regenerate answers them
                record_id, messages, repairs = normalise(record, leading_assistant, not source.get("synthesize"))
            except BadRecord as bad:
                report.rejected[bad.reason] += 1
                continue
            content_key = content_hash(messages)
            sample_id = f"{source['name']}:{record_id if record_id is not None else content_key}"
            if seen.repeat(report, sample_id, content_key):
                continue
            if max_conversations is not None and report.kept >= max_conversations:
                report.capped += 1
                continue
            seen.add(sample_id, content_key)
            report.repaired.update(repairs)
            report.kept += 1
            lines.append(json.dumps({"sample_id": sample_id, "messages": messages}, ensure_ascii=False))
    atomic.write_text(output_path, "\n".join(lines) + ("\n" if lines else ""))
    atomic.write_json(report_path, report.to_json())
    return report


@dataclass
class SeenRecords:
    """The ids and contents kept so far: a record repeating either is counted by reason and skipped."""

    ids: set = field(default_factory=set)
    contents: set = field(default_factory=set)

    def repeat(self, report: IngestReport, record_key: str, content_key: str) -> bool:
        reason = "duplicate_id" if record_key in self.ids else "duplicate_content" if content_key in self.contents else None
        if reason is not None:
            report.rejected[reason] += 1
        return reason is not None

    def add(self, record_key: str, content_key: str) -> None:
        self.ids.add(record_key)
        self.contents.add(content_key)


def read_conversations(path: str | os.PathLike) -> Iterator[dict]:
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)
