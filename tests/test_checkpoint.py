"""Checkpoints as people have them (issue 31, items 1, 2 and 6): a ``save_pretrained`` folder and
``hf:ORG/NAME`` in a local hub cache, loaded with transformers' own code; hostile folders refused
with exit 2 before anything is written, and nothing in a checkpoint runs.

Every checkpoint is written here by ``save_pretrained`` of a tiny random model (bfloat16, sharded
with a small ``max_shard_size``); the hub cache is laid out as huggingface_hub lays it out.
"""

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from support import in_chromium, shipping_code, vulkan_or_skip
from typer.testing import CliRunner

from tapml.errors import TapmlError

ORG_NAME = "tiny-org/llama"


def tapml(*args, input=None):
    from tapml.cli import app
    return CliRunner().invoke(app, [str(a) for a in args], input=input)


def write_checkpoint(path: Path, model_type: str, overrides: dict | None = None, shard: str = "100KB") -> Path:
    """``save_pretrained`` of tapml's tiny random ``hf:MODEL_TYPE`` model, in bfloat16, sharded."""
    from tapml.frontends.models import build_hf
    model, _ = build_hf(model_type, overrides)
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size=shard)
    return path


def place_in_hub_cache(cache: Path, repo_id: str, folder: Path, revision: str = "0" * 40) -> Path:
    """``folder``'s files as the hub cache holds a download of ``repo_id``: blobs named by their
    hash, a snapshot of links to them, ``refs/main`` naming the snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for f in folder.iterdir():
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / digest)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", digest))
    return snapshot


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A two-layer llama checkpoint in bfloat16 over several shards."""
    path = write_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")
    assert len(list(path.glob("model-*.safetensors"))) >= 2 and (path / "model.safetensors.index.json").is_file()
    return path


def test_checkpoint_loads_its_real_weights_layer_limited(llama):
    """transformers' loading of the folder: the stored weights themselves (not a random init),
    the first N layers with --hf-config, the stored dtype reported; the example inputs fit."""
    from safetensors import safe_open

    from tapml.frontends.checkpoint import open_checkpoint
    from tapml.frontends.models import load_model
    ckpt = open_checkpoint(str(llama))
    assert ckpt.dtype == "bfloat16" and len(ckpt.weights) >= 2
    model, inputs = load_model(str(llama), hf_config={"num_hidden_layers": 1}, dtype="bfloat16")
    assert len(model.model.layers) == 1 and model.model.embed_tokens.weight.dtype == torch.bfloat16
    index = json.loads((llama / "model.safetensors.index.json").read_text())["weight_map"]
    for name in ("model.layers.0.self_attn.q_proj.weight", "lm_head.weight", "model.embed_tokens.weight"):
        with safe_open(str(llama / index[name]), "pt") as f:
            assert torch.equal(f.get_tensor(name), model.get_parameter(name)), name
    assert inputs[0].dtype == torch.long and int(inputs[0].max()) < model.config.vocab_size
    with torch.no_grad():
        assert torch.isfinite(model(*inputs).logits.float()).all()
    full, _ = load_model(str(llama))  # float32 asked: the same weights upcast
    assert full.model.layers[1].mlp.up_proj.weight.dtype == torch.float32
    with safe_open(str(llama / index["model.layers.1.mlp.up_proj.weight"]), "pt") as f:
        assert torch.equal(f.get_tensor("model.layers.1.mlp.up_proj.weight").float(),
                           full.model.layers[1].mlp.up_proj.weight)


