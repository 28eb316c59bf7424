"""The ``eaglenest`` command: one subcommand per task, each in its own module.

To add a subcommand, write ``add_<name>(subcommands)`` that declares its arguments and
sets ``handler`` to a function taking the parsed arguments and returning the exit
status, and list it in ``SUBCOMMANDS``. Handlers import their module lazily so that
``eaglenest --help`` stays fast (torch is slow to import).
"""

from __future__ import annotations

import argparse
import sys


def _run_recon(args: argparse.Namespace) -> int:
    from eaglenest.node import recon

    return recon.main(args)


def add_recon(subcommands) -> None:
    parser = subcommands.add_parser(
        "recon",
        help="after a crash: what survived, what runs, what is broken, and the next command",
        description=(
            "Report GPUs, inference servers, workflow state (shards done/missing/partial/corrupt), "
            "Snakemake locks and incomplete markers, disk space, code and environment, then the "
            "ordered steps to resume. Exit status: 0 ready to resume, 1 blocked, 2 usage error."
        ),
    )
    parser.add_argument("--configfile", action="append", metavar="FILE",
                        help="config overriding config/config.yaml, as given to snakemake (repeatable)")
    parser.add_argument("--directory", "-d", default=".", metavar="DIR",
                        help="workflow working directory, as given to snakemake (default: current directory)")
    parser.add_argument("--deep", action="store_true", help="verify shard checksums, not only headers (reads every byte)")
    parser.add_argument("--json", action="store_true", help="print the full report as JSON")
    parser.add_argument("--server-url", metavar="URL", help="probe this inference server URL instead of the configured one")
    parser.add_argument("--fix", action="store_true",
                        help="remove temp files of dead writers and stale locks (only with no snakemake alive), then report")
    parser.set_defaults(handler=_run_recon)


def _run_add_embedding(args: argparse.Namespace) -> int:
    from eaglenest.stages import export

    out = export.add_embed_tokens(args.export, args.target, args.out)
    print(f"{out}: the target's embedding written; loads in EAGLE's reference code as it is")
    return 0


def add_add_embedding(subcommands) -> None:
    parser = subcommands.add_parser(
        "add-embedding",
        help="write the target's token embedding into a drafter export (for EAGLE's reference code)",
        description=(
            "Exports leave the drafter's embedding (a frozen copy of the target's) out when it is large, "
            "since SGLang and vLLM take the target's; EAGLE's reference code keeps a random one instead "
            "(docs/export.md). This writes the target's into an SGLang or vLLM export, in its dtype; "
            "config.json and every other tensor stay as they are."
        ),
    )
    parser.add_argument("export", help="the export's directory (config.json, model.safetensors)")
    parser.add_argument("--target", required=True, metavar="DIR", help="the target model's directory (its safetensors)")
    parser.add_argument("--out", metavar="DIR", help="write here instead of in place")
    parser.set_defaults(handler=_run_add_embedding)


SUBCOMMANDS = [add_recon, add_add_embedding]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eaglenest", description="Train EAGLE-3 speculative-decoding drafters.")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(subcommands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
