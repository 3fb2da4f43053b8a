"""GGUF files as MODEL specs (issue 31, items 1 and 6): llama.cpp's format read with the gguf
package and transformers' own GGUF loading, dequantized to the dtype asked for, its tokenizer
from its metadata; hostile headers refused by tapml's own bounded scan (exit 2, nothing written)
before gguf's reader sees them.

Every file is written here by gguf's GGUFWriter, laid out as llama.cpp's convert script lays out a
llama: ``token_embd.weight``, ``blk.N.attn_q.weight``..., ``output_norm.weight``,
``output.weight`` and the ``llama.*`` keys, in float32 and float16 with one Q8_0 tensor. The other
architectures (:data:`ARCHITECTURES`) are tiny random transformers models written as the convert
script writes each: its tensor names, q/k permutation, fused tensors, norms stored +1, tied heads.
"""

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from support import in_chromium, vulkan_or_skip
from typer.testing import CliRunner

from tapml import quant
from tapml.errors import TapmlError

WORDS = ["hello", "world", "the", "cat", "dog", "is", "on", "a"]
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 32, 64, 2, 4, 2


def tapml(*args, input=None):
    from tapml.cli import app
    return CliRunner().invoke(app, [str(a) for a in args], input=input)


def vocabulary(specials: tuple[str, ...] = ("<unk>", "<s>", "</s>")) -> list[str]:
    """llama's sentencepiece layout: ``specials``, the 256 byte tokens, then every prefix and letter of
    WORDS (transformers rebuilds the merges from the pieces)."""
    pieces = []
    for word in WORDS:
        word = "▁" + word
        for piece in [word[:i] for i in range(1, len(word) + 1)] + list(word):
            if piece not in pieces:
                pieces.append(piece)
    return [*specials, *(f"<0x{b:02X}>" for b in range(256)), *pieces]