def test_hub_name_from_the_local_cache(llama, tmp_path, monkeypatch):
    """hf:ORG/NAME is found in $HF_HUB_CACHE offline and carves in its stored dtype (the CLI says
    so); a name not in the cache is exit 2 with the command that downloads it; a snapshot whose
    link leaves the repository's cache folder is refused."""
    cache = tmp_path / "hub"
    place_in_hub_cache(cache, ORG_NAME, llama)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = tapml("carve", f"hf:{ORG_NAME}", "-o", tmp_path / "s", "--hf-config", "num_hidden_layers=1")
    assert r.exit_code == 0, r.output
    assert f"dtype bfloat16: the dtype hf:{ORG_NAME} is stored in" in r.output
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["dtype"] == "bfloat16" and manifest["model"] == f"hf:{ORG_NAME}"
    assert manifest["hf_config"] == {"num_hidden_layers": 1}
    assert not any("layers.1." in n["name"] or "layers_1_" in n["name"] for n in manifest["nodes"])

    r = tapml("carve", "hf:tiny-org/absent", "-o", tmp_path / "t")
    assert r.exit_code == 2 and "hf download tiny-org/absent" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "t").exists()

    outside = tmp_path / "elsewhere.safetensors"
    snapshot = place_in_hub_cache(cache, "tiny-org/leaky", llama)
    shard = next(snapshot.glob("model-*.safetensors"))
    shutil.copyfile(shard, outside)
    shard.unlink()
    shard.symlink_to(outside)
    r = tapml("carve", "hf:tiny-org/leaky", "-o", tmp_path / "u")
    assert r.exit_code == 2 and "outside the checkpoint folder" in r.output and not (tmp_path / "u").exists()


def test_hub_name_at_a_revision_picks_that_snapshot_offline(llama, tmp_path, monkeypatch):
    """hf:ORG/NAME@REV: REV is a tag or branch the cache has a ref for, or a commit it has a snapshot
    of; the manifest keeps the revision; one not in the cache is exit 2 with the download command
    for that revision; a revision that is not a ref name (a path out) is refused before any lookup."""
    from tapml.frontends.checkpoint import resolve_hub_name
    cache = tmp_path / "hub"
    main = place_in_hub_cache(cache, ORG_NAME, llama)
    tagged = main.parent / ("1" * 40)
    tagged.mkdir()
    for link in main.iterdir():
        (tagged / link.name).symlink_to(os.readlink(link))
    (main.parent.parent / "refs" / "v1").write_text("1" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_hub_name(f"hf:{ORG_NAME}")[0] == main
    assert resolve_hub_name(f"hf:{ORG_NAME}@v1")[0] == tagged
    assert resolve_hub_name(f"hf:{ORG_NAME}@{'1' * 40}")[0] == tagged
    assert resolve_hub_name(f"hf:{ORG_NAME}@v1")[1] == main.parent.parent

    r = tapml("carve", f"hf:{ORG_NAME}@v1", "-o", tmp_path / "s", "--hf-config", "num_hidden_layers=1")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["model"] == f"hf:{ORG_NAME}@v1"

    r = tapml("carve", f"hf:{ORG_NAME}@v2", "-o", tmp_path / "t")
    assert r.exit_code == 2 and f"hf download {ORG_NAME} --revision v2" in r.output, r.output
    # what the cache does hold is listed, as specs: its refs and its snapshots' commits
    flat = " ".join(r.output.split())
    assert f"it holds hf:{ORG_NAME}@main, hf:{ORG_NAME}@v1, hf:{ORG_NAME}@{main.name}, hf:{ORG_NAME}@{'1' * 40};" \
        in flat, r.output
    for bad, says in (("../../../etc", "is not a revision name"), ("", "nothing after '@'"),
                      ("v1/../main", "is not a revision name")):
        r = tapml("carve", f"hf:{ORG_NAME}@{bad}", "-o", tmp_path / "u")
        assert r.exit_code == 2 and says in r.output and "Traceback" not in r.output, (bad, r.output)
    (main.parent.parent / "refs" / "out").write_text("../blobs")  # a ref whose content leaves snapshots/
    r = tapml("carve", f"hf:{ORG_NAME}@out", "-o", tmp_path / "u")
    assert r.exit_code == 2 and "which is not a snapshot" in r.output, r.output
    assert not (tmp_path / "t").exists() and not (tmp_path / "u").exists()


class _Planted:
    """A pickle that creates a file when unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _shard(folder: Path) -> Path:
    return sorted(folder.glob("model-*.safetensors"))[0]


def _index_names(folder: Path, name: str) -> None:
    """The index puts one tensor, one that is elsewhere, in the file ``name``."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    first = next(k for k, v in index["weight_map"].items() if v != name)
    index["weight_map"][first] = name
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _pickle_only(folder: Path, marker: Path) -> None:
    for f in folder.glob("model*.safetensors*"):
        f.unlink()
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Planted(marker)))


