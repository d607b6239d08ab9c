from whetstone.inference.detokenize import IncrementalText


def stream(tokenizer, text, stop=()):
    """Push `text`'s tokens one at a time; return the increments shown and the final state."""
    inc = IncrementalText(tokenizer.decode, stop)
    shown = []
    for token in tokenizer.encode(text):
        before = inc.released
        inc.push([token])
        shown.append(inc.text[before : inc.released])
        if inc.stopped:
            break
    inc.finish()
    return shown, inc


def test_token_by_token_text_equals_decoding_everything(tokenizer):
    text = "def fetch(url):\n    return 'café ☕ 東京'  # ünïcode\n"
    shown, inc = stream(tokenizer, text)
    assert inc.text == text == tokenizer.decode(tokenizer.encode(text))
    assert "".join(shown) == text
    assert all("\ufffd" not in piece for piece in shown)  # no half characters on the way


def test_stop_string_is_cut_and_never_shown(tokenizer):
    shown, inc = stream(tokenizer, "first line\nEND of it\nmore", stop=("\nEND",))
    assert inc.stopped and inc.text == "first line"
    assert "".join(shown) == "first line"


def test_text_that_might_start_a_stop_string_waits():
    pieces = {1: "ab", 2: "c", 3: "d"}
    inc = IncrementalText(lambda ids: "".join(pieces[i] for i in ids), stop=("cx",))
    inc.push([1, 2])
    assert inc.text == "abc" and inc.released == 2  # "c" may begin "cx"
    inc.push([3])
    assert inc.released == 4 and not inc.stopped  # it did not


def test_finish_releases_the_held_back_tail():
    inc = IncrementalText(lambda ids: "xy" * len(ids), stop=("yz",))
    inc.push([1])
    assert inc.released == 1
    inc.finish()
    assert inc.released == 2 and inc.text == "xy"
