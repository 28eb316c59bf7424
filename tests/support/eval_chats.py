"""Chats of a user's own eval set for the tests: a few records in each format ingest reads and bad
records with known reasons (tests/test_eval_sets.py, tests/test_evaluate.py)."""

from __future__ import annotations

import json

SYSTEM = {"role": "system", "content": "You answer support questions."}


def user_chats(path):
    """A few records in each format ingest reads, and bad ones with known reasons."""
    records = [
        # OpenAI, one turn: the prompt is the user turn.
        {"id": "o1", "messages": [{"role": "user", "content": "How do I reset my password?"},
                                  {"role": "assistant", "content": "Open settings."}]},
        # OpenAI, multi-turn with a system turn and content parts: the last answer is the target's to give.
        {"id": "o2", "messages": [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "My order is late."}]},
                                  {"role": "assistant", "content": "Which order?"},
                                  {"role": "user", "content": "Number 1234."},
                                  {"role": "assistant", "content": "It ships today."}]},
        # ShareGPT, multi-turn, no id: named by its content.
        {"conversations": [{"from": "human", "value": "Is there a student discount?"},
                           {"from": "gpt", "value": "Yes, 20 %."},
                           {"from": "human", "value": "How do I apply?"},
                           {"from": "gpt", "value": "Upload your card."}]},
        # ShareGPT, a prompt without an answer, after a greeting that is no part of it.
        {"id": "s2", "conversations": [{"from": "gpt", "value": "Hi! How can I help?"},
                                       {"from": "human", "value": "Cancel my plan."}]},
        # Bad: no user turn at all.
        {"id": "bad1", "conversations": [{"from": "gpt", "value": "Hello there."}]},
        # Bad: a role nobody knows.
        {"id": "bad2", "messages": [{"role": "customer", "content": "hi"}]},
        # Bad: the same id again.
        {"id": "o1", "messages": [{"role": "user", "content": "Another question"}]},
    ]
    lines = [json.dumps(record) for record in records]
    lines.insert(3, '{"id": "broken" "messages": []}')  # Bad: not JSON.
    path.write_text("\n".join(lines) + "\n")
    return path
