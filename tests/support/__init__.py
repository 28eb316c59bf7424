"""Test tools, not part of the eaglenest package: tiny random-weight targets (tiny), the chaos
harness (chaos), the stand-in SGLang server (standin_server), the peer-implementation helpers
(peer_env.sh, peer_eagle3_forward.py) and the group-job planner (group_jobs).

The tests import them as ``support.<name>`` (tests/ is on the test session's path); the
stand-in server and the chaos harness also run as scripts from a source checkout:

    python tests/support/chaos.py --workdir /tmp/chaos --kills 20 --seed 1
    python tests/support/standin_server.py --model DIR --target NAME --port 30000
"""

from pathlib import Path

import sys

# The stand-in server's script, and the command that the tests put in EAGLENEST_SGLANG_COMMAND
# so that the launcher starts it, with SGLang's flags, in place of SGLang.
STANDIN_SERVER = Path(__file__).resolve().parent / "standin_server.py"
STANDIN_COMMAND = f"{sys.executable} {STANDIN_SERVER}"
