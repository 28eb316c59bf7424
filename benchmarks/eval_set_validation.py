"""Validation accuracy of saved drafters on an evaluation set's greedy references, teacher-forced,
as training validates: the set's prompts with the target's own greedy answers (the references the
evaluator decoded, results/<run>/evaluate/<set>/reference/), made into a run by the real workflow
up to consolidate and scored at TTT positions 0 to ttt_length - 1, once per storage dtype of the
hidden states.

It separates two reasons a drafter accepts less on a set than it validates on held-out training
conversations: the set is harder (its accuracy here is as low as its acceptance) or the drafter
sees something else when it drafts than when it trains (accuracy here well above the acceptance
at depth 1). The dtypes separate the fp8 hidden states a drafter trains on from the full-precision
ones the evaluator gives it.

    python benchmarks/eval_set_validation.py --eval-set mt_bench \\
        --references results/<run>/evaluate/mt_bench/reference/chunks \\
        --drafter seed1=resources/drafters/<a> --drafter greedy=resources/drafters/<b> \\
        --config config/h200-smollm2.yaml --config config/h200/own-answers.yaml \\
        --dtype float8_e4m3 --dtype float32 --cores 2 --out benchmarks/results/eval_set_validation_<date>.json

With ``--conversations FILE`` in place of ``--references``, the conversations are ones the target
answered as the regenerate stage writes them (e.g. its greedy answers to prompts it wrote itself,
``data.sources`` with ``synthesize:``), scored as they stand.

``--by-confidence`` splits each accuracy by how sure the target is of the token to guess (its
probability of its own top token, binned): a set whose target is often unsure validates lower
with the same drafter.

Prints one row per (dtype, drafter) and writes them to ``--out`` as JSON, with how many answers
the chat template gives back token for token (the rest differ in a token or two at the joins).
"""
import argparse
import contextlib
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from heldout_validation import build_run, run_overlay, score_drafters  # noqa: E402

from eaglenest.layout import eval_set_path  # noqa: E402
from eaglenest.node.recon.config import load_config  # noqa: E402
from eaglenest.stages import evaluate, prepare  # noqa: E402
from eaglenest.training import loop  # noqa: E402


def references(chunks_dir: Path) -> list[dict]:
    """Every prompt's reference (id, tokens, eos ids) from the evaluator's chunk files, in order."""
    chunks = sorted(chunks_dir.glob("*.json"), key=lambda p: int(p.stem))
    if not chunks:
        raise SystemExit(f"{chunks_dir}: no reference chunks (rule evaluate_reference writes them)")
    rows = []
    for path in chunks:
        chunk = json.loads(path.read_text())
        rows += [{**prompt, "eos_token_ids": chunk["eos_token_ids"]} for prompt in chunk["per_prompt"]]
    return rows


