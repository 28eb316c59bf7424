"""Aux layer ids: the run's ids, resolved and checked once, and their SGLang translation.

eaglenest stores layer ids in HF convention everywhere (shard headers, config, drafter
config): id i is the input of decoder layer i, i.e. ``hidden_states[i]`` of a
transformers forward with ``output_hidden_states=True`` (0 = embeddings).

SGLang captures the input of every layer listed in its model's ``layers_to_capture``
(the same convention), but ``set_eagle3_layers_to_capture(ids)`` — the only way in from
``--return-aux-hidden-state-layer-ids`` or a drafter's ``eagle_aux_hidden_state_layer_ids``
— rewrites the ids it is given, differently per model class in sglang 0.5.23:

* Llama/Qwen2/Qwen3: always adds 1 (it reads ids as "output of layer i").
* DeepseekV2/DeepseekV3 (and Kimi-K2.5, whose hook delegates to its DeepseekV3
  language model): adds 1 only when the first id is 1, so SpecForge-style configs
  ``[1, 29, 57]`` and HF ids ``[2, 30, 58]`` both capture HF layers ``[2, 30, 58]``.

Getting this wrong shifts every aux layer by one and silently costs acceptance rate,
so both directions live here and are tested against the pinned sglang source.
"""

from __future__ import annotations


def default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's aux layers in HF convention (input of decoder layer i): low, middle, high."""
    return [2, num_layers // 2, num_layers - 3]


def resolve(requested, num_layers: int) -> list[int]:
    """extract.layer_ids ("default", None or a list) as the checked list every stage stores.

    Ids must lie in [0, num_layers) and increase strictly: SGLang concatenates its captures
    in layer order, so unsorted or repeated ids would scramble the drafter's fc input silently.
    """
    ids = default_layer_ids(num_layers) if requested in (None, "default") else [int(i) for i in requested]
    if not ids:
        raise ValueError("extract.layer_ids is empty: give at least one aux layer, or \"default\"")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"extract.layer_ids {bad} outside [0, {num_layers}) for a {num_layers}-layer target "
            "(HF convention: id i is the input of decoder layer i)"
        )
    if any(a >= b for a, b in zip(ids, ids[1:])):
        raise ValueError(
            f"extract.layer_ids {ids} must be sorted and unique: SGLang concatenates the captured "
            "layers in layer order, so the stored aux hidden states follow that order"
        )
    return ids


# Model classes whose set_eagle3_layers_to_capture adds 1 to every id.
ADDS_ONE_ALWAYS = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})
# Model classes whose set_eagle3_layers_to_capture adds 1 only when the first id is 1.
ADDS_ONE_WHEN_FIRST_IS_ONE = frozenset(
    {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"}
)


def _family(architecture: str) -> str:
    if architecture in ADDS_ONE_ALWAYS:
        return "always"
    if architecture in ADDS_ONE_WHEN_FIRST_IS_ONE:
        return "first_is_one"
    known = sorted(ADDS_ONE_ALWAYS | ADDS_ONE_WHEN_FIRST_IS_ONE)
    raise ValueError(
        f"no SGLang layer-id convention known for architecture {architecture!r}; known: {known}. "
        "Read its set_eagle3_layers_to_capture in the pinned sglang and add it to eaglenest/target_model/layer_ids.py."
    )


def sglang_captured_layers(sglang_ids: list[int], architecture: str) -> list[int]:
    """The HF-convention layers SGLang captures when given ``sglang_ids`` (mirrors sglang 0.5.23)."""
    ids = [int(i) for i in sglang_ids]
    if _family(architecture) == "always" or (ids and ids[0] == 1):
        return [i + 1 for i in ids]
    return ids


def hf_to_sglang(hf_ids: list[int], architecture: str) -> list[int]:
    """Ids to hand to SGLang's set_eagle3_layers_to_capture so it captures HF layers ``hf_ids``."""
    ids = [int(i) for i in hf_ids]
    if not ids:
        raise ValueError("no aux layer ids given")
    if _family(architecture) == "always":
        if min(ids) < 1:
            raise ValueError(
                f"HF aux layer 0 (the embeddings) cannot be captured through {architecture}'s "
                f"set_eagle3_layers_to_capture, which adds 1 to every id; got {ids}"
            )
        sglang_ids = [i - 1 for i in ids]
    else:
        if ids[0] == 1:
            raise ValueError(
                f"{architecture}'s set_eagle3_layers_to_capture turns a leading 1 into 2, so HF ids "
                f"starting with 1 cannot be captured; got {ids}. Choose another first aux layer."
            )
        sglang_ids = ids  # passed through unchanged when the first id is not 1
    assert sglang_captured_layers(sglang_ids, architecture) == ids
    return sglang_ids


def sglang_to_hf(sglang_ids: list[int], architecture: str) -> list[int]:
    """HF ids for ids written in SGLang's convention (e.g. a SpecForge drafter config)."""
    return sglang_captured_layers(sglang_ids, architecture)
