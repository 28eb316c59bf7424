"""Cross-check of the vLLM export against an independent EAGLE-3 implementation (speculators).

speculators==0.9.0 runs in its own virtual environment (tests/support/peer_env.sh; cached under
EAGLENEST_PEER_VENV, default ~/.cache/eaglenest/peer-speculators-0.9.0). Its
Eagle3DraftModel.from_pretrained loads our export, with the verifier (our tiny target)
from a local directory and the hub switched off, and must produce our draft logits for
every training-time-test step on the same hidden states and ids.

Our side runs eaglenest's own training unroll (eaglenest.training.objective.TTTObjective.unroll), with no
adjustment: both rotate TTT step j at position t + j.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglenest.stages import export
from eaglenest.training.objective import TTTObjective
from eaglenest.model.drafter import Eagle3Drafter

pytestmark = pytest.mark.workflow

REPO = Path(__file__).resolve().parents[1]
TTT_STEPS = 3
# flex attention (speculators' default) wants the sequence in whole 128-token blocks.
LENGTH = 128


@pytest.fixture(scope="session")
def peer_python() -> str:
    result = subprocess.run(["bash", str(REPO / "tests" / "support" / "peer_env.sh")], capture_output=True, text=True)
    assert result.returncode == 0, f"tests/support/peer_env.sh failed:\n{result.stderr[-3000:]}"
    return result.stdout.strip().splitlines()[-1]


def _our_ttt_logits(drafter: Eagle3Drafter, ids, aux) -> list[torch.Tensor]:
    """Our training unroll's logits per TTT step on the ids speculators reads at step j
    (ids[t + j], zeros past the end). The unroll reads x_{t+1+j}, so its row is the ids after
    one leading filler token, with one more (causally invisible) position at the end."""
    length = ids.shape[1]
    batch = {
        "input_ids": torch.cat([ids.new_zeros(1, 1), ids], dim=1),
        "aux_hidden": torch.cat([aux, aux.new_zeros(1, 1, aux.shape[-1])], dim=1),
        "segment_ids": torch.zeros(1, length + 1, dtype=torch.long),
        "position_ids": torch.arange(length + 1)[None],
    }
    objective = TTTObjective(drafter, ttt_length=TTT_STEPS)
    with torch.no_grad():
        return [drafter.compute_logits(normed[:, :length]) for _, normed in objective.unroll(batch)]


@pytest.mark.parametrize("include_embed_tokens", [False, True], ids=["lean-export", "export-with-embedding"])
def test_speculators_loads_our_vllm_export_and_drafts_the_same_logits(
    include_embed_tokens, peer_python, tiny_llama, tmp_path
):
    from test_export import _random_drafter

    drafter = _random_drafter(tiny_llama, seed=3)
    identity = export.target_identity(tiny_llama, "tiny")
    export_dir = export.write_vllm_export(tmp_path / "vllm", drafter.state_dict(), drafter.config.to_dict(),
                                          identity, dtype=torch.float32, include_embed_tokens=include_embed_tokens)
    generator = torch.Generator().manual_seed(7)
    inputs = {
        "input_ids": torch.randint(0, drafter.config.vocab_size, (1, LENGTH), generator=generator),
        "aux_hidden": torch.randn(1, LENGTH, 3 * drafter.config.target_hidden_size, generator=generator),
        "position_ids": torch.arange(LENGTH)[None],
    }
    save_file(inputs, str(tmp_path / "inputs.safetensors"))

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    mode = "embedding-from-export" if include_embed_tokens else "embedding-from-verifier"
    result = subprocess.run(
        [peer_python, str(REPO / "tests" / "support" / "peer_eagle3_forward.py"), str(export_dir),
         str(tmp_path / "inputs.safetensors"), str(tmp_path / "peer.safetensors"), str(TTT_STEPS), mode],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    peer = load_file(str(tmp_path / "peer.safetensors"))

    assert torch.equal(peer["embed_tokens"], drafter.embed_tokens.weight)
    assert torch.equal(peer["d2t"], drafter.d2t) and torch.equal(peer["t2d"], drafter.t2d)
    ours = _our_ttt_logits(drafter, inputs["input_ids"], inputs["aux_hidden"])
    for step in range(TTT_STEPS):
        torch.testing.assert_close(peer[f"logits_{step}"], ours[step], rtol=0, atol=1e-4,
                                   msg=lambda m, step=step: f"TTT step {step}: {m}")