def conversations(eval_set: str, prompts_path: Path, refs: list[dict], tokenizer) -> tuple[list[dict], int, int]:
    """One conversation per prompt: the prompt and the target's greedy answer as text (its end of
    sequence left to the chat template); how many answers re-tokenize to the very tokens; and the
    answers' tokens. The positions a drafter is scored on are these and one per answer, the end of
    turn the chat template closes it with, less those whose target argmax is outside the draft
    vocabulary (they count in no accuracy, as in training's validation)."""
    prompts = {p["id"]: p for p in evaluate.load_prompts(eval_set, prompts_path, None)}
    rows, exact, answer_tokens = [], 0, 0
    for ref in refs:
        # the answer the evaluator drafts on: its output, not the lookahead decoded beyond it
        tokens = list(ref["tokens"][:ref.get("output_length", len(ref["tokens"]))])
        while tokens and tokens[-1] in ref["eos_token_ids"]:
            tokens.pop()
        messages = [*prompts[ref["id"]]["messages"],
                    {"role": "assistant", "content": tokenizer.decode(tokens, skip_special_tokens=False)}]
        answer_tokens += len(tokens)
        rows.append({"sample_id": f"{eval_set}:{ref['id'].replace('/', '-')}", "messages": messages})
        opened = prepare.prompt_ids(tokenizer, messages[:-1])
        full = tokenizer(prepare.render(tokenizer, messages, False), add_special_tokens=False)["input_ids"]
        exact += full[len(opened):len(opened) + len(tokens)] == tokens and full[:len(opened)] == opened
    return rows, exact, answer_tokens


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eval-set", default="mt_bench", help="mt_bench or humaneval")
    parser.add_argument("--references", type=Path, default=None, help="the evaluator's reference chunks folder")
    parser.add_argument("--conversations", type=Path, default=None,
                        help="instead of --references: conversations the target answered, as the regenerate stage "
                             "writes them (JSONL with sample_id and messages), e.g. its answers to prompts it wrote")
    parser.add_argument("--prompts", type=Path, default=None,
                        help="the set's prompts file (default: where the workflow fetches the set, resources/eval/)")
    parser.add_argument("--drafter", action="append", required=True, metavar="NAME=PATH",
                        help="repeatable; the first one's draft vocabulary is the runs'")
    parser.add_argument("--config", action="append", default=[], help="repeatable: the configs of the drafters' run")
    parser.add_argument("--dtype", action="append", default=None,
                        help="repeatable: storage dtype of the hidden states (default: the configs')")
    parser.add_argument("--by-confidence", action="store_true",
                        help="also split each drafter's accuracy by the target's probability of its own top token")
    parser.add_argument("--confidence-edges", type=float, nargs="+", default=None, metavar="P",
                        help="with --by-confidence: the bins' inner edges, ascending (default 0.3 0.5 0.7 0.9)")
    parser.add_argument("--cores", type=int, default=os.cpu_count())
    parser.add_argument("--device", default="cpu",
                        help="where the target's hidden states are extracted and the drafters scored (cpu, cuda)")
    parser.add_argument("--rows-per-step", type=int, default=1,
                        help="rows of data.max_len tokens scored at once (1 keeps a CPU's memory at a few GB; "
                             "a GPU takes more)")
    parser.add_argument("--directory", type=Path, default=REPO, help="the workflow's working directory")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if (args.references is None) == (args.conversations is None):
        parser.error("give --references (an eval set's) or --conversations (answered conversations)")
    if args.confidence_edges is not None:
        try:
            args.confidence_edges = loop.confidence_edges(args.confidence_edges)
        except ValueError as error:
            parser.error(f"--confidence-edges: {error}")
    drafters = {name: str(Path(path).resolve()) for name, path in (item.split("=", 1) for item in args.drafter)}
    args.out = args.out.resolve()
    source = (args.references or args.conversations).resolve()
    args.prompts = args.prompts.resolve() if args.prompts else None
    args.directory = args.directory.resolve()
    args.config = [str(Path(config).resolve()) for config in args.config]
    work = args.directory / "results" / "eval-set-validation"
    work.mkdir(parents=True, exist_ok=True)
    with contextlib.chdir(args.directory):
        base = load_config(args.directory, args.config)
        tokenizer = prepare.load_tokenizer(base["target"]["path"])
        if args.conversations:
            args.eval_set = args.conversations.stem  # names the run; its rows keep their sample ids
            rows_in = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
            # the regenerate stage's rows, or benchmarks/heldout_eval_set.py's ({"id", "messages"})
            rows_in = [{"sample_id": row.get("sample_id", row.get("id")), "messages": row["messages"]} for row in rows_in]
            exact, answer_tokens = None, None
        else:
            prompts = args.prompts or Path(eval_set_path(args.eval_set))
            rows_in, exact, answer_tokens = conversations(args.eval_set, prompts, references(source), tokenizer)
        path = work / f"{args.eval_set}.jsonl"
        path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows_in))
        # A run of its own per set of conversations: the workflow does not re-extract a shard
        # whose prepared input changed (consolidate refuses it as stale).
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:10]
        rows, timings = [], {}
        for dtype in args.dtype or [base["extract"]["dtype"]]:
            overlay = run_overlay(f"eval-set-validation-{args.eval_set}-{dtype}-{digest}", path, len(rows_in), len(rows_in),
                                  args.device, next(iter(drafters.values())))
            overlay["extract"]["dtype"] = dtype
            overlay_path = work / f"{overlay['run']}.yaml"
            overlay_path.write_text(yaml.safe_dump(overlay, sort_keys=False))
            started = time.monotonic()
            config = build_run(args.directory, [*args.config, str(overlay_path)], args.cores,
                               work / f"{overlay['run']}.snakemake.log")
            timings[f"{dtype}_data_s"] = round(time.monotonic() - started, 1)
            rows += score_drafters(config, args.directory, drafters, args.rows_per_step, dtype, timings, args.by_confidence,
                                   args.confidence_edges)
    table = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores", "device": args.device,
             "eval_set": args.eval_set, "references": str(source), "prompts": len(rows_in),
             "answers_token_for_token": exact, "answer_tokens": answer_tokens, "configs": args.config, "seconds": timings, "rows": rows}
    args.out.write_text(json.dumps(table, indent=1))
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
