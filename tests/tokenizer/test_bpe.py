import inspect
import json
import socket
import textwrap
import threading
import unicodedata

import pytest
from tokenizers import Tokenizer as Backend
from transformers import AutoTokenizer

from whetstone.errors import CheckpointError, WhetstoneError
from whetstone.tokenizer import Tokenizer, render_chat
from whetstone.tokenizer.bpe import NORMALIZER_SHRINK

CODE = inspect.getsource(textwrap) + inspect.getsource(json.decoder)
SAMPLE = 'def f(x):\n    """Ünïcode, digits 12345."""\n    return {"a": x}  # <|im_end|>\n'


@pytest.fixture(scope="module")
def trained():
    return Tokenizer.train([CODE], vocab_size=512)


def test_training_fills_the_vocab_and_round_trips_code(trained):
    assert trained.vocab_size == 512
    assert trained.decode(trained.encode(CODE)) == CODE
    assert trained.decode(trained.encode(SAMPLE)) == SAMPLE
    # BPE learned something: fewer tokens than bytes.
    assert len(trained.encode(CODE)) < len(CODE.encode()) / 2


def test_chat_tokens_are_single_ids_with_qwen3_strings(trained):
    ids = trained.special_ids
    assert set(ids) == {
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
    }
    assert len(set(ids.values())) == len(ids) and max(ids.values()) < trained.vocab_size
    assert trained.encode("<|im_start|>user\n")[0] == trained.im_start_id
    assert trained.encode("<tool_call>") == [ids["<tool_call>"]]
    assert (trained.endoftext_id, trained.im_end_id) == (ids["<|endoftext|>"], ids["<|im_end|>"])


def test_plain_encoding_keeps_control_strings_as_text(trained):
    # A source file that mentions "<|endoftext|>" must not end its document early.
    [plain] = trained.encode_plain(["x = '<|endoftext|>'"])
    assert trained.endoftext_id not in plain
    assert trained.decode(plain) == "x = '<|endoftext|>'"
    assert trained.endoftext_id in trained.encode("x = '<|endoftext|>'")


def test_saved_tokenizer_loads_back_and_in_transformers(trained, tmp_path):
    trained.save(tmp_path)
    again = Tokenizer.load(tmp_path)
    assert again.encode(SAMPLE) == trained.encode(SAMPLE) and again.special_ids == trained.special_ids
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.encode(SAMPLE) == trained.encode(SAMPLE)
    assert hf.decode(trained.encode(SAMPLE)) == SAMPLE
    assert (hf.eos_token_id, hf.pad_token_id) == (trained.im_end_id, trained.endoftext_id)
    # Its chat template renders whetstone's format, so HF tools and vLLM build the same prompts.
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == render_chat(
        messages, None, True
    )


def test_a_tokenizer_saved_with_truncation_and_padding_encodes_whole_texts(trained, tmp_path):
    """tokenizer.json files saved after a truncating, padding call keep those settings: a corpus
    or a prompt encoded with them would be cut and padded, silently."""
    trained.save(tmp_path)
    saved = Backend.from_file(str(tmp_path / "tokenizer.json"))
    saved.enable_truncation(max_length=8)
    saved.enable_padding(length=8, pad_id=trained.endoftext_id)
    saved.save(str(tmp_path / "tokenizer.json"))
    loaded = Tokenizer.load(tmp_path)
    assert loaded.encode(SAMPLE) == trained.encode(SAMPLE) and len(trained.encode(SAMPLE)) > 8
    assert loaded.encode_plain([SAMPLE, "x"]) == trained.encode_plain([SAMPLE, "x"])
    loaded.save(tmp_path / "again")  # saved as it came: its padding block names the pad token
    assert Backend.from_file(str(tmp_path / "again" / "tokenizer.json")).padding["length"] == 8


def test_a_tokenizer_folder_with_home_or_a_variable_is_expanded(trained, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MODEL_DIR", str(tmp_path / "home" / "model"))
    monkeypatch.chdir(tmp_path)
    trained.save("~/model")
    assert Tokenizer.load("$MODEL_DIR").encode(SAMPLE) == trained.encode(SAMPLE)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]  # no folder named `~`


def test_qwen3_checkpoint_tokenizer_loads_with_qwen3_ids(qwen3_dir, qwen3_hf):
    tokenizer = Tokenizer.load(qwen3_dir)
    first = qwen3_hf.convert_tokens_to_ids("<|endoftext|>")  # 151643 in the real file
    assert (tokenizer.endoftext_id, tokenizer.im_start_id, tokenizer.im_end_id) == (first, first + 1, first + 2)
    assert tokenizer.special_ids["<tool_call>"] == first + 14  # 151657 in the real file
    assert tokenizer.vocab_size == len(qwen3_hf)
    for text in (CODE[:3000], SAMPLE, "<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>"):
        assert tokenizer.encode(text) == qwen3_hf.encode(text)
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_saving_a_loaded_checkpoint_keeps_its_config(qwen3_dir, tmp_path):
    Tokenizer.load(qwen3_dir).save(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()) == json.loads(
        (qwen3_dir / "tokenizer_config.json").read_text()
    )
    assert AutoTokenizer.from_pretrained(str(tmp_path)).encode(SAMPLE) == Tokenizer.load(qwen3_dir).encode(SAMPLE)


def test_bad_checkpoints_name_the_file(tmp_path, trained):
    with pytest.raises(CheckpointError, match="tokenizer.json does not exist"):
        Tokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not a valid tokenizer.json"):
        Tokenizer.load(tmp_path)
    # A vocabulary without ChatML tokens cannot speak the chat format.
    layout = json.loads(trained._backend.to_str())
    layout["added_tokens"] = [t for t in layout["added_tokens"] if t["content"] != "<|im_end|>"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(layout))
    with pytest.raises(CheckpointError, match="lacks the ChatML tokens"):
        Tokenizer.load(tmp_path)


