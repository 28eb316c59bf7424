"""A run's held-out conversations as an eval set file: the ``val`` ids of a consolidated
split.json, their ingested conversations (the original answers), the first ``--count`` in an
order fixed by a hash of each id, as ``{"id", "messages"}`` JSONL for ``evaluate.sets``'
``{name, path}`` entry. For a machine that has a run's split (e.g. brought back from the GPU
node) but not its consolidated shards, which the ``{name, split}`` entry would need.

    python benchmarks/heldout_eval_set.py --split split.json \\
        --conversations results/<run>/data/conversations.jsonl --count 100 --out heldout.jsonl

``--conversations`` takes several files: a regenerated folder's shards
(``results/<run>/regenerated/<key>/shard-*.jsonl``, the same rows with the target's answers)
give the same conversations as the target answered them.

Without a split.json, ``--val-fraction F --seed S`` (the run's ``consolidate`` settings) put each
conversation where consolidation puts it (eaglenest.stages.consolidate.in_validation).
``--whole-only`` keeps the held-out parts of a ShareGPT conversation (``<id>_<n>``) none of whose
other parts is among the training conversations. ``--first-answer-tokens N --tokenizer DIR``
keeps each conversation's first user turn and the first N tokens of its answer (by the target's
tokenizer): a position as the evaluator drafts it, a first answer with a short context.
``--training`` takes the conversations consolidation trains on instead, the same way: set beside
the held-out ones, they tell whether a drafter fits its own training data better than new data.
"""
import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eaglenest.stages import consolidate, ingest  # noqa: E402


def conversation_of(sample_id: str) -> str:
    """The ShareGPT conversation a part belongs to: ``sharegpt:abc_2`` -> ``sharegpt:abc``."""
    return re.sub(r"_\d+$", "", ingest.base_sample_id(sample_id))


def first_answer(messages: list[dict], tokens: int, tokenizer) -> list[dict] | None:
    """The first user turn and the first ``tokens`` tokens of the answer that follows it; None
    when no user turn is answered."""
    for k, message in enumerate(messages[:-1]):
        if message["role"] == "user" and messages[k + 1]["role"] == "assistant":
            ids = tokenizer(messages[k + 1]["content"], add_special_tokens=False)["input_ids"][:tokens]
            return [message, {"role": "assistant", "content": tokenizer.decode(ids)}]
    return None


def heldout(split_path: Path | None, conversations_paths: Path | list[Path], count: int | None,
            val_fraction: float | None = None, seed: int = 0, whole_only: bool = False,
            first_answer_tokens: int | None = None, tokenizer=None, training: bool = False) -> list[dict]:
    paths = [conversations_paths] if isinstance(conversations_paths, Path) else conversations_paths
    every = [c for path in paths for c in ingest.read_conversations(path)]
    if split_path is not None:
        val = set(json.loads(split_path.read_text())["val"])
    else:
        val = {c["sample_id"] for c in every if consolidate.in_validation(c["sample_id"], val_fraction, seed)}
    trained = {conversation_of(c["sample_id"]) for c in every if c["sample_id"] not in val}
    rows = []
    for c in every:
        # the side of the split asked for (held out, or with --training the other one)
        if (c["sample_id"] in val) == training or (whole_only and conversation_of(c["sample_id"]) in trained):
            continue
        messages = c["messages"]
        if first_answer_tokens is not None:
            messages = first_answer(messages, first_answer_tokens, tokenizer)
            if messages is None:
                continue
        rows.append({"id": c["sample_id"], "messages": messages})
    rows.sort(key=lambda row: hashlib.sha256(row["id"].encode()).hexdigest())
    return rows[:count] if count else rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", type=Path, default=None, help="the run's consolidated/split.json")
    parser.add_argument("--val-fraction", type=float, default=None,
                        help="without --split: the run's consolidate.val_fraction (and --seed)")
    parser.add_argument("--seed", type=int, default=0, help="the run's consolidate.seed")
    parser.add_argument("--whole-only", action="store_true",
                        help="only held-out parts whose ShareGPT conversation has no part in training")
    parser.add_argument("--training", action="store_true",
                        help="the training conversations instead: how well a drafter fits what it learned on")
    parser.add_argument("--first-answer-tokens", type=int, default=None,
                        help="keep the first user turn and this many tokens of its answer (needs --tokenizer)")
    parser.add_argument("--tokenizer", type=Path, default=None, help="the target's directory")
    parser.add_argument("--conversations", type=Path, nargs="+", required=True,
                        help="conversations.jsonl, or a regenerated folder's shard-*.jsonl")
    parser.add_argument("--count", type=int, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if (args.split is None) == (args.val_fraction is None):
        parser.error("give --split or --val-fraction")
    if args.training and args.whole_only:
        parser.error("--whole-only selects held-out conversations; --training takes the others")
    if (args.first_answer_tokens is None) != (args.tokenizer is None):
        parser.error("--first-answer-tokens and --tokenizer go together")
    tokenizer = None
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    rows = heldout(args.split, args.conversations, args.count, args.val_fraction, args.seed, args.whole_only,
                   args.first_answer_tokens, tokenizer, args.training)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{len(rows)} {'training' if args.training else 'held-out'} conversations -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
