"""How long train.compile takes to compile a training step's TTT unroll, on the CPU (inductor's
C++ backend): the first step compiles the forward graph of each of the 7 TTT steps, then their
backward graphs. The time grows with the graphs, so it ranks code changes for the GPU's compile
too, whose kernels are Triton's instead; absolute times are this machine's.

The drafter has a target's head structure (``--shape``: its heads, key/value heads and head
size) over a small hidden size, since the graphs' size does not depend on the widths. Each run
starts from an empty inductor cache. ``eaglenest`` is whatever ``import eaglenest`` finds: put
another checkout first on PYTHONPATH to time its code.

    python benchmarks/compile_time.py --shape kimi --out benchmarks/results/compile_time_cpu.json
    PYTHONPATH=<checkout of another commit> python benchmarks/compile_time.py --shape kimi --out ...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent))  # after PYTHONPATH: another checkout given there comes first
sys.path.insert(0, str(HERE))


def first_step(shape_name: str, hidden: int, tokens: int, ttt_length: int) -> dict:
    import torch
    import torch._dynamo

    # eaglenest first: train_throughput puts this checkout first on sys.path when imported.
    from eaglenest.model import drafter

    try:
        from eaglenest.training import objective as training
    except ImportError:  # a checkout from before eaglenest/training/: the objective was in the stage
        from eaglenest.stages import train as training

    import train_throughput

    heads = train_throughput.drafter_config(train_throughput.shape_of(shape_name, None))
    config = drafter.DrafterConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads.num_attention_heads,
        num_key_value_heads=heads.num_key_value_heads, head_dim=heads.head_dim, vocab_size=300,
        draft_vocab_size=100, target_hidden_size=64, max_position_embeddings=4 * tokens, aux_layer_ids=[1, 2, 3],
    )
    generator = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, 300, (1, tokens), generator=generator),
             "segment_ids": torch.zeros(1, tokens, dtype=torch.long),
             "position_ids": torch.arange(tokens)[None],
             "aux_hidden": torch.randn(1, tokens, 192, generator=generator)}
    torch.manual_seed(0)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # this run's graphs and breaks only
    model = drafter.Eagle3Drafter(config)
    if hasattr(training, "compile_drafter"):
        training.compile_drafter(model)
    else:  # a checkout from before compile_drafter: it compiled the layer alone
        model.midlayer.compile(dynamic=False)
    objective = training.TTTObjective(model, ttt_length, attention_backend="dense")
    began = time.perf_counter()
    logits = [model.compute_logits(normed) for _, normed in objective.unroll(batch)]
    forward = time.perf_counter() - began
    sum(out.float().sum() for out in logits).backward()
    total = time.perf_counter() - began
    counters = torch._dynamo.utils.counters
    return {"shape": shape_name, "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
            "head_dim": config.head_dim, "hidden": hidden, "tokens": tokens, "ttt_length": ttt_length,
            "forward_seconds": forward, "first_step_seconds": total,
            "graphs": counters["stats"].get("unique_graphs", 0), "graph_breaks": sum(counters["graph_break"].values()),
            "eaglenest": str(Path(drafter.__file__).resolve().parents[2]), "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="kimi", choices=["kimi", "smollm2"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--ttt-length", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory() as cache, torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        # An empty cache for the compiled kernels too (exactly so in a fresh process, where
        # inductor reads this first).
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        try:
            result = first_step(args.shape, args.hidden, args.tokens, args.ttt_length)
        finally:
            if before is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = before
    print(f"{'shape':<8} {'heads':>9} {'forward compile':>16} {'first step':>11} {'graphs':>7} {'breaks':>7}  eaglenest")
    print(f"{result['shape']:<8} {result['heads']:>4}/{result['kv_heads']:<4} {result['forward_seconds']:>15.1f}s "
          f"{result['first_step_seconds']:>10.1f}s {result['graphs']:>7} {result['graph_breaks']:>7}  {result['eaglenest']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": " ".join(["benchmarks/compile_time.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "host": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
        "runs": [result],
    }, indent=1))


if __name__ == "__main__":
    main()
