"""What splitting a tensor across binding windows costs: the ops a real LLM splits (the LM head
``mm`` against a permuted [vocab, hidden] weight, the ``embedding`` gather from it) at a size
just under lavapipe's 128 MiB binding limit, compiled whole and compiled with
max-storage-buffer-binding-size forced to a quarter of the weight (four windows), on the same
device in the same run. Rounds alternate the order; the median of the rounds is reported with
the load average beside it. Run: ``.venv/bin/python benchmarks/split.py [ROUNDS]``."""

from __future__ import annotations

import json
import statistics
import sys

import torch

from tapml.bench import alternated, device_seconds, wgpu_backends
from tapml.graph import Graph, Node, TensorMeta

VOCAB, HIDDEN, TOKENS = 32000, 1024, 8  # a 131 MB float32 weight: one binding on lavapipe


def graphs() -> dict[str, tuple[Graph, list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(VOCAB, HIDDEN, generator=gen)
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    ids = torch.randint(0, VOCAB, (1, TOKENS), generator=gen)
    wm, xm = TensorMeta((VOCAB, HIDDEN), "float32"), TensorMeta((TOKENS, HIDDEN), "float32")
    head = Graph([("x", xm), ("w", wm)],
                 [Node("wt", "aten.permute.default", [{"ref": "w"}, [1, 0]], {}, [TensorMeta((HIDDEN, VOCAB), "float32")]),
                  Node("logits", "aten.mm.default", [{"ref": "x"}, {"ref": "wt"}], {},
                       [TensorMeta((TOKENS, VOCAB), "float32")])], ["logits"])
    gather = Graph([("w", wm), ("ids", TensorMeta((1, TOKENS), "int64"))],
                   [Node("emb", "aten.embedding.default", [{"ref": "w"}, {"ref": "ids"}], {},
                         [TensorMeta((1, TOKENS, HIDDEN), "float32")])], ["emb"])
    return {"lm_head_mm": (head, [x, w]), "embedding": (gather, [w, ids])}


def main(rounds: int = 5) -> dict:
    results = {}
    for backend, platform in wgpu_backends():
        window = VOCAB * HIDDEN * 4 // 4 // 256 * 256
        for name, (graph, inputs) in graphs().items():
            platform.__dict__.pop("forced_limits", None)
            whole = platform.compile(graph)
            platform.force_limits({"max-storage-buffer-binding-size": window})
            split = platform.compile(graph)
            platform.__dict__.pop("forced_limits", None)
            assert any(len(b) == 4 for k in split.kernels for b in k.bindings)
            assert torch.allclose(platform.run(whole, inputs)[0], platform.run(split, inputs)[0])
            times, loads = alternated({kind: (lambda p=p: device_seconds(platform, p, inputs, repeat=3)[0])
                                       for kind, p in (("whole", whole), ("split", split))}, rounds)
            med = {k: statistics.median(v) for k, v in times.items()}
            results[f"{backend}/{name}"] = {"whole_ms": round(med["whole"] * 1e3, 3), "split_ms": round(med["split"] * 1e3, 3),
                                            "split_vs_whole": round(med["split"] / med["whole"], 3), "load": loads}
            print(backend, name, results[f"{backend}/{name}"], flush=True)
    return results


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 5), indent=1))
