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
"""
import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eaglenest.stages import ingest  # noqa: E402


def heldout(split_path: Path, conversations_paths: Path | list[Path], count: int | None) -> list[dict]:
    val = set(json.loads(split_path.read_text())["val"])
    paths = [conversations_paths] if isinstance(conversations_paths, Path) else conversations_paths
    rows = [{"id": c["sample_id"], "messages": c["messages"]}
            for path in paths for c in ingest.read_conversations(path) if c["sample_id"] in val]
    rows.sort(key=lambda row: hashlib.sha256(row["id"].encode()).hexdigest())
    return rows[:count] if count else rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", type=Path, required=True)
    parser.add_argument("--conversations", type=Path, nargs="+", required=True,
                        help="conversations.jsonl, or a regenerated folder's shard-*.jsonl")
    parser.add_argument("--count", type=int, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    rows = heldout(args.split, args.conversations, args.count)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{len(rows)} held-out conversations -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
