"""Demonstration files that cannot be read are refused with an error naming the file."""

from __future__ import annotations

import json
import os

import pytest

from whetstone.errors import WhetstoneError
from whetstone.rl.demos import load_demos, write_demos
from whetstone.tokenizer import Tokenizer, render_chat

TRANSCRIPT = [{"role": "user", "content": "double it"}, {"role": "assistant", "content": "return x * 2"}]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train([render_chat(TRANSCRIPT)] * 5, vocab_size=300)


def test_a_readable_file_loads(tmp_path, tokenizer):
    write_demos(tmp_path / "demos.jsonl", [TRANSCRIPT])
    assert len(load_demos(tmp_path / "demos.jsonl", tokenizer)) == 1


@pytest.mark.parametrize("where", ["under_a_file", "link_loop", "folder"])
def test_a_path_that_cannot_be_read_is_named_not_a_traceback(tmp_path, tokenizer, where):
    (tmp_path / "notes.txt").write_text("not a folder")
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    path = {"under_a_file": tmp_path / "notes.txt" / "demos.jsonl", "link_loop": tmp_path / "loop", "folder": tmp_path}
    with pytest.raises(WhetstoneError, match=rf"demonstrations file {path[where]} cannot be read .*demos_path"):
        load_demos(path[where], tokenizer)


def test_a_transcript_holding_a_unicode_line_separator_is_one_line(tmp_path, tokenizer):
    transcript = [TRANSCRIPT[0], {"role": "assistant", "content": "return x\u2028* 2"}]
    path = tmp_path / "demos.jsonl"
    path.write_text(json.dumps({"messages": transcript}, ensure_ascii=False) + "\n", encoding="utf-8")
    [demo] = load_demos(path, tokenizer)
    assert tokenizer.decode(demo.input_ids).endswith("return x\u2028* 2<|im_end|>\n")


def test_a_line_that_is_not_utf8_is_named(tmp_path, tokenizer):
    path = tmp_path / "demos.jsonl"
    path.write_bytes(json.dumps({"messages": TRANSCRIPT}).encode() + b"\n\xff\n")
    with pytest.raises(WhetstoneError, match=r"demos.jsonl, line 2: not a demonstration .*not UTF-8 text"):
        load_demos(path, tokenizer)