def byte_level_vocabulary() -> tuple[list[str], list[str]]:
    """GPT-2's byte-level BPE as Qwen's tokenizer has it: the 256 byte symbols, every WORD with and
    without its leading space (``Ġ``) merged up letter by letter, then Qwen's three control tokens.
    Returns ``(tokens, merges)``."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    tokens, merges = list(bytes_to_unicode().values()), []
    for word in WORDS + ["Ġ" + w for w in WORDS]:
        for end in range(2, len(word) + 1):
            if word[:end] not in tokens:
                merges.append(f"{word[:end - 1]} {word[end - 1]}")
                tokens.append(word[:end])
    return tokens + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], merges


def add_hyperparameters(writer, block_count: int = LAYERS, rope_theta: float = 10000.0,
                        head_dim: int | None = None) -> None:
    """The shape keys llama.cpp's convert script writes for these decoders: context, widths, ``block_count``
    layers, heads, RMS norm epsilon, RoPE base, and the head size as ``attention.key_length`` where the
    model's config states ``head_dim`` (else as llama's ``rope.dimension_count``)."""
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(block_count)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(rope_theta)
    if head_dim:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    else:
        writer.add_rope_dimension_count(HIDDEN // HEADS)


def add_tokenizer(writer, kind: str) -> list[str]:
    """The ``tokenizer.ggml.*`` keys of a tokenizer of ``kind`` as the convert script writes it: ``llama``
    (sentencepiece: <unk> <s> </s>, the byte tokens, pieces scored by length), ``gemma`` (sentencepiece:
    <pad> <eos> <bos> <unk>, no space prefix) or ``gpt2`` (Qwen's byte-level BPE with its merges, no
    BOS added); returns its tokens (the vocabulary size written with them)."""
    if kind == "gpt2":
        tokens, merges = byte_level_vocabulary()
        types, special = [1] * (len(tokens) - 3) + [3] * 3, dict.fromkeys(("bos", "eos", "pad"), len(tokens) - 3)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(tokens)
        writer.add_token_merges(merges)
        writer.add_add_bos_token(False)
    else:
        specials, special = ((("<pad>", "<eos>", "<bos>", "<unk>"), {"bos": 2, "eos": 1, "unk": 3, "pad": 0})
                             if kind == "gemma" else (("<unk>", "<s>", "</s>"), {"bos": 1, "eos": 2, "unk": 0}))
        tokens, first = vocabulary(specials), len(specials) + 256
        types = [2 if t == "<unk>" else 3 for t in specials] + [6] * 256 + [1] * (len(tokens) - first)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * first + [-float(len(t)) for t in tokens[first:]])
        if kind == "gemma":
            writer.add_add_space_prefix(False)
    writer.add_vocab_size(len(tokens))
    writer.add_token_types(types)
    for name, token_id in special.items():
        getattr(writer, f"add_{name}_token_id")(token_id)
    return tokens


def write_gguf(path: Path, architecture: str = "llama", dtype=np.float32, quantized: bool = True,
               block_count: int = LAYERS, tied: bool = False, packed: dict | None = None) -> dict:
    """A two-layer llama GGUF (``dtype`` tensors, ``output.weight`` and ``attn_k`` in float16, and
    ``blk.0.attn_v.weight`` in Q8_0 when ``quantized``, or the tensors ``packed`` names in the ggml
    type it gives them; ``block_count`` the layers its metadata claims; no ``output.weight`` when
    ``tied``: the head is the embedding); returns the arrays written, by name."""
    import gguf
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny-llama")
    add_hyperparameters(writer, block_count)
    tokens = add_tokenizer(writer, "llama")
    written = {}
    packed = packed if packed is not None else {"blk.0.attn_v.weight": "Q8_0"} if quantized else {}

    def tensor(name, shape, as_=dtype):
        written[name] = (rng.standard_normal(shape) * 0.1).astype(as_)
        if name in packed:
            qtype = gguf.GGMLQuantizationType[packed[name]]
            written[name] = gguf.quants.quantize(written[name].astype(np.float32), qtype)
            writer.add_tensor(name, written[name], raw_dtype=qtype)
        else:
            writer.add_tensor(name, written[name])

    tensor("token_embd.weight", (len(tokens), HIDDEN))
    tensor("output_norm.weight", (HIDDEN,))
    if not tied:
        tensor("output.weight", (len(tokens), HIDDEN), np.float16)
    kv = HIDDEN // HEADS * KV_HEADS
    for i in range(LAYERS):
        for name, shape, as_ in (("attn_norm", (HIDDEN,), dtype), ("ffn_norm", (HIDDEN,), dtype),
                                 ("attn_q", (HIDDEN, HIDDEN), dtype), ("attn_k", (kv, HIDDEN), np.float16),
                                 ("attn_v", (kv, HIDDEN), dtype), ("attn_output", (HIDDEN, HIDDEN), dtype),
                                 ("ffn_gate", (FFN, HIDDEN), dtype), ("ffn_up", (FFN, HIDDEN), dtype),
                                 ("ffn_down", (HIDDEN, FFN), dtype)):
            tensor(f"blk.{i}.{name}.weight", shape, as_)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


#: GGUF architectures other than llama, each as llama.cpp's convert_hf_to_gguf.py writes it: the
#: transformers model_type it converts, config keys beyond the tiny shared ones, and the tokenizer it
#: writes (``llama``: sentencepiece with <unk> <s> </s>; ``gemma``: sentencepiece with <pad> <eos>
#: <bos> <unk>; ``gpt2``: Qwen's byte-level BPE). "gemma" itself: transformers does not read it.
ARCHITECTURES = {
    "qwen2": ("qwen2", {}, "gpt2"),  # q/k/v biases
    "qwen3": ("qwen3", {"head_dim": 8}, "gpt2"),  # q/k norms; its head size only in attention.key_length
    "phi3": ("phi3", {"pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2}, "llama"),  # fused qkv, gate+up
    "gemma2": ("gemma2", {"head_dim": 8, "sliding_window": 16}, "gemma"),  # norms +1, tied head
    "gemma3": ("gemma3_text", {"head_dim": 8, "sliding_window": 16}, "gemma"),  # the same, q/k norms too
    "mistral": ("mistral", {"sliding_window": None}, "llama"),  # written as a llama: q and k permuted
    "gemma": ("gemma", {"head_dim": 8}, "gemma"),
}
#: What the convert script writes in a GGUF architecture's name that is no transformers model_type.
_FILE_ARCHITECTURE = {"gemma3_text": "gemma3", "mistral": "llama"}


def _llama_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of a llama q or k projection's rows: each head's rotary halves interleaved."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2) \
        .reshape(weight.shape)


def write_architecture_gguf(path: Path, name: str, general_name: str = "") -> tuple[torch.nn.Module, dict]:
    """A tiny random transformers model of ``ARCHITECTURES[name]`` (hidden 32, 2 layers, about 300 tokens,
    norm weights away from their init) written to ``path`` as convert_hf_to_gguf.py writes it: the keys
    it writes for the architecture and a tokenizer; each tensor named by gguf's own name map (what the
    script maps with), a llama's q and k rows permuted, a Gemma's norm weights stored +1, no
    ``output.weight`` for a head tied to the embedding. Returns the model and, by GGUF name, the
    ``(transformers name, array written)`` of every tensor; ``general_name`` the model's name in the file."""
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM
    model_type, extras, tokenizer = ARCHITECTURES[name]
    architecture = _FILE_ARCHITECTURE.get(model_type, model_type)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(general_name or f"{name.capitalize()} tiny")
    tokens = add_tokenizer(writer, tokenizer)
    config = AutoConfig.for_model(model_type, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=len(tokens),
                                  max_position_embeddings=64, rms_norm_eps=1e-5, **extras)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    gemma = model_type.startswith("gemma")  # its RMSNorm scales by 1 + weight (zeros at init)
    with torch.no_grad():
        for key, p in model.named_parameters():
            p.copy_((1.0 if key.endswith("norm.weight") and not gemma else 0.0) + 0.1 * torch.randn_like(p))
    llama = architecture == "llama"
    rope = config.rope_parameters
    add_hyperparameters(writer, rope_theta=float(rope.get("rope_theta") or rope["full_attention"]["rope_theta"]),
                        head_dim=extras.get("head_dim"))
    if extras.get("sliding_window"):
        writer.add_sliding_window(extras["sliding_window"])
    if getattr(config, "attn_logit_softcapping", None):
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == architecture), LAYERS)
    written = {}
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        stem, suffix = key.rsplit(".", 1)
        gguf_name = f"{names.get_name(stem)}.{suffix}"
        array = tensor.numpy().copy()
        if llama and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            array = _llama_permute(array, HEADS if ".attn_q." in gguf_name else KV_HEADS)
        if gemma and gguf_name.endswith("norm.weight"):
            array = array + 1
        writer.add_tensor(gguf_name, array)
        written[gguf_name] = (key, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, written


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, write_gguf(path)


def test_gguf_loads_dequantized_weights_and_its_tokenizer(tiny, tmp_path):
    """The file's own weights (the Q8_0 tensor dequantized, float16 ones widened) in the dtype asked
    for, the first N layers with --hf-config, float32 by default for a quantized file and the stored
    dtype for one that is not (its head tied to the embedding when it has no output.weight); its
    tokenizer from its metadata, whatever lies beside the file."""
    import gguf

    from tapml.frontends.checkpoint import open_checkpoint
    from tapml.frontends.gguf import scan_gguf
    from tapml.frontends.models import load_causal_lm, load_model
    from tapml.frontends.prompts import load_tokenizer
    path, written = tiny
    ckpt = open_checkpoint(str(path))
    assert ckpt.dtype == "float32" and ckpt.gguf.quantized == ["Q8_0"] and ckpt.config["model_type"] == "llama"
    model, inputs = load_model(str(path), hf_config={"num_hidden_layers": 1})
    assert len(model.model.layers) == 1 and model.model.embed_tokens.weight.dtype == torch.float32
    v = model.model.layers[0].self_attn.v_proj  # Q8_0: kept packed, the file's own blocks
    dequantized = gguf.quants.dequantize(written["blk.0.attn_v.weight"], gguf.GGMLQuantizationType.Q8_0)
    assert v.scheme == "q8_0" and quant.ggml_bytes(v.weight).numpy().tobytes() == written["blk.0.attn_v.weight"].tobytes()
    assert torch.equal(quant.dequantize("q8_0", {"weight": v.weight}, v.out_features, v.in_features),
                       torch.from_numpy(dequantized)) and dequantized.shape == (HIDDEN // HEADS * KV_HEADS, HIDDEN)
    assert torch.equal(model.lm_head.weight, torch.from_numpy(written["output.weight"].astype(np.float32)))
    assert torch.equal(model.model.embed_tokens.weight, torch.from_numpy(written["token_embd.weight"]))
    assert int(inputs[0].max()) < model.config.vocab_size and torch.isfinite(model(*inputs).logits).all()

    half = load_causal_lm(str(path), tokens=2, prompt_len=4, dtype="float16")
    assert half.lm_head.weight.dtype == torch.float16 and len(half.model.layers) == LAYERS
    assert torch.equal(half.lm_head.weight, torch.from_numpy(written["output.weight"]))
    written = write_gguf(tmp_path / "f16.gguf", dtype=np.float16, quantized=False, tied=True)
    assert scan_gguf(str(tmp_path / "f16.gguf")).dtype == "float16"
    tied, _ = load_model(str(tmp_path / "f16.gguf"), dtype="float16")
    assert tied.config.tie_word_embeddings and tied.lm_head.weight.dtype == torch.float16
    assert torch.equal(tied.lm_head.weight, torch.from_numpy(written["token_embd.weight"]))

    beside = tmp_path / "beside"  # files next to a GGUF are not part of it: never read
    beside.mkdir()
    (beside / "m.gguf").symlink_to(path)
    (beside / "config.json").write_text(json.dumps({"model_type": "gpt2", "auto_map": {"AutoConfig": "evil.C"}}))
    (beside / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["evil.T", None]}}))
    for spec in (path, beside / "m.gguf"):
        tokenizer = load_tokenizer(str(spec))
        ids = tokenizer("hello world the cat")["input_ids"]
        assert len(ids) == 5 and tokenizer.decode(ids, skip_special_tokens=True) == "hello world the cat"
    assert type(load_model(str(beside / "m.gguf"), hf_config={"num_hidden_layers": 1})[0]).__name__ == \
        "LlamaForCausalLM"


