"""The SGLang extraction path without SGLang: the workflow's client against a server that
answers at once, beside the shard writer alone, on any machine.

The server here computes nothing: it answers each ``/generate`` sample with random rows of
the target's shape through the patched server's own spool code (``spool_prefill_rows`` and
the background ``SpoolWriter``). So the run measures what the extraction path costs between
a server's host memory and the shard on disk (spool file written, waited for, read, split,
converted, hashed, written), and how close that gets to the disk alone: on the H200 that
part, not the GPU, held SGLang extraction of SmolLM2 to 0.41 of its ceiling (docs/sglang.md).

    python benchmarks/spool_path.py --hidden 576 --aux-layers 3 --samples 256 --dtype bfloat16 --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def instant_server(spool_dir: str, hidden: int, aux_layers: int, packed: bool, writer_threads: int):
    """A patched-server protocol answerer with random rows (one random block, sliced per
    sample, so making rows costs nothing)."""
    import torch

    from eaglenest.sglang import patch, spool

    writer = spool.SpoolWriter(writer_threads)
    block = torch.randn(16384, (aux_layers + 1) * hidden).to(torch.bfloat16)
    info = {"server": patch.SERVER_KIND, "patch_version": patch.PATCH_VERSION, "target": "random",
            "layer_ids": list(range(1, aux_layers + 1)),
            "hidden_size": hidden, "spool_dir": spool_dir, "mode": "capture", "launch_token": None}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _send(self, payload) -> None:
            body = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._send(info)

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            answers = []
            for ids, rid in zip(request["input_ids"], request["rid"]):
                rows = block[: len(ids)]
                tensors = {"hidden": rows} if packed else {"aux_hidden": rows[:, : aux_layers * hidden].contiguous(),
                                                          "last_hidden": rows[:, aux_layers * hidden:].contiguous()}
                descriptor = patch.spool_prefill_rows(spool_dir, rid, ids, tensors, writer)
                answers.append({"meta_info": {patch.SPOOL_KEY: [descriptor], "prompt_tokens": len(ids)}})
            self._send(answers)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, info


def random_prepared(path: Path, samples: int, seed: int = 0) -> Path:
    """A prepared shard of ``samples`` samples of 200-2,048 tokens (the spread of shard 0)."""
    import torch

    from eaglenest.formats import shards

    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(200, 2049, (samples,), generator=generator).tolist()
    rows = [{"sample_id": f"s:{i}", "input_ids": torch.randint(5, 40000, (n,), generator=generator).tolist(),
             "loss_mask": [1] * n} for i, n in enumerate(lengths)]
    path.parent.mkdir(parents=True, exist_ok=True)
    shards.write_prepared_shard(path, 0, rows, {"target": "random"})
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--aux-layers", type=int, default=3)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--packed", action="store_true", help="spool rows packed as sglang 0.5.14 stores them")
    parser.add_argument("--samples-per-request", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--writer-threads", type=int, default=4)
    parser.add_argument("--work", default=None, help="where the shards go (default: a temporary directory)")
    parser.add_argument("--out", required=True)
    options = parser.parse_args(argv)

    import sglang_engine
    from eaglenest.sglang import client

    work = Path(options.work or tempfile.mkdtemp(prefix="spool-path-"))
    spool_dir = tempfile.mkdtemp(prefix="eaglenest-spool-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    prepared = random_prepared(work / "prepared" / "shard-00000.safetensors", options.samples)
    server, _ = instant_server(spool_dir, options.hidden, options.aux_layers, options.packed, options.writer_threads)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    disk = sglang_engine.measure_disk(prepared, options.hidden, options.aux_layers, options.dtype, work)
    hidden_path = work / "hidden" / "shard-00000.safetensors"
    started = time.perf_counter()
    stats = client.extract_shard_via_server(
        prepared, hidden_path, url, "random", list(range(1, options.aux_layers + 1)), options.hidden, options.aux_layers + 2,
        dtype=options.dtype, spool_dir=spool_dir, concurrency=options.concurrency,
        samples_per_request=options.samples_per_request, check_disk=False,
    )
    wall = time.perf_counter() - started
    hidden_path.unlink()
    server.shutdown()
    shutil.rmtree(spool_dir, ignore_errors=True)
    result = {"settings": vars(options), "cpus": os.cpu_count(), "disk": disk, "client": stats, "wall_s": round(wall, 3),
              "ratio_to_disk": round(stats["tokens_per_s_written"] / disk["tokens_per_s"], 3)}
    Path(options.out).parent.mkdir(parents=True, exist_ok=True)
    Path(options.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"| {options.dtype} | {'packed' if options.packed else 'split'} | {stats['tokens']:,} tokens | disk alone "
          f"{disk['tokens_per_s']:,.0f} tok/s | client path {stats['tokens_per_s_written']:,.0f} tok/s | "
          f"ratio {result['ratio_to_disk']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