def _remote_code(folder: Path, marker: Path) -> None:
    (folder / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    _edit_json(folder / "config.json", auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})


def _link_out(folder: Path, outside: Path, name: str) -> None:
    shutil.copyfile(folder / name, outside)
    (folder / name).unlink()
    (folder / name).symlink_to(outside)


# (id, how the folder is made hostile (folder, a path outside it), extra arguments, what the message says)
HOSTILE = [
    ("no-config", lambda f, o: (f / "config.json").unlink(), [], "has no config.json"),
    ("truncated-shard", lambda f, o: _shard(f).write_bytes(_shard(f).read_bytes()[:-200]), [],
     "not a whole safetensors file"),
    ("missing-shard", lambda f, o: _shard(f).unlink(), [], "is missing"),
    ("index-dotdot", lambda f, o: _index_names(f, "../outside.safetensors"), [], "not a plain name inside"),
    ("index-absolute", lambda f, o: _index_names(f, str(o)), [], "not a plain name inside"),
    ("shard-link-out", lambda f, o: _link_out(f, o, _shard(f).name), [], "outside the checkpoint folder"),
    ("config-link-out", lambda f, o: _link_out(f, o, "config.json"), [], "outside the checkpoint folder"),
    ("index-wrong-shard", lambda f, o: _index_names(f, sorted(f.glob("model-*.safetensors"))[-1].name), [],
     "does not hold"),
    ("wider-config", lambda f, o: _edit_json(f / "config.json", hidden_size=96), ["--dtype", "float32"],
     "weights do not fit the config"),
    ("million-layers", lambda f, o: _edit_json(f / "config.json", num_hidden_layers=1_000_000), [],
     "claims 1000000 layers"),
    ("other-shapes", lambda f, o: _edit_json(f / "config.json", num_key_value_heads=1, intermediate_size=96), [],
     "tensors have other shapes"),
    ("unknown-architecture", lambda f, o: _edit_json(f / "config.json", model_type="not-a-model"), [],
     "unknown architecture model_type 'not-a-model'"),
    ("pickle-weights", _pickle_only, [], "pickle weights (pytorch_model.bin)"),
    ("remote-code", _remote_code, [], "--trust-remote-code"),
]


@pytest.mark.parametrize("make, extra, says", [pytest.param(*h[1:], id=h[0]) for h in HOSTILE])
def test_hostile_checkpoint_is_refused_and_nothing_is_written(llama, tmp_path, make, extra, says):
    folder = tmp_path / "ckpt"
    shutil.copytree(llama, folder)
    marker = tmp_path / "ran"
    make(folder, marker if make in (_pickle_only, _remote_code) else tmp_path / "outside.safetensors")
    before = sorted(p.name for p in tmp_path.iterdir())
    r = tapml("carve", folder, "-o", tmp_path / "out", *extra)
    assert r.exit_code == 2, r.output
    assert says in r.output and "Traceback" not in r.output and "internal error" not in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no store, no temporary folder
    assert not marker.exists()  # the pickle was never unpickled, the shipped code never imported


def test_every_model_command_checks_the_checkpoint(llama, tmp_path):
    """generate, migrate, session and precision take a checkpoint where they take a MODEL, and refuse a
    hostile one the same way (exit 2, nothing written, nothing run)."""
    folder = tmp_path / "ckpt"
    shutil.copytree(llama, folder)
    marker = tmp_path / "ran"
    _pickle_only(folder, marker)
    for args in (["generate", folder, "--tokens", "2"], ["migrate", folder, "--state", tmp_path / "st.json"],
                 ["precision", folder], ["bench", "generation", "--model", folder]):
        r = tapml(*args)
        assert r.exit_code == 2 and "pickle weights" in r.output, (args, r.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"] and not marker.exists()


def test_causal_lm_of_a_checkpoint_checks_positions(llama):
    """A generation of a checkpoint must fit its positions; an encoder checkpoint has no generation."""
    from tapml.frontends.models import load_causal_lm
    with pytest.raises(TapmlError, match="exceeds the model's 128 positions"):
        load_causal_lm(str(llama), tokens=200, prompt_len=8)
    model = load_causal_lm(str(llama), tokens=4, prompt_len=4, hf_config={"num_hidden_layers": 1}, dtype="bfloat16")
    assert len(model.model.layers) == 1 and model.generation_config.cache_implementation == "static"


PARAGRAPH = ("Hello world . The quick brown fox jumps over the lazy dog , and the dog sleeps in the warm sun . "
             "A user asks a question and the assistant : answers it with care . Models turn words into tokens , "
             "tokens into numbers , and numbers back into words for the world to read .")
CHAT_TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}<s> assistant : {% endif %}")


