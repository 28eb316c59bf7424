"""Where every file of a run lives: the one place that knows the results layout.

rules/common.smk names its inputs and outputs with these functions, recon reads the same
paths to say what state a run is in, and the chaos harness uses them to tell which stage a
killed job belonged to. Paths are relative to the workflow's working directory (Snakemake's
``--directory``) unless ``root`` is given.

    results/<run>/data/                      ingest: conversations.jsonl, ingest_report.json
    results/<run>/regenerated/<key>/         regenerate (per shard), regenerate_report.json
    results/<run>/prepared/<key>/            prepare: shard-NNNNN.safetensors, prepare_report.json
    results/<run>/hidden/                    extract: shard-NNNNN.safetensors (or a link, extract.hidden_dir)
    results/<run>/sglang/                    extract: block-NNNNN.json, one per SGLang server
    results/<run>/consolidated/              consolidate: index.json, draft_vocab.safetensors, split.json
    results/<run>/train/                     train: drafter/, training_summary.json, checkpoints/
    results/<run>/export/                    export: sglang/, vllm/, export_report.json
    results/<run>/evaluate/                  evaluate: <set>/<drafting>/metrics.json, summary.json,
                                             <set>/prompts.jsonl, prompt_report.json (user sets)
    logs/<run>/                              one log per job
    logs/<run>/benchmarks/                   Snakemake's benchmark: files (seconds, memory per job)

Nothing here imports torch: planning a run stays cheap.
"""

from __future__ import annotations

from pathlib import Path

from eaglenest import plan

RESULTS = "results"
LOGS = "logs"
# Which stage writes each directory under results/<run>/.
STAGE_BY_DIR = {
    "data": "ingest",
    "regenerated": "regenerate",
    "prepared": "prepare",
    "hidden": "extract",
    "sglang": "extract",
    "consolidated": "consolidate",
    "train": "train",
    "export": "export",
    "evaluate": "evaluate",
}
CONSOLIDATED_FILES = ("index.json", "draft_vocab.safetensors", "split.json")
EVAL_SET_FILES = {"mt_bench": "mt_bench_question.jsonl", "humaneval": "HumanEval.jsonl.gz"}
EMBEDDED_TARGET_DIR = Path("resources") / "models" / "SmolLM2-135M-Instruct"


def shard_name(shard_id: int | str, suffix: str = ".safetensors") -> str:
    """shard-NNNNN<suffix>: five digits, the wildcard the rules constrain shard ids to."""
    return f"shard-{int(shard_id):05d}{suffix}"


def stage_of(path: str | Path) -> str | None:
    """The stage whose output ``path`` (anything under results/<run>/) is; None outside results/."""
    parts = Path(path).parts
    if RESULTS not in parts:
        return None
    index = parts.index(RESULTS)
    if len(parts) <= index + 2:
        return None
    return STAGE_BY_DIR.get(parts[index + 2], "other")


class RunLayout:
    """The paths of one run (``config["run"]``), as strings Snakemake can use directly."""

    def __init__(self, config: dict, root: str | Path | None = None):
        self.config = config
        self.run = config["run"]
        self.root = Path(root) if root is not None else None

    def _rooted(self, path: Path) -> Path:
        return self.root / path if self.root is not None else path

    @property
    def run_dir(self) -> Path:
        return self._rooted(Path(RESULTS) / self.run)

    def run_path(self, *parts: str) -> str:
        return str(self.run_dir.joinpath(*parts))

    def log_path(self, *parts: str) -> str:
        return str(self._rooted(Path(LOGS) / self.run).joinpath(*parts))

    def benchmark_path(self, *parts: str) -> str:
        return self.log_path("benchmarks", *parts)

    def benchmark_dir(self) -> str:
        return self.log_path("benchmarks")

    # ---- data ------------------------------------------------------------------------------

    def conversations(self) -> str:
        return self.run_path("data", "conversations.jsonl")

    def ingest_report(self) -> str:
        return self.run_path("data", "ingest_report.json")

    def source_path(self, source: dict) -> str:
        """A data source's file: the user's path, or where rule synthesize_prompts writes it."""
        if source.get("synthesize"):
            return self.synthesized_path(f"{source['name']}.jsonl")
        return source["path"]

    def synthesized_path(self, *parts: str) -> str:
        return self.run_path("data", "synthesized", *parts)

    def regenerated_path(self, *parts: str) -> str:
        return self.run_path("regenerated", plan.regeneration_key(self.config), *parts)

    def prepared_dir(self) -> str:
        return self.run_path("prepared", plan.prepared_key(self.config))

    def prepared_path(self, *parts: str) -> str:
        return str(Path(self.prepared_dir()).joinpath(*parts))

    def prepare_report(self) -> str:
        return self.prepared_path("prepare_report.json")

    # ---- hidden states ---------------------------------------------------------------------

    def hidden_dir(self) -> str:
        """results/<run>/hidden as the rules name it (a link to extract.hidden_dir when set)."""
        return self.run_path("hidden")

    def hidden_shard(self, shard_id: int | str) -> str:
        return self.run_path("hidden", shard_name(shard_id))

    def server_record(self, block: str) -> str:
        return self.run_path("sglang", f"block-{block}.json")

    def regenerate_server_record(self) -> str:
        """The service record of the one server all regenerate jobs use (rule regenerate_server)."""
        return self.run_path("sglang", "regenerate.json")

    def synthesize_server_record(self) -> str:
        """The service record of the server that writes synthesized prompts (rule synthesize_server)."""
        return self.run_path("sglang", "synthesize.json")

    def evaluate_server_record(self, setting: str) -> str:
        """The service record of the evaluation server of one drafting setting, or of the plain
        one (rule evaluate_server)."""
        return self.run_path("sglang", "evaluate", f"{setting}.json")

    # ---- later stages ----------------------------------------------------------------------

    def consolidated(self, name: str) -> str:
        return self.run_path("consolidated", name)

    def consolidated_files(self) -> list[str]:
        return [self.consolidated(name) for name in CONSOLIDATED_FILES]

    def drafter_dir(self) -> str:
        return self.run_path("train", "drafter")

    def training_summary(self) -> str:
        return self.run_path("train", "training_summary.json")

    def checkpoint_dir(self) -> str:
        return self.run_path("train", "checkpoints")

    def export_path(self, *parts: str) -> str:
        return self.run_path("export", *parts)

    def export_report(self) -> str:
        return self.export_path("export_report.json")

    def evaluation_path(self, *parts: str) -> str:
        return self.run_path("evaluate", *parts)

    def eval_prompts(self, eval_set: str) -> str:
        """A user eval set's prompts, ready for the evaluation jobs (rule evaluate_prompts)."""
        return self.evaluation_path(eval_set, "prompts.jsonl")

    def eval_prompt_report(self, eval_set: str) -> str:
        """What reading a user eval set kept and rejected, by reason."""
        return self.evaluation_path(eval_set, "prompt_report.json")


def eval_set_path(eval_set: str) -> str:
    """Where the fetch_eval_* rules unpack each eval set's prompts."""
    return str(Path("resources") / "eval" / EVAL_SET_FILES[eval_set])