def test_control_tokens_not_marked_special_are_refused(tmp_path, trained):
    # Plain encoding would turn a corpus file quoting "<|endoftext|>" into a document end.
    layout = json.loads(trained._backend.to_str())
    for token in layout["added_tokens"]:
        token["special"] = token["content"] != "<|endoftext|>" and token["special"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(layout))
    with pytest.raises(CheckpointError, match=r"tokens \['<\|endoftext\|>'\] are not marked special"):
        Tokenizer.load(tmp_path)


def test_a_post_processor_that_adds_a_bos_token_does_not_hide_the_chatml_tokens(tmp_path, trained):
    # encode() never applies the post-processor, so neither does the search for the tokens.
    layout = json.loads(trained._backend.to_str())
    bos = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    layout["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|endoftext|>": {"id": "<|endoftext|>", "ids": [trained.endoftext_id], "tokens": ["<|endoftext|>"]}
        },
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(layout))
    loaded = Tokenizer.load(tmp_path)
    assert loaded.special_ids == trained.special_ids
    assert loaded.encode("<|im_start|>user\n") == trained.encode("<|im_start|>user\n")


def test_vocab_size_covers_the_largest_id_when_some_ids_are_unused(tmp_path, qwen3_dir):
    # A model sized from it (and the server's check against the model's) must hold every id.
    layout = json.loads((qwen3_dir / "tokenizer.json").read_text())
    word = max((entry for entry in layout["model"]["vocab"] if entry.isascii() and entry.isalpha()), key=len)
    layout["model"]["vocab"][word] = 5000
    (tmp_path / "tokenizer.json").write_text(json.dumps(layout))
    tokenizer = Tokenizer.load(tmp_path)
    assert tokenizer.encode(word) == [5000]
    assert tokenizer.vocab_size == 5001


def test_a_tokenizer_config_that_cannot_be_read_is_named(tmp_path, trained, monkeypatch):
    trained.save(tmp_path)
    config = tmp_path / "tokenizer_config.json"
    config.unlink()
    config.mkdir()
    with pytest.raises(CheckpointError, match=f"^{config} is a directory, not a JSON file$"):
        Tokenizer.load(tmp_path)
    config.rmdir()
    config.write_bytes(b'{"chat_template": "\xff"}')
    with pytest.raises(CheckpointError, match=f"^{config} is not valid JSON: 'utf-8' codec can't decode"):
        Tokenizer.load(tmp_path)
    config.write_text("null")  # valid JSON, not a config
    with pytest.raises(CheckpointError, match=f"^{config} holds null, not a JSON object: restore"):
        Tokenizer.load(tmp_path)
    config.unlink()
    monkeypatch.chdir(tmp_path)  # a socket's path must be short
    with socket.socket(socket.AF_UNIX) as unreadable:  # there, but open() fails (as root too)
        unreadable.bind(config.name)
        with pytest.raises(CheckpointError, match=f"^{config} cannot be read: No such device or address$"):
            Tokenizer.load(tmp_path)


def test_vocab_too_small_for_bytes_is_refused():
    with pytest.raises(WhetstoneError, match="vocab_size 100"):
        Tokenizer.train([CODE], vocab_size=100)


def test_encoding_a_long_text_lets_other_threads_run(trained):
    """A server tokenizes in a worker thread; that keeps its event loop free only if encoding
    releases the GIL. This thread counts its turns while the other one is inside `encode`:
    holding the GIL, encode would leave it one or two."""
    text = CODE * 30
    inside, done = threading.Event(), threading.Event()

    def work():
        inside.set()
        trained.encode(text)
        done.set()

    thread = threading.Thread(target=work)
    thread.start()
    inside.wait()
    turns = 0
    while not done.wait(0.001):
        turns += 1
    thread.join()
    assert turns >= 20


def test_min_tokens_bounds_the_count_without_encoding(trained, qwen3_dir):
    for tokenizer in (trained, Tokenizer.load(qwen3_dir)):
        longest = max(tokenizer._backend.get_vocab(with_added_tokens=True), key=len)
        repeated = tokenizer.decode([tokenizer.token_to_id(longest)]) * 50
        composed = unicodedata.normalize("NFD", "\u1f82") * 300  # 4 code points NFC makes one
        for text in (CODE, SAMPLE, repeated, composed, "<|im_start|>" * 40, "", "x"):
            assert tokenizer.min_tokens(text) <= len(tokenizer.encode(text)), text[:40]
        assert tokenizer.min_tokens(CODE) > len(tokenizer.encode(CODE)) / 20  # a bound that refuses something


def test_min_tokens_knows_nothing_of_a_pipeline_that_drops_text(trained):
    layout = json.loads(trained._backend.to_str())
    layout["normalizer"] = {
        "type": "Sequence",
        "normalizers": [{"type": "NFC"}, {"type": "Strip", "strip_left": True, "strip_right": True}],
    }
    stripping = Tokenizer(Backend.from_str(json.dumps(layout)), trained.config)
    assert stripping.min_tokens(" " * 10_000 + "x") == 0
    assert len(stripping.encode(" " * 10_000 + "x")) == 1


def test_normalization_merges_at_most_four_characters_into_one():
    longest = max(
        len(unicodedata.normalize("NFD", chr(c)))
        for c in range(0x110000)
        if unicodedata.normalize("NFC", chr(c)) == chr(c)
    )
    assert longest == NORMALIZER_SHRINK["NFC"] == NORMALIZER_SHRINK["NFKC"]
