"""Random-weight targets built from a config, for tests and throughput benchmarks.

``make_tiny_target`` writes a transformers model directory (Llama, Qwen2 or any
architecture transformers builds from a config) with a small byte-level BPE tokenizer
trained on the spot and a ChatML chat template, so prepare/extract/train run on it
exactly as on a real target. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "What is the capital of France? The capital of France is Paris.",
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding drafts tokens that the target model verifies.",
    "1 2 3 4 5 6 7 8 9 10 hello world, how are you today?",
]


def make_tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_config(arch: str = "llama", vocab_size: int = 320, num_layers: int = 7, hidden_size: int = 64, **overrides):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    raise ValueError(f"unknown tiny architecture {arch!r}")


def make_tiny_target(path: str | Path, arch: str = "llama", seed: int = 0, **config_overrides) -> Path:
    """Write a random-weight causal LM + tokenizer to ``path``; returns the path."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    tokenizer = make_tokenizer()
    config = tiny_config(arch, vocab_size=len(tokenizer), **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


WORDS = (
    "the quick brown fox jumps over lazy dog hello world capital France Paris add "
    "return speculative decoding draft target model verify token"
).split()
# Training and evaluation settings that take seconds on the tiny target.
TINY_TRAIN = {"epochs": 1, "token_budget": 256, "rows_per_step": 2, "ttt_length": 2, "warmup_steps": 1, "threads": 1, "checkpoint_every": 5}
TINY_EVALUATE = {"sets": ["mt_bench"], "num_prompts": 1, "max_new_tokens": 4, "drafting": [{"steps": 2, "topk": 1, "tokens": 3}], "threads": 1}


def synthetic_conversations(path: str | Path, count: int, seed: int = 0, id_prefix: str = "c") -> Path:
    """A JSONL file of OpenAI-style multi-turn conversations with stable ids."""
    import json
    import random

    rng = random.Random(seed)
    with open(path, "w") as handle:
        for i in range(count):
            messages = []
            for _ in range(rng.randint(1, 3)):
                messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(3, 20)))})
                messages.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(3, 40)))})
            handle.write(json.dumps({"id": f"{id_prefix}{i}", "messages": messages}) + "\n")
    return Path(path)


def workflow_config(
    base: dict,
    target: str | Path,
    conversations: str | Path,
    run: str = "tiny",
    max_conversations: int = 40,
    samples_per_shard: int = 10,
    **train_overrides,
) -> dict:
    """``base`` (a workflow config) turned into a run on a tiny target made by make_tiny_target
    with its defaults: minutes of CPU for the whole pipeline."""
    config = dict(base, run=run)
    config["target"] = {"name": "tiny-llama", "path": str(target), "embedded": None, "num_layers": 7, "hidden_size": 64, "vocab_size": 320}
    config["data"] = dict(
        base["data"], sources=[{"name": "synthetic", "path": str(conversations)}],
        max_conversations=max_conversations, samples_per_shard=samples_per_shard, max_len=256,
    )
    config["extract"] = dict(base["extract"], disk_reserve_mb=0, threads=1, tokens_per_batch=2048)
    config["consolidate"] = dict(base["consolidate"], draft_vocab_size=64)
    config["train"] = {**base.get("train", {}), **TINY_TRAIN, **train_overrides}
    config["evaluate"] = dict(base.get("evaluate", {}), **TINY_EVALUATE)
    return config
