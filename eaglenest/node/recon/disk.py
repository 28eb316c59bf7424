"""Room for what the workflow still has to write (the extraction preflight's own arithmetic)."""

from __future__ import annotations

import shutil
from pathlib import Path

from eaglenest import plan
from eaglenest.node.recon.status import BLOCK, OK, WARN
from eaglenest.node.recon.workflow import hidden_location


# Below this much headroom over the preflight's need, the disk check warns.
DISK_MARGIN = 0.10


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk(config: dict, workdir: Path, workflow: dict) -> dict:
    """Free space where the hidden shards go vs what the extract preflight will ask for."""
    location = _existing_ancestor(hidden_location(config, workdir))
    free = shutil.disk_usage(location).free
    shards_left = len(workflow["to_build"]) + len(workflow["rebuild_after_rm"])
    needed = workflow["remaining_tokens"] * workflow["bytes_per_token"]
    reserve = config["extract"]["disk_reserve_mb"] << 20
    text = (f"{shards_left} shards left need {plan.human_bytes(needed)} + reserve {plan.human_bytes(reserve)}, "
            f"{plan.human_bytes(free)} free at {location}")
    result = {"location": str(location), "free_bytes": free, "needed_bytes": needed, "reserve_bytes": reserve,
              "shards_left": shards_left, "tokens_source": workflow["remaining_tokens_source"],
              "checkpoints": "not applicable (no training stage yet)"
              if not workflow["later_stages"]["checkpoints"]["rules"] else "not estimated", "steps": []}
    if needed + reserve > free:
        result["status"] = BLOCK
        result["summary"] = f"too small: {text}"
        result["steps"].append({"command": None, "why": f"free {plan.human_bytes(needed + reserve - free)} on "
                                f"{location} (the extract preflight will refuse)"})
    elif (needed + reserve) * (1 + DISK_MARGIN) > free:
        result["status"], result["summary"] = WARN, f"less than {DISK_MARGIN:.0%} margin: {text}"
    else:
        result["status"], result["summary"] = OK, text
    return result
