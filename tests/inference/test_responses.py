from tokenizers import pre_tokenizers

from whetstone.inference.responses import BYTE_OF_CHAR, chat_logprobs, token_bytes
from whetstone.inference.sampling import SamplingParams
from whetstone.inference.sequence import Sequence


def test_the_byte_alphabet_is_the_byte_level_tokenizers():
    assert set(BYTE_OF_CHAR) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(BYTE_OF_CHAR.values()) == list(range(256))
    assert BYTE_OF_CHAR["Ġ"] == ord(" ") and BYTE_OF_CHAR["a"] == ord("a")


def test_chat_logprobs_give_each_tokens_own_bytes(tokenizer):
    """A token holding part of a character decodes to U+FFFD; its bytes are still its own, so a
    client joining the tokens' bytes gets the text."""
    text = "café 東京 ☕<|im_end|>"
    seq = Sequence("s", [1], SamplingParams())
    seq.output_ids = tokenizer.encode(text)
    seq.logprobs = [0.0] * len(seq.output_ids)
    entries = chat_logprobs(seq, 0, len(seq.output_ids), tokenizer)["content"]
    assert any(entry["token"] == "\ufffd" for entry in entries)  # some tokens are parts of characters
    assert bytes(b for entry in entries for b in entry["bytes"]) == text.encode()
    assert token_bytes(tokenizer, tokenizer.im_end_id) == list(b"<|im_end|>")
