from tokenizers import pre_tokenizers

from whetstone.inference.responses import BYTE_OF_CHAR, chat_logprobs, completion_logprobs, token_bytes
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


def test_completion_top_logprobs_keep_the_likelier_of_two_tokens_with_one_text(tokenizer):
    """Two tokens that are parts of different characters both decode to U+FFFD, one key of the
    legacy format's text -> logprob dict: it holds the likelier token's logprob."""
    partial = [t for t in tokenizer.encode("東京 ☕ café") if tokenizer.decode([t]) == "\ufffd"]
    first, second = sorted(set(partial))[:2]
    seq = Sequence("s", [1], SamplingParams(top_logprobs=3))
    seq.output_ids, seq.logprobs = [first], [-0.5]
    seq.top_logprobs = [[(first, -0.5), (second, -1.5), (tokenizer.encode("a")[0], -3.0)]]
    top = completion_logprobs(seq, 0, 1, tokenizer.decode, 0)["top_logprobs"]
    assert top == [{"\ufffd": -0.5, "a": -3.0}]
