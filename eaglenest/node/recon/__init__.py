"""Post-crash reconnaissance: what survived, what is running, what is broken, what to run next.

``eaglenest recon`` reads; it never kills or deletes unless given ``--fix``, and then only
the safe subset (temp files of dead writers, Snakemake locks with no Snakemake alive).

Every check returns a plain, JSON-ready dict with a ``status`` (``ok``, ``warn``,
``block`` or ``not applicable``), a one-line ``summary``, its details, and the
``steps`` (ordered commands with the reason) it asks for. :func:`recon` runs them all
and adds the verdict: the blockers, the ordered steps and one next command.

Workflow state follows the workflow's own path conventions (rules/common.smk) and
predicts what ``snakemake -n`` plans; stages that other rule files will add are found
by their output directories under results/<run>/ and reported "not applicable" while
the workflow has no rule file for them.

One module per concern: ``status`` (what a check returns), ``config``, ``processes``, ``gpus``,
``servers``, ``workflow`` (outputs against the plan), ``disk``, ``software`` (code and target
model) and ``report`` (the verdict, the text, the CLI entry). The names below are the
package's interface: the CLI, the tests and the chaos harness use them.
"""

from eaglenest.node.recon.status import BLOCK, NA, OK, ReconError, REPO, WARN
from eaglenest.node.recon.config import load_config
from eaglenest.node.recon.processes import (
    check_snakemake, describe_process, is_snakemake, KIND_LABELS, kind_with_parents, list_processes,
    OURS, process_kind, read_proc_text, snakemake_directory,
)
from eaglenest.node.recon.gpus import (
    check_gpus, gpu_report, HELD_MEMORY_MIB, NVIDIA_SMI_APPS_QUERY, NVIDIA_SMI_GPU_QUERY,
    parse_apps_query, parse_gpu_query, run_nvidia_smi,
)
from eaglenest.node.recon.servers import (
    check_servers, configured_server_url, listening_ports, parse_proc_net_tcp, probe_server,
    server_mismatch, socket_owners,
)
from eaglenest.node.recon.workflow import (
    check_workflow, hidden_location, incomplete_markers, LATER_JOBS, later_jobs, LATER_STAGES,
    output_problem, writer_alive,
)
from eaglenest.node.recon.disk import check_disk, DISK_MARGIN
from eaglenest.node.recon.software import (
    check_code, check_target_model, safetensors_intact, sglang_patch_state,
)
from eaglenest.node.recon.report import (
    exit_code, fix, main, recon, render, SECTION_TITLES, snakemake_command, STATUS_LABELS, verdict,
)
