"""Does an eaglenest export load, as it is, in EAGLE's reference code, and draft what our drafter
drafts? SafeAILab/EAGLE's ``eagle/model/cnets.py`` ``Model`` is built from the export's
``config.json`` (its ``EConfig``) and loaded the way ``eagle/model/ea_model.py:76`` loads a
drafter (``load_state_dict(..., strict=False)``, at commit cb7e084); then both drafters run one
forward on the same random aux hidden states and token ids, in float32.

EAGLE is not a package: give its checkout (``--eagle-src``, the folder holding ``eagle/``). Its
rotary setup reads ``config.rope_scaling["type"]`` whenever ``rope_scaling`` is set
(``eagle/model/cnets.py:216-225``); under transformers 5.24 the export's ``rope_parameters``
set it without a ``type`` (a KeyError), so run it with a transformers 4 first on
``PYTHONPATH`` (EAGLE's ``setup.py:14`` pins 4.46.2; 4.53.3 was used).

    PYTHONPATH=<transformers 4.53> python benchmarks/eagle_reference_check.py \
        --eagle-src <EAGLE checkout> --export <export directory> --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--eagle-src", required=True, type=Path, help="a SafeAILab/EAGLE checkout")
    parser.add_argument("--export", required=True, type=Path, help="an eaglenest SGLang export (config.json, model.safetensors)")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(args.eagle_src))
    import transformers
    from eagle.model.cnets import Model
    from eagle.model.configs import EConfig
    from safetensors.torch import load_file

    from eaglenest.stages.export import drafter_from_export

    config = EConfig.from_pretrained(str(args.export / "config.json"))
    reference = Model(config, load_emb=False)
    tensors = load_file(str(args.export / "model.safetensors"))
    loaded = reference.load_state_dict(tensors, strict=False)
    result = {"export": str(args.export), "transformers": transformers.__version__,
              "tensors": len(tensors), "missing": loaded.missing_keys, "unexpected": loaded.unexpected_keys}
    if "embed_tokens.weight" in tensors:  # without it EAGLE's embedding stays random: nothing to compare
        reference = reference.float().eval()
        ours = drafter_from_export(args.export).float().eval()
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, config.vocab_size, (2, args.tokens), generator=generator)
        aux = 2 * torch.randn(2, args.tokens, 3 * config.target_hidden_size, generator=generator)
        with torch.no_grad():
            reference_logits = reference.lm_head(reference.norm(reference(aux, input_ids=ids)))
            our_logits, _ = ours(ids, aux)
        result.update(max_abs_logit_difference=(reference_logits - our_logits).abs().max().item(),
                      largest_logit=reference_logits.abs().max().item(),
                      argmax_agreement=(reference_logits.argmax(-1) == our_logits.argmax(-1)).float().mean().item())
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if not loaded.missing_keys and not loaded.unexpected_keys else 1


if __name__ == "__main__":
    sys.exit(main())
