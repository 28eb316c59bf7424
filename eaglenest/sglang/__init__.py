"""The SGLang backend: the extraction client, the server launcher and the in-server plugin."""

# The first command of every server rule's shell (rules/common.smk), before it execs the
# launcher: the service file must exist within --latency-wait, long before a model is loaded,
# and it names the shell's pid, which exec hands to the launcher. So a launcher that dies
# before writing its own state (an env without eaglenest, a bad interpreter) fails its clients
# at their next poll (eaglenest.sglang.launch.wait_for_service), not after minutes. A
# Snakemake shell template: braces doubled, {output:q} the service file.
SERVICE_STARTING_SHELL = (
    """printf '{{"state": "starting", "host": "%s", "launcher_pid": %d}}\\n' "$(uname -n)" $$ > {output:q}"""
)
