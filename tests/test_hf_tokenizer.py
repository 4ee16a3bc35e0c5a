"""Hugging Face tokenizers (tokenizer.json) in the data pipeline, training, checkpoints, generate and conversion.

Tokenizers are trained here with the ``tokenizers`` library on the test corpus (no download):
``llama`` adds BOS through its post-processor and names its EOS in tokenizer_config.json, ``gpt2``
adds nothing and has no tokenizer_config.json (EOS found by name), ``bos_eos`` adds both.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from megatron_lite import config as config_lib
from megatron_lite.checkpoint_dirs import find_tokenizer
from megatron_lite.data.hf_tokenizer import HFTokenizer, tokenizer_sha256
from megatron_lite.data.indexed import IndexedDataset
from megatron_lite.data.manifest import load_manifest
from megatron_lite.data.preprocess import prepare_data
from megatron_lite.data.tokenizer import check_document_mask, load_tokenizer
from script_loading import load_script
from training_helpers import make_corpus, run_train, tiny_train_config, train_losses, write_config

VOCAB = 384  # tiny_train_config's model.vocab_size
SAMPLE = "def f(x):\n\treturn x  +  1   # über  \n\n  The quick brown fox.\r\n"


def corpus_texts(root: Path) -> list[str]:
    texts = [json.loads(line)["text"] for line in (root / "prose.jsonl").read_text().splitlines()]
    return texts + [path.read_text() for path in sorted((root / "code").glob("*.txt"))]


def make_hf_tokenizer(directory: Path, texts: list[str], style: str) -> Path:
    """A byte-level BPE with VOCAB entries saved as directory/tokenizer.json (+ tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = {"gpt2": ["<|endoftext|>"], "llama": ["<unk>", "<s>", "</s>"], "bos_eos": ["<unk>", "<s>", "</s>"]}[style]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    if style == "llama":
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    elif style == "bos_eos":
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                                 special_tokens=[("<s>", 1), ("</s>", 2)])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    if style != "gpt2":
        (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    assert tokenizer.get_vocab_size() == VOCAB
    return directory


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_tokenizer")
    mix = make_corpus(root / "corpus")
    texts = corpus_texts(root / "corpus")
    found = {style: make_hf_tokenizer(root / style, texts, style) for style in ("llama", "gpt2", "bos_eos")}
    return {"root": root, "mix": mix, **found}


def test_encode_decode_and_special_token_rules(world: dict[str, Path]) -> None:
    llama, gpt2, bos_eos = (load_tokenizer(world[style]) for style in ("llama", "gpt2", "bos_eos"))
    assert all(isinstance(tok, HFTokenizer) for tok in (llama, gpt2, bos_eos))
    assert (llama.eod_id, llama.bos_id, llama.prefix_ids) == (2, 1, [1])  # eos/bos named in tokenizer_config.json
    assert (gpt2.eod_id, gpt2.bos_id, gpt2.prefix_ids) == (0, None, [])  # <|endoftext|> found by name
    for tok in (llama, gpt2, bos_eos):
        ids = tok.encode(SAMPLE)
        assert tok.decode(ids) == SAMPLE and tok.vocab_size == VOCAB and max(ids) < VOCAB
        assert tok.encode_batch([SAMPLE, "x"]) == [ids, tok.encode("x")] == tok.encode_batch([SAMPLE, "x"], num_threads=2)
        assert pickle.loads(pickle.dumps(tok)).encode(SAMPLE) == ids  # workers reload from the path
    # A document: exactly what the post-processor adds (the caller appends EOD once, never twice).
    assert llama.encode_documents([SAMPLE]) == [[1, *llama.encode(SAMPLE)]]
    assert gpt2.encode_documents([SAMPLE]) == [gpt2.encode(SAMPLE)]
    assert bos_eos.encode_documents([SAMPLE]) == [[1, *bos_eos.encode(SAMPLE)]]  # its own trailing </s> dropped
    assert llama.encode_prompt("x") == [1, *llama.encode("x")]
    # Special-token text in data is text: a document cannot fake a boundary.
    assert llama.eod_id not in llama.encode("a </s> b") and llama.decode(llama.encode("a </s> b")) == "a </s> b"
    # The identity covers tokenizer_config.json; a directory and its tokenizer.json are the same tokenizer.
    assert tokenizer_sha256(world["llama"]) == tokenizer_sha256(world["llama"] / "tokenizer.json") == llama.sha256
    assert tokenizer_sha256(world["llama"]) != tokenizer_sha256(world["bos_eos"])
    # Document masking must split at the tokenizer's EOD.
    config = config_lib.from_dict({"model": {"attention": {"document_mask": True, "backend": "flex"}}})
    with pytest.raises(ValueError, match=r"model.attention.eod_token_id=0: .* ends documents with id 2; set "
                                         r"model.attention.eod_token_id=2"):
        check_document_mask(llama.eod_id, config.model, str(llama.path))


def test_added_tokens_count_and_missing_eos_is_one_line(world: dict[str, Path], tmp_path: Path) -> None:
    from tokenizers import AddedToken, Tokenizer

    raw = Tokenizer.from_file(str(world["gpt2"] / "tokenizer.json"))
    raw.add_special_tokens([AddedToken("<|im_start|>", special=True)])
    raw.save(str(tmp_path / "added.json"))
    assert load_tokenizer(tmp_path / "added.json").vocab_size == VOCAB + 1
    shutil.copy(world["llama"] / "tokenizer.json", tmp_path / "tokenizer.json")  # no config: </s> found by name
    assert load_tokenizer(tmp_path).eod_id == 2
    raw = Tokenizer.from_file(str(world["gpt2"] / "tokenizer.json"))
    vocab = raw.get_vocab()
    vocab["<|nothing|>"] = vocab.pop("<|endoftext|>")
    no_eos = json.loads(raw.to_str())
    no_eos["added_tokens"] = []
    no_eos["model"]["vocab"] = vocab
    (tmp_path / "noeos").mkdir()
    (tmp_path / "noeos" / "tokenizer.json").write_text(json.dumps(no_eos))
    with pytest.raises(ValueError, match=r"no EOS token .*; set eos_token in .*tokenizer_config.json$") as error:
        load_tokenizer(tmp_path / "noeos")
    assert "\n" not in str(error.value)
    (tmp_path / "noeos" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|nothing|>"}}))
    assert load_tokenizer(tmp_path / "noeos").eod_id == vocab["<|nothing|>"]


def test_evaluation_prompts_start_documents_as_training_did(world: dict[str, Path], tmp_path: Path) -> None:
    from megatron_lite.eval.documents import load_documents
    from megatron_lite.eval.passkey import TASK, PasskeyPromptBuilder

    llama, gpt2 = load_tokenizer(world["llama"]), load_tokenizer(world["gpt2"])
    task = llama.encode_prompt(TASK + "\n")
    prompt = PasskeyPromptBuilder(llama).build(200, 12345, 0.5)
    assert len(prompt.token_ids) == 200 and task[0] == llama.bos_id and prompt.token_ids[: len(task)] == task
    plain = gpt2.encode(TASK + "\n")  # no BOS: the prompt starts with the text
    assert PasskeyPromptBuilder(gpt2).build(200, 12345, 0.5).token_ids[: len(plain)] == plain
    books = tmp_path / "books"
    books.mkdir()
    (books / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    documents = load_documents(str(books), llama, max_doc_tokens=50)
    assert documents.token_ids[0].tolist() == llama.encode_prompt((books / "a.txt").read_text())[:50]


def test_import_carries_the_models_tokenizer_json(world: dict[str, Path], tmp_path: Path) -> None:
    from megatron_lite.convert.hf_import import hf_tokenizer_file

    shutil.copytree(world["llama"], tmp_path / "hf")
    assert hf_tokenizer_file(tmp_path / "hf") == tmp_path / "hf" / "tokenizer.json"
    (tmp_path / "hf" / "tokenizer.model").write_bytes(b"a SentencePiece model, as Llama-2 dirs also hold")
    assert hf_tokenizer_file(tmp_path / "hf") == tmp_path / "hf" / "tokenizer.json"  # what transformers loads
    (tmp_path / "hf" / "megatron_lite_config.yml").write_text("{}\n")  # our export: its original SentencePiece
    assert hf_tokenizer_file(tmp_path / "hf") == tmp_path / "hf" / "tokenizer.model"


def _data_config(world: dict[str, Path], cache: Path, tokenizer: Path) -> config_lib.Config:
    raw = tiny_train_config(world["mix"], cache)
    raw["data"]["tokenizer"] = {"model": str(tokenizer)}
    return config_lib.from_dict(raw)


def _first_document(cache: Path, source: str = "prose") -> list[int]:
    shard = IndexedDataset(str(cache / load_manifest(cache).sources[source].shards[0].prefix))
    return shard.document(0).tolist()


def test_cache_retokenises_when_the_tokenizer_changes(world: dict[str, Path], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = prepare_data(_data_config(world, cache, world["llama"]).data, VOCAB, progress=False)
    assert first.tokenizer.path == "tokenizer/tokenizer.json" and first.tokenizer.eod_id == 2
    assert sorted(p.name for p in (cache / "tokenizer").iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    llama = load_tokenizer(world["llama"])
    document = _first_document(cache)
    text = json.loads((world["mix"].parent / "prose.jsonl").read_text().splitlines()[0])["text"]
    assert document == [1, *llama.encode(text), 2]  # BOS, text, EOD once
    shard_bytes = (cache / first.sources["prose"].shards[0].prefix).with_suffix(".bin").read_bytes()
    again = prepare_data(_data_config(world, cache, world["llama"] / "tokenizer.json").data, VOCAB, progress=False)
    assert again == first  # the same tokenizer named by its file: nothing rebuilt
    other = prepare_data(_data_config(world, cache, world["gpt2"]).data, VOCAB, progress=False)
    assert other.tokenizer.sha256 != first.tokenizer.sha256 and other.tokenizer.eod_id == 0
    assert sorted(p.name for p in (cache / "tokenizer").iterdir()) == ["tokenizer.json"]  # the old config went
    assert _first_document(cache) == [*load_tokenizer(world["gpt2"]).encode(text), 0]
    assert (cache / other.sources["prose"].shards[0].prefix).with_suffix(".bin").read_bytes() != shard_bytes
    with_eos = prepare_data(_data_config(world, cache, world["bos_eos"]).data, VOCAB, progress=False)
    assert _first_document(cache) == [1, *load_tokenizer(world["bos_eos"]).encode(text), 2]  # one EOS, not two
    assert with_eos.tokenizer.sha256 == tokenizer_sha256(world["bos_eos"])


@pytest.mark.slow
def test_vocabulary_mismatch_is_one_line(world: dict[str, Path], tmp_path: Path) -> None:
    raw = tiny_train_config(world["mix"], tmp_path / "cache")
    raw["model"]["vocab_size"] = 300
    raw["data"]["tokenizer"] = {"model": str(world["llama"])}
    result = run_train(write_config(tmp_path / "small.yml", raw), tmp_path / "run", check=False)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "model.vocab_size=300" in lines[0] and "384 pieces" in lines[0]
    assert f"data.tokenizer.model={str(world['llama'])!r}" in lines[0]


@pytest.mark.slow
def test_trains_generates_and_converts_with_its_tokenizer(world: dict[str, Path], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    raw = tiny_train_config(world["mix"], tmp_path / "cache", train_iters=6, eval_interval=6, save_interval=6)
    raw["data"]["tokenizer"] = {"model": str(world["llama"])}
    run = tmp_path / "run"
    run_train(write_config(tmp_path / "llama_tok.yml", raw), run)
    losses = train_losses(run)
    assert len(losses) == 6 and losses[6] < losses[1]
    step_dir = run / "checkpoints" / "step_00000006"
    assert find_tokenizer(step_dir) == step_dir / "tokenizer.json" and not (step_dir / "tokenizer.model").exists()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (step_dir / name).read_bytes() == (world["llama"] / name).read_bytes()
        assert name in json.loads((step_dir / "MANIFEST.json").read_text())["files"]

    # tools/generate.py decodes with the carried tokenizer, prompting with its BOS as training did.
    import torch

    from megatron_lite.eval.generation import generate
    from megatron_lite.weights import load_model

    loaded = load_model(run)
    tok = load_tokenizer(loaded.tokenizer_path)
    prompt = "The quick brown"
    ids = torch.tensor([[1, *tok.encode(prompt)]])
    out = generate(loaded.model, ids, 12, temperature=0.0, eos_token_id=tok.eod_id, vocab_limit=tok.vocab_size)
    new = out[0, ids.shape[1]:].tolist()
    expected = tok.decode(new[: new.index(2)] if 2 in new else new)
    tool = load_script("tools/generate.py")
    assert tool.main([str(run), "--prompt", prompt, "--max-new-tokens", "12", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.endswith(prompt + expected + "\n")  # DeepSpeed may print a line first

    # Export to Hugging Face and back: tokenizer.json and its config travel unchanged, the special ids follow.
    from megatron_lite.convert import convert_checkpoint

    hf_dir, back = tmp_path / "hf", tmp_path / "back"
    convert_checkpoint(run, hf_dir, to="hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (hf_dir / name).read_bytes() == (world["llama"] / name).read_bytes()
    hf_config = json.loads((hf_dir / "config.json").read_text())
    assert (hf_config["bos_token_id"], hf_config["eos_token_id"]) == (1, 2)
    convert_checkpoint(hf_dir, back, to="megatron_lite")
    assert find_tokenizer(back) == back / "tokenizer.json" and not (back / "tokenizer.model").exists()
    assert load_tokenizer(back).sha256 == tok.sha256
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    assert hf_tok(SAMPLE)["input_ids"] == tok.encode_prompt(SAMPLE) and hf_tok.eos_token_id == 2
