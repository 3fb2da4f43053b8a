"""Decode and prefill of packed-weight models against float16 on one device, alternated.

    .venv/bin/python benchmarks/quant_decode.py [ROUNDS] [TARGET]

One generation store per weight format of the same hf:llama (hidden 512, 4 layers, 8 heads of 64,
FFN 1024, vocabulary 4096; 16 decode steps after 8 prompt tokens), carved once; then ROUNDS (default
5) rounds, each timing one teacher-forced generation per format on TARGET (default wgpu:vulkan) in
turn, with the 1-minute load average at each round's start. Prints the median per format and the
median of the per-round ratios to float16.
"""

import os
import statistics
import sys
import tempfile
from pathlib import Path

HF_CONFIG = {"hidden_size": 512, "intermediate_size": 1024, "head_dim": 64, "num_attention_heads": 8,
             "num_key_value_heads": 8, "num_hidden_layers": 4, "vocab_size": 4096}
FORMATS = (None, "q4f16_1", "q4_0")
TOKENS, PROMPT_LEN = 16, 8


def main(rounds: int = 5, target: str = "wgpu:vulkan") -> None:
    from tapml.bench import _TargetDecoder
    from tapml.carving.generation import carve_generation
    from tapml.carving.store import CarveStore
    from tapml.driving.targets import open_target
    with tempfile.TemporaryDirectory() as tmp, open_target(target) as platform:
        decoders = {}
        for fmt in FORMATS:
            out = Path(tmp) / (fmt or "float16")
            carve_generation("hf:llama", out, tokens=TOKENS, prompt_len=PROMPT_LEN, hf_config=HF_CONFIG,
                             dtype="float16", quantize=fmt)
            decoders[fmt or "float16"] = _TargetDecoder(CarveStore(out), platform, TOKENS)
        for decode in decoders.values():
            decode()  # warm-up: compiles, uploads
        runs = {name: [] for name in decoders}
        loads = []
        for _ in range(rounds):
            loads.append(os.getloadavg()[0])
            for name, decode in decoders.items():
                prefill_s, decode_s, _ = decode()
                runs[name].append((prefill_s * 1e3, TOKENS / decode_s))
    print(f"{target}, {rounds} alternated rounds, load average {min(loads):.2f}-{max(loads):.2f} "
          f"(median {statistics.median(loads):.2f})")
    print("| weights | decode tok/s | vs float16 | prefill ms | vs float16 |")
    print("|---|---|---|---|---|")
    base = runs["float16"]
    for name, rs in runs.items():
        tps = statistics.median(r[1] for r in rs)
        ms = statistics.median(r[0] for r in rs)
        vs_tps = statistics.median(r[1] / b[1] for r, b in zip(rs, base))
        vs_ms = statistics.median(r[0] / b[0] for r, b in zip(rs, base))
        print(f"| {name} | {tps:.1f} | {vs_tps:.3f} | {ms:.1f} | {vs_ms:.2f} |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5, sys.argv[2] if len(sys.argv) > 2 else "wgpu:vulkan")