@pytest.mark.parametrize("name", [name for name in ARCHITECTURES if name != "gemma"])
def test_gguf_of_each_architecture_loads_the_weights_written(name, tmp_path):
    """tapml loads each architecture's file (transformers' GGUF reading) into the model class written, with
    every weight of the written model back where it was: a llama layout's permuted q and k rows, Phi-3's
    fused qkv and gate+up, Qwen2's q/k/v biases, Qwen3's q/k norms and its head size (only in
    attention.key_length), Gemma's norms stored +1 (back within float32 rounding of the +1) and its head
    tied to the embedding; Phi-3's default padding id, outside a small vocabulary, left unset as the file
    names none. The file's own tokenizer turns words into ids and back."""
    from tapml.frontends.models import load_model
    from tapml.frontends.prompts import load_tokenizer
    path = tmp_path / f"tiny-{name}.gguf"
    model, written = write_architecture_gguf(path, name)
    loaded, inputs = load_model(str(path))
    built = "LlamaForCausalLM" if name == "mistral" else type(model).__name__  # llama.cpp writes a Mistral as a llama
    assert type(loaded).__name__ == built and loaded.config.num_hidden_layers == LAYERS
    expected, got = model.state_dict(), loaded.state_dict()
    assert set(got) == set(expected)
    stored_otherwise = set()
    for gguf_name, (key, array) in written.items():
        if torch.equal(torch.from_numpy(array), expected[key]):
            assert torch.equal(got[key], expected[key]), (gguf_name, key)
        else:  # written permuted or +1: transformers must undo it
            stored_otherwise.add(gguf_name)
            torch.testing.assert_close(got[key], expected[key], rtol=0, atol=2 ** -23, msg=f"{gguf_name} -> {key}")
    if name == "mistral":
        assert stored_otherwise == {n for n in written if n.endswith(("attn_q.weight", "attn_k.weight"))}
    elif name.startswith("gemma"):
        assert stored_otherwise == {n for n in written if n.endswith("norm.weight")} and "output.weight" not in written
        assert loaded.config.tie_word_embeddings
        assert torch.equal(got["lm_head.weight"], expected["model.embed_tokens.weight"])
        assert ("blk.0.attn_q_norm.weight" in written) == (name == "gemma3")
    else:
        assert not stored_otherwise
    if name == "phi3":
        kv = HIDDEN // HEADS * KV_HEADS
        assert written["blk.0.attn_qkv.weight"][1].shape == (HIDDEN + 2 * kv, HIDDEN)
        assert written["blk.0.ffn_up.weight"][1].shape == (2 * FFN, HIDDEN) and loaded.config.pad_token_id is None
    if name.startswith("qwen"):
        assert ("blk.1.attn_v.bias" in written) == (name == "qwen2")
        assert getattr(loaded.config, "head_dim", None) in (None, HIDDEN // HEADS)
        assert ("blk.1.attn_k_norm.weight" in written) == (name == "qwen3")
    with torch.no_grad():  # the same function: rms_norm_eps went through float32 metadata
        torch.testing.assert_close(loaded(*inputs).logits, model(*inputs).logits)

    tokenizer = load_tokenizer(str(path))
    ids = tokenizer("hello world the cat")["input_ids"]
    assert max(ids) < loaded.config.vocab_size
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello world the cat"
    assert (ids[0] == tokenizer.bos_token_id) == (ARCHITECTURES[name][2] != "gpt2"), ids


def _patch(data: bytearray, at: int, fmt: str, value) -> None:
    struct.pack_into(fmt if fmt[0] in "<>" else "<" + fmt, data, at, value)


def _after(data: bytearray, name: bytes) -> int:
    """The byte just after the one occurrence of ``name`` (a key or tensor name) in the header."""
    at = data.find(name)
    assert at > 0 and data.find(name, at + 1) < 0, name
    return at + len(name)


HOSTILE = [  # (id, how the file is spoilt, what the message says)
    ("bad-magic", lambda d: d.__setitem__(slice(0, 4), b"GGUX"), "is not a GGUF file"),
    ("truncated-data", lambda d: d.__delitem__(slice(len(d) - 100, None)), "the file is truncated"),
    ("big-endian", lambda d: _patch(d, 4, ">I", 3), "big-endian"),
    ("absurd-tensor-count", lambda d: _patch(d, 8, "Q", 1 << 40), "claims 1099511627776 tensors"),
    ("absurd-metadata-count", lambda d: _patch(d, 16, "Q", 1 << 62), "metadata fields, more than"),
    ("absurd-key-length", lambda d: _patch(d, 24, "Q", 1 << 62), "claims 4611686018427387904 bytes"),
    ("absurd-array-count", lambda d: _patch(d, _after(d, b"tokenizer.ggml.tokens") + 8, "Q", 1 << 40),
     "claims 1099511627776 items"),
    ("absurd-dims", lambda d: _patch(d, _after(d, b"output_norm.weight") + 4, "Q", 1 << 50),
     "which the file cannot hold"),
    ("too-many-dims", lambda d: _patch(d, _after(d, b"output_norm.weight"), "I", 9), "claims 9 dimensions"),
    ("offset-outside", lambda d: _patch(d, _after(d, b"output_norm.weight") + 16, "Q", 1 << 40),
     "past the end of the file"),
]


def test_hostile_gguf_is_refused_and_nothing_is_written(tiny, tmp_path):
    """Each spoilt header: exit 2 with tapml's message, no traceback, no store or temporary folder; an
    architecture transformers does not read from GGUF is named, a block count past the file's blocks
    refused; gguf's own reader never sees them."""
    path, _ = tiny
    original = path.read_bytes()
    for name, spoil, says in HOSTILE:
        data = bytearray(original)
        spoil(data)
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(bytes(data))
        before = sorted(p.name for p in tmp_path.iterdir())
        r = tapml("carve", bad, "-o", tmp_path / "out")
        assert r.exit_code == 2 and says in r.output, (name, r.output)
        assert "Traceback" not in r.output and "internal error" not in r.output, (name, r.output)
        assert sorted(p.name for p in tmp_path.iterdir()) == before, name
    write_gguf(tmp_path / "mamba.gguf", architecture="mamba9", quantized=False)
    write_gguf(tmp_path / "layers.gguf", quantized=False, block_count=10 ** 6)  # would be built before failing
    write_architecture_gguf(tmp_path / "gemma.gguf", "gemma")  # transformers reads gemma2 and gemma3, not gemma
    # transformers builds a Mistral from a llama file named exactly 'mistral', then has no tensor names for it
    write_architecture_gguf(tmp_path / "mistral.gguf", "mistral", general_name="mistral")
    for name, says in (("mamba", "architecture 'mamba9' is not one transformers"),
                       ("gemma", "architecture 'gemma' is not one transformers"),
                       ("mistral", "builds a mistral model from this 'llama' file (general.name 'mistral') and knows "
                                   "no GGUF tensor names for mistral"),
                       ("layers", "llama.block_count is 1000000, but the file holds tensors of 2 blocks")):
        r = tapml("carve", tmp_path / f"{name}.gguf", "-o", tmp_path / "out")
        assert r.exit_code == 2 and says in r.output, r.output
    assert not (tmp_path / "out").exists()
    r = tapml("carve", tmp_path / "missing.gguf", "-o", tmp_path / "out")
    assert r.exit_code == 2 and "does not exist" in r.output, r.output


def test_every_model_command_checks_the_gguf(tmp_path):
    """generate, migrate, precision, session and bench take FILE.gguf where they take a MODEL and refuse a
    spoilt one the same way (exit 2, nothing written)."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + bytes(100))
    for args in (["generate", bad, "--tokens", "2"], ["migrate", bad, "--state", tmp_path / "st.json"],
                 ["precision", bad], ["session", bad], ["bench", "generation", "--model", bad],
                 ["carve", bad, "--generate", "2", "-o", tmp_path / "s"]):
        r = tapml(*args)
        assert r.exit_code == 2 and "is not a GGUF file" in r.output, (args, r.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]
    from tapml.frontends.gguf import scan_gguf
    with pytest.raises(TapmlError, match="too short for a GGUF header"):
        (tmp_path / "short.gguf").write_bytes(b"GGUF")
        scan_gguf(str(tmp_path / "short.gguf"))


@pytest.mark.device
@pytest.mark.slow
@pytest.mark.xdist_group("wgpu")
def test_carve_and_generate_a_gguf_from_a_prompt_in_words(tiny, tmp_path):
    """`tapml carve FILE.gguf -o s` exits 0; `tapml generate FILE.gguf --prompt "hello world the cat" --target
    wgpu:vulkan`: carved in float32 (the file is quantized) from the prompt its own tokenizer makes, checked
    on lavapipe, texts decoded; a scripted session takes it too (in float16, first layer)."""
    vulkan_or_skip()
    path, _ = tiny
    r = tapml("carve", path, "-o", tmp_path / "s")
    assert r.exit_code == 0, r.output
    assert "dtype float32" in r.output and "quantized tensors (Q8_0)" in r.output
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["cases"]
    r = tapml("generate", path, "--prompt", "hello world the cat", "--target", "wgpu:vulkan", "--tokens", "3",
              "--json", tmp_path / "g.json")
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "g.json").read_text())
    assert doc["prompt_len"] == 5 and doc["summary"]["steps"] == 4 and doc["summary"]["mismatch"] == 0
    assert doc["summary"]["error"] == 0 and doc["reference_tokens"] == doc["target_tokens"]
    assert "dtype float32" in r.output and "reference text" in r.output
    r = tapml("session", path, "--target", "reference", "--hf-config", "num_hidden_layers=1", "--dtype", "float16",
              input="offload all\ncheck\n")  # carved through open_or_carve, as migrate carves
    assert r.exit_code == 0 and "end to end: pass" in r.output, r.output


#: Tensors of the file below stored in the ggml types tapml keeps packed: llama's permuted q/k among them.
PACKED = {"token_embd.weight": "Q4_0", "blk.0.attn_q.weight": "Q4_0", "blk.1.attn_k.weight": "Q4_0",
          "blk.0.ffn_down.weight": "Q8_0", "output.weight": "Q8_0", "blk.1.ffn_up.weight": "Q8_0"}


@pytest.mark.slow
def test_gguf_q4_0_and_q8_0_blocks_stay_packed(tmp_path, monkeypatch):
    """A GGUF whose linears and embedding are Q4_0 and Q8_0 keeps the file's blocks: each such module
    becomes one packed op whose bytes are the file's rows (in the order transformers puts them: llama's
    q/k permutation moves whole rows of blocks), computing exactly what the dequantized model computes;
    its store holds the blocks (no float copy) and it generates on the reference."""
    from tapml.carving.store import CarveStore
    from tapml.frontends import gguf as tapml_gguf
    from tapml.frontends.models import load_model
    from tapml.frontends.quantize import QuantizedEmbedding, QuantizedLinear
    path = tmp_path / "packed.gguf"
    written = write_gguf(path, packed=PACKED)
    model, inputs = load_model(str(path))
    with monkeypatch.context() as m:
        m.setattr(tapml_gguf, "keep_blocks_packed", lambda ckpt, model: [])
        floats, _ = load_model(str(path))
    modules, float_modules = dict(model.named_modules()), dict(floats.named_modules())
    packed = {n: mod for n, mod in modules.items() if isinstance(mod, (QuantizedLinear, QuantizedEmbedding))}
    assert sorted(packed) == ["lm_head", "model.embed_tokens", "model.layers.0.mlp.down_proj",
                              "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj",
                              "model.layers.1.self_attn.k_proj"]
    for name, mod in packed.items():
        rows, cols = float_modules[name].weight.shape
        assert torch.equal(quant.dequantize(mod.scheme, {"weight": mod.weight}, rows, cols), float_modules[name].weight)
    q = packed["model.layers.0.self_attn.q_proj"]
    file_blocks = written["blk.0.attn_q.weight"].tobytes()
    ours = quant.ggml_bytes(q.weight).numpy().tobytes()
    assert ours != file_blocks and sorted(ours[i:i + 18] for i in range(0, len(ours), 18)) == \
        sorted(file_blocks[i:i + 18] for i in range(0, len(file_blocks), 18))  # the same blocks, rows permuted
    with torch.no_grad():
        assert torch.allclose(model(*inputs).logits, floats(*inputs).logits, atol=1e-5)

    r = tapml("generate", path, "--prompt", "hello world the cat", "--tokens", "2", "--store", tmp_path / "g")
    assert r.exit_code == 0 and "3/3 steps pass" in r.output, r.output
    store = CarveStore(tmp_path / "g")
    ops = {n.op for n in store.graph.nodes}
    assert {"tapml.q4_0_linear.default", "tapml.q8_0_linear.default", "tapml.q4_0_embedding.default"} <= ops
    stored = [t for t in store.program_inputs().values() if t.dtype == torch.int32]
    assert any(torch.equal(t, q.weight) for t in stored)  # the blocks as the module holds them, bytes and all
    assert not any(t.is_floating_point() and tuple(t.shape) == tuple(float_modules["lm_head"].weight.shape)
                   for t in store.program_inputs().values())  # no float copy of a packed weight

    # the rest quantized too, judged on a text through the file's own tokenizer
    (tmp_path / "t.txt").write_text("hello world the cat is on a dog")
    r = tapml("precision", path, "--quantize", "q8_0", "--text-file", tmp_path / "t.txt", "--json", tmp_path / "p.json")
    assert r.exit_code == 0, r.output
    q = json.loads((tmp_path / "p.json").read_text())["quantization"]
    assert q["text"] and q["tokens"] == 9 and q["perplexity"]["quantized"] > 1
    assert "model.layers.0.self_attn.k_proj" in {layer["module"] for layer in q["layers"]}  # float in the file


@pytest.mark.device
@pytest.mark.slow
@pytest.mark.xdist_group("wgpu")
def test_gguf_with_q4_0_and_q8_0_blocks_generates_on_vulkan_packed(tmp_path):
    """The Q4_0/Q8_0 file generates from words on lavapipe, every step passing, with each of its packed
    linears and its embedding run by the packed-weight kernels (no node falls back)."""
    vulkan_or_skip()
    path = tmp_path / "packed.gguf"
    write_gguf(path, packed=PACKED)
    r = tapml("generate", path, "--prompt", "hello world the cat", "--target", "wgpu:vulkan", "--tokens", "3",
              "--json", tmp_path / "g.json")
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "g.json").read_text())
    assert doc["summary"]["pass"] == 4 and doc["reference_tokens"] == doc["target_tokens"]
    for graph in ("prefill", "decode"):
        assert doc["placement"][graph]["fell_back"] == 0
        assert doc["placement"][graph]["quantized"] == doc["placement"][graph]["quantized_on_target"] == 6
    assert "ran on the target as packed-weight kernels" in " ".join(r.output.split())


#: A file mixing a ggml type tapml has kernels for (Q5_0) with two it only reads (Q4_1, Q5_1).
WITHOUT_KERNELS = {"blk.0.attn_q.weight": "Q4_1", "blk.0.ffn_down.weight": "Q5_1", "blk.1.ffn_up.weight": "Q5_0",
                   "output.weight": "Q4_1"}


@pytest.mark.device
@pytest.mark.slow
@pytest.mark.xdist_group("wgpu")
def test_gguf_types_without_a_kernel_are_named_unsupported_and_the_rest_is_checked(tmp_path):
    """Q4_1 and Q5_1 blocks stay packed too (ops of their own, the gguf package's dequantizer their
    reference); on lavapipe each such node gets an ``unsupported`` verdict naming its block type, falls
    back, and everything else -- the Q5_0 linear among it, on its kernel -- is checked and passes."""
    vulkan_or_skip()
    from tapml.carving.store import CarveStore
    path = tmp_path / "mixed.gguf"
    write_gguf(path, packed=WITHOUT_KERNELS)
    r = tapml("migrate", path, "--target", "wgpu:vulkan", "--state", tmp_path / "m.json")
    assert r.exit_code == 1, r.output  # unsupported nodes are findings, not a crash
    state = json.loads((tmp_path / "m.json").read_text())
    named = {(c["kind"], c["op"], c["module"]) for c in state["culprits"]}
    assert named == {("unsupported", "tapml.q4_1_linear.default", "model.layers.0.self_attn.q_proj"),
                     ("unsupported", "tapml.q5_1_linear.default", "model.layers.0.mlp.down_proj"),
                     ("unsupported", "tapml.q4_1_linear.default", "lm_head")}
    assert all("ggml's Q4_1 blocks" in c["message"] or "ggml's Q5_1 blocks" in c["message"] for c in state["culprits"])
    nodes = {n.name: n.op for n in CarveStore(state["store"]).graph.nodes}
    placement = state["placement"]["nodes"]
    assert sorted(op for name, op in nodes.items() if placement[name] != "target") == \
        ["tapml.q4_1_linear.default", "tapml.q4_1_linear.default", "tapml.q5_1_linear.default"]
    assert [placement[name] for name, op in nodes.items() if op == "tapml.q5_0_linear.default"] == ["target"]
    assert state["end_to_end"]["status"] == "pass"
    assert sum(u["status"] == "pass" for u in state["units"] if u["kind"] == "region") >= 1


@pytest.mark.slow
@in_chromium
def test_a_gguf_generates_from_words_and_migrates_in_chromium(tiny, tmp_path):
    """The same file in headless Chromium's WebGPU: a prompt in words generates, and the model (its
    first layer) migrates whole."""
    path, _ = tiny
    r = tapml("generate", path, "--prompt", "hello world the cat", "--target", "browser", "--tokens", "2",
              "--json", tmp_path / "g.json")
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "g.json").read_text())
    assert doc["summary"]["steps"] == 3 and doc["summary"]["mismatch"] == 0 and doc["summary"]["error"] == 0
    assert doc["reference_tokens"] == doc["target_tokens"] and doc["reference_text"]
    r = tapml("migrate", path, "--target", "browser", "--hf-config", "num_hidden_layers=1", "--state", tmp_path / "s.json")
    assert r.exit_code == 0, r.output
    state = json.loads((tmp_path / "s.json").read_text())
    assert state["passed"] and state["end_to_end"]["status"] == "pass"


@pytest.mark.device
@pytest.mark.slow
@pytest.mark.xdist_group("wgpu")
@pytest.mark.parametrize("name", [name for name in ARCHITECTURES if name not in ("gemma", "mistral")])
def test_each_gguf_architecture_carves_and_migrates_on_vulkan(name, tmp_path):
    """`tapml carve FILE.gguf -o s` and `tapml migrate FILE.gguf --target wgpu:vulkan` exit 0 for each
    architecture (a Mistral file builds a llama: the llama tests carve that model), the whole model on
    lavapipe end to end; Gemma 3's file (norms +1, q/k norms, sliding window, tied head) generates from a
    prompt in words with every step checked."""
    vulkan_or_skip()
    path = tmp_path / f"tiny-{name}.gguf"
    write_architecture_gguf(path, name)
    r = tapml("carve", path, "-o", tmp_path / "s")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["cases"]
    r = tapml("migrate", path, "--target", "wgpu:vulkan", "--state", tmp_path / "st.json")
    assert r.exit_code == 0, r.output
    state = json.loads((tmp_path / "st.json").read_text())
    assert state["passed"] and state["end_to_end"]["status"] == "pass"
    if name != "gemma3":
        return
    r = tapml("generate", path, "--prompt", "hello world the cat", "--target", "wgpu:vulkan", "--tokens", "4",
              "--json", tmp_path / "g.json")
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "g.json").read_text())
    assert doc["summary"]["steps"] == doc["summary"]["pass"] == 5 and doc["reference_tokens"] == doc["target_tokens"]
    from tapml.frontends.prompts import load_tokenizer
    assert doc["prompt_len"] == len(load_tokenizer(str(path))("hello world the cat")["input_ids"])
    assert doc["summary"]["mismatch"] == doc["summary"]["error"] == 0 and "reference text" in r.output
    assert doc["reference_text"] == doc["target_text"] and doc["reference_text"]
