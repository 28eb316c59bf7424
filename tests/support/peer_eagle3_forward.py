"""Runs inside the speculators environment (tests/support/peer_env.sh), never in eaglenest's.

Loads an eaglenest vLLM export with speculators' own Eagle3DraftModel and writes the draft
logits of every TTT step for the inputs given, so tests/test_export_peer.py
can compare them with eaglenest's drafter. Nothing of eaglenest is imported here.

    python peer_eagle3_forward.py EXPORT_DIR INPUTS.safetensors OUTPUT.safetensors TTT_STEPS \
        {embedding-from-verifier|embedding-from-export}
"""

import sys

import torch
from safetensors.torch import load_file, save_file
from speculators.models.eagle3 import Eagle3DraftModel


def main(export_dir: str, inputs_path: str, output_path: str, ttt_steps: int, embedding_from_verifier: bool) -> None:
    inputs = load_file(inputs_path)
    model = Eagle3DraftModel.from_pretrained(export_dir)
    if embedding_from_verifier:
        # An export without embed_tokens: speculators 0.9.0 under transformers 5.19 leaves the
        # missing embedding uninitialised instead of NaN, so its own "load from the verifier
        # if NaN" fallback never fires. Ask its loader for the verifier's embedding explicitly.
        model._load_verifier_weights(overwrite_embed_tokens=True)
    model.eval()
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and tensor.isnan().any():
            raise SystemExit(f"peer left {name} unloaded (NaN)")
    out = {"embed_tokens": model.embed_tokens.weight.detach().clone()}

    step_logits = []
    model.lm_head.register_forward_hook(lambda _module, _args, out: step_logits.append(out.detach().clone()))
    with torch.no_grad():
        # No verifier states: the peer's loss aligns targets in its own data convention
        # (docs/export.md), so only the draft logits are compared.
        model(
            hidden_states=inputs["aux_hidden"],
            input_ids=inputs["input_ids"],
            document_ids=torch.zeros_like(inputs["input_ids"]),
            position_ids=inputs["position_ids"],
            ttt_steps=ttt_steps,
        )
    out.update({f"logits_{step}": logits.contiguous() for step, logits in enumerate(step_logits)})
    out["d2t"] = model.d2t.clone()
    out["t2d"] = model.t2d.clone()
    save_file(out, output_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "embedding-from-verifier")
