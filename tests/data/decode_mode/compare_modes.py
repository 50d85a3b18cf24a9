"""Run llamacpp_decode_probe on every fixture in both modes and print the max-abs difference of the logits
per prompt (README.md here). Not run by the tests.

    python compare_modes.py DECODE_PROBE_BINARY FIXTURES_DIR
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

FAMILIES = ("qwen3moe", "qwen2moe", "mixtral", "olmoe", "dbrx", "deepseek", "glm4moe", "llama4", "gptoss", "deepseek2",
            "deepseek3")


def logits(probe: str, gguf: Path, mode: str, ids: list, out: Path) -> np.ndarray:
    subprocess.run([probe, str(gguf), str(out), mode, *map(str, ids)], check=True, capture_output=True)
    n_tokens, n_vocab = np.fromfile(out, dtype=np.int32, count=2)
    return np.fromfile(out, dtype=np.float32, offset=8).reshape(n_tokens, n_vocab)


def main(probe: str, fixtures: str) -> None:
    root = Path(fixtures)
    prompts = json.loads((root / "prompts.json").read_text())["prompts"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.bin"
        for family in FAMILIES:
            for quant in ("q8_0", "q4_k_m"):
                gguf = root / family / f"{family}-{quant}.gguf"
                if gguf.exists():
                    diffs = [float(np.abs(logits(probe, gguf, "prompt", p["ids"], out)
                                          - logits(probe, gguf, "decode", p["ids"], out)).max()) for p in prompts]
                    print(family, quant, " ".join(f"{d:.3g}" for d in diffs), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