def save_tokenizer(folder: Path) -> int:
    """A word-level tokenizer trained here on PARAGRAPH, saved in ``folder`` with a chat template;
    returns its vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([PARAGRAPH], trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            chat_template=CHAT_TEMPLATE).save_pretrained(folder)
    return tok.get_vocab_size()


@pytest.fixture(scope="module")
def llama_with_tokenizer(tmp_path_factory) -> Path:
    """A two-layer bfloat16 llama in shards whose vocabulary is its tokenizer's."""
    folder = tmp_path_factory.mktemp("tok") / "llama"
    vocab = save_tokenizer(folder)
    write_checkpoint(folder, "llama", {"vocab_size": vocab}, shard="60KB")
    assert len(list(folder.glob("model-*.safetensors"))) >= 2
    return folder


def test_prompts_in_words_and_ids(llama, llama_with_tokenizer, tmp_path):
    """--prompt is tokenized by the folder's own tokenizer, --chat through its chat template;
    --prompt-ids needs none; a prompt in words without a tokenizer, a prompt past the model's
    positions and a tokenizer that ships code are exit 2 with nothing written; the texts of a
    generation mark the first token where the target leaves the reference."""
    from transformers import AutoTokenizer

    from tapml.frontends.prompts import generation_texts, load_tokenizer, prompt_token_ids, token_pieces
    tokenizer = load_tokenizer(str(llama_with_tokenizer))
    own = AutoTokenizer.from_pretrained(llama_with_tokenizer)
    ids, text = prompt_token_ids("m", tokenizer, text="Hello world")
    assert ids == own("Hello world")["input_ids"] and text == "Hello world" and 0 not in ids  # no <unk>
    chat, _ = prompt_token_ids("m", tokenizer, text="Hello world", chat=True)
    assert tokenizer.decode(chat) == "<s> user : Hello world </s> <s> assistant :"
    (tmp_path / "p.txt").write_text("the dog sleeps")
    assert prompt_token_ids("m", tokenizer, file=str(tmp_path / "p.txt"))[0] == own("the dog sleeps")["input_ids"]
    assert prompt_token_ids("m", None, ids="3,1,4") == ([3, 1, 4], None)
    assert load_tokenizer(str(llama)) is None and load_tokenizer("zoo:tiny-llama") is None
    for kwargs, says in (({"text": "hi"}, "has no tokenizer"), ({"ids": "1,x"}, "separated by commas"),
                         ({"text": "a", "ids": "1"}, "give one prompt"), ({"chat": True}, "--chat applies")):
        with pytest.raises(TapmlError, match=says):
            prompt_token_ids("m", None, **kwargs)
    texts = generation_texts(tokenizer, ids, own("the dog sleeps")["input_ids"], own("the dog jumps")["input_ids"])
    assert texts == {"prompt": "Hello world", "reference_text": "the dog sleeps", "target_text": "the dog jumps",
                     "first_divergent_token": 2}
    assert "".join(token_pieces(tokenizer, own("the dog sleeps")["input_ids"])) == "the dog sleeps"

    before = sorted(p.name for p in tmp_path.iterdir())
    for args, says in (
            (["generate", llama_with_tokenizer, "--prompt", PARAGRAPH * 3], "exceeds the model's 128 positions"),
            (["carve", "zoo:tiny-llama", "--generate", "2", "--prompt", "hi", "-o", tmp_path / "s"],
             "has no tokenizer"),
            (["generate", llama_with_tokenizer, "--prompt", "hi", "--prompt-len", "4"], "leave --prompt-len out"),
            (["generate", llama_with_tokenizer, "--prompt-ids", "1,999"], "not in"),
            (["carve", llama_with_tokenizer, "--prompt", "hi", "-o", tmp_path / "s"], "add --generate N")):
        r = tapml(*args)
        assert r.exit_code == 2 and says in r.output and "Traceback" not in r.output, (args, r.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == before

    config = json.loads((llama_with_tokenizer / "tokenizer_config.json").read_text())
    hostile = tmp_path / "hostile"
    shutil.copytree(llama_with_tokenizer, hostile)
    (hostile / "tokenizer_config.json").write_text(json.dumps({**config, "auto_map": {
        "AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}}))
    with pytest.raises(TapmlError, match="tokenizer_config.json has auto_map"):
        load_tokenizer(str(hostile))


@pytest.mark.device
@pytest.mark.slow
@pytest.mark.xdist_group("wgpu")
def test_generate_a_checkpoint_from_a_prompt_in_words(llama_with_tokenizer, tmp_path):
    """`tapml generate DIR --prompt "Hello world" --target wgpu:vulkan --tokens 16 --json g.json`: the
    two-shard bfloat16 folder carved in bfloat16 from the tokenized prompt, checked on lavapipe, and both
    texts in the JSON and on the terminal."""
    vulkan_or_skip()
    from tapml.frontends.prompts import load_tokenizer
    r = tapml("generate", llama_with_tokenizer, "--prompt", "Hello world", "--target", "wgpu:vulkan",
              "--tokens", "16", "--json", tmp_path / "g.json")
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "g.json").read_text())
    tokenizer = load_tokenizer(str(llama_with_tokenizer))
    assert doc["prompt"] == "Hello world" and doc["prompt_len"] == 2 and doc["summary"]["steps"] == 17
    assert doc["reference_text"] == tokenizer.decode(doc["reference_tokens"]) and doc["reference_text"]
    assert doc["target_text"] == tokenizer.decode(doc["target_tokens"]) and doc["target_text"]
    assert doc["summary"]["mismatch"] == 0 and doc["summary"]["error"] == 0
    assert "dtype bfloat16" in r.output and "reference text" in r.output and "target text" in r.output
    assert doc["reference_text"].split()[0] in r.output


@pytest.mark.slow
@in_chromium
def test_a_checkpoint_generates_from_words_and_migrates_in_chromium(llama_with_tokenizer, tmp_path):
    """The same folder in headless Chromium's WebGPU: a prompt in words generates with both texts, and
    the folder (its first layer) migrates whole."""
    r = tapml("generate", llama_with_tokenizer, "--prompt", "Hello world", "--target", "browser",
              "--tokens", "4", "--json", tmp_path / "g.json")
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "g.json").read_text())
    assert doc["prompt"] == "Hello world" and doc["summary"]["steps"] == 5 and doc["summary"]["mismatch"] == 0
    assert doc["reference_text"] and doc["target_text"] == doc["reference_text"]
    r = tapml("migrate", llama_with_tokenizer, "--target", "browser", "--hf-config", "num_hidden_layers=1",
              "--state", tmp_path / "s.json")
    assert r.exit_code == 0, r.output
    state = json.loads((tmp_path / "s.json").read_text())
    assert state["passed"] and state["end_to_end"]["status"] == "pass" and state["placement"]["ops_share"] == 1.0


#: Decoders besides llama, an encoder, a vision and an audio model: one code path, nothing per architecture.
ARCHITECTURES = ["qwen2", "gpt2", "phi3", "mistral", "gemma", "bert", "vit", "whisper"]


@pytest.mark.device
@pytest.mark.slow
@pytest.mark.xdist_group("wgpu")
@pytest.mark.parametrize("model_type", ["llama", *ARCHITECTURES])
def test_migrate_checkpoint_folders_on_lavapipe(llama, tmp_path, model_type):
    """`tapml migrate DIR --target wgpu:vulkan` exits 0 on save_pretrained folders of several
    architectures in bfloat16 (the others cut to their first layer by --hf-config, which also cuts
    per-layer config lists such as qwen2's layer_types)."""
    vulkan_or_skip()
    folder = llama if model_type == "llama" else write_checkpoint(tmp_path / model_type, model_type)
    cut = [] if model_type == "llama" else ["--hf-config", "num_hidden_layers=1"]
    r = tapml("migrate", folder, "--target", "wgpu:vulkan", "--state", tmp_path / "state.json", "-q", *cut)
    assert r.exit_code == 0, r.output
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["precision"]["dtype"] == "bfloat16" and state["end_to_end"]["status"] == "pass", state["end_to_end"]
    assert state["passed"] and state["summary"]["pass"] > 0 and state["culprits"] == []


@pytest.mark.slow
def test_trust_remote_code_runs_the_checkpoints_code(llama, tmp_path):
    """With --trust-remote-code, a config's auto_map is honoured: the class the folder ships builds
    the model (its module ran); without it, the same folder is refused and nothing runs. A fresh
    process, so that transformers copies the module into a modules cache under tmp_path."""
    import subprocess
    import sys
    folder, marker, env = shipping_code(llama, tmp_path)
    cli = [sys.executable, "-m", "tapml.cli", "carve", str(folder), "--hf-config", "num_hidden_layers=1"]
    refused = subprocess.run([*cli, "-o", str(tmp_path / "s0")], env=env, capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode == 2 and "--trust-remote-code" in refused.stderr and not marker.exists()
    script = ("import sys; from tapml.frontends.checkpoint import remote_code_trusted; from tapml.frontends.models import load_model\n"
              "with remote_code_trusted(True):\n"
              "    model, _ = load_model(sys.argv[1], hf_config={'num_hidden_layers': 1})\n"
              "print(type(model).__name__, len(model.model.layers))\n")
    run = subprocess.run([sys.executable, "-c", script, str(folder)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.split() == ["ShippedLlama", "1"], run.stderr[-2000:]
    assert marker.read_text() == "ran"
    carved = subprocess.run([*cli, "-o", str(tmp_path / "s1"), "--trust-remote-code"], env=env, capture_output=True,
                            text=True, timeout=300)
    assert carved.returncode == 0 and (tmp_path / "s1" / "manifest.json").is_file(), carved.stderr[-2000:]


def test_bench_passes_its_trust_remote_code_to_the_processes_it_times(llama, tmp_path):
    """bench scale carves and migrates in fresh processes, bench generation in its own: a checkpoint
    that ships its modeling code is refused by both without --trust-remote-code (nothing of it run)
    and measured with it, the shipped class building the model in the children too."""
    import subprocess
    import sys
    folder, marker, env = shipping_code(llama, tmp_path)
    layer = ["--hf-config", "num_hidden_layers=1"]
    for args in (["scale", "--model", str(folder), "--target", "reference", *layer],
                 ["generation", "--model", str(folder), "--target", "reference", "--tokens", "2,3", "--repeat", "1",
                  "--prompt-ids", "1,2,3", *layer]):
        cli = [sys.executable, "-m", "tapml.cli", "bench", *args]
        refused = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=600)
        assert refused.returncode == 2 and "--trust-remote-code" in refused.stderr, (args, refused.stderr[-2000:])
        assert not marker.exists()
        done = subprocess.run([*cli, "--trust-remote-code"], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-2000:])
        # scale: the module ran in the carve child (the migrate child reads the store), not in the bench itself
        assert marker.read_text() == "ran", args
        marker.unlink()


@pytest.mark.slow
def test_session_and_precision_take_a_checkpoint(llama, tmp_path):
    """session (scripted) and precision carve a checkpoint folder, first layer only, in its stored
    bfloat16, and check it end to end on the reference."""
    r = tapml("session", llama, "--target", "reference", "--hf-config", "num_hidden_layers=1",
              input="offload all\ncheck\n")
    assert r.exit_code == 0 and "end to end: pass" in r.output and "dtype bfloat16" in r.output, r.output
    r = tapml("precision", llama, "--target", "reference", "--hf-config", "num_hidden_layers=1",
              "--json", tmp_path / "p.json")
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["dtype"] == "bfloat16" and doc["end_to_end"]["before"]["status"] == "pass"
