import random

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


def test_a_stop_string_ends_at_the_token_completing_it_though_the_token_ends_inside_a_character():
    """Byte-level tokens may end part-way through a character: "日本語" as e6 97 a5 e6 | 9c ac e8 |
    aa 9e. The second token completes "本" whatever bytes come next, so it is the last one."""
    utf8 = "日本語".encode()
    pieces = {1: utf8[:4], 2: utf8[4:7], 3: utf8[7:]}

    def decode(ids):
        return b"".join(pieces[i] for i in ids).decode(errors="replace")

    inc = IncrementalText(decode, stop=("本",))
    inc.push([1])
    assert not inc.stopped and inc.released == 0  # "日" then half a character: nothing shown yet
    inc.push([2])
    assert inc.stopped and inc.text == "日" and inc.released == 1
    inc = IncrementalText(decode, stop=("語",))  # no stop string before the split character: wait
    inc.push([1, 2])
    assert not inc.stopped and inc.text == "" and inc.released == 0
    inc.push([3])
    assert inc.stopped and inc.text == "日本"


def test_finish_releases_the_held_back_tail():
    inc = IncrementalText(lambda ids: "xy" * len(ids), stop=("yz",))
    inc.push([1])
    assert inc.released == 1
    inc.finish()
    assert inc.released == 2 and inc.text == "xy"


def held_back(text, stops):
    """The longest tail of `text` that starts a stop string, by trying every size."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def test_the_held_back_tail_is_the_longest_start_of_a_stop_string():
    rng = random.Random(0)
    for _ in range(200):
        pieces = {i: "".join(rng.choice("ab") for _ in range(rng.randrange(1, 4))) for i in range(20)}
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randrange(2, 9))) for _ in range(3))
        inc = IncrementalText(lambda ids, pieces=pieces: "".join(pieces[i] for i in ids), stops)
        while not inc.stopped and len(inc.text) < 60:
            inc.push([rng.randrange(20)])
            assert inc.released == (len(inc.text) if inc.stopped else len(inc.text) - held_back(inc.text, stops))


class CountingStop(str):
    """A stop string that counts the pieces taken of it (each costs up to its length to compare)."""

    def __getitem__(self, key):
        self.pieces = getattr(self, "pieces", 0) + 1
        return str.__getitem__(self, key)


def test_a_long_stop_string_costs_what_the_text_adds_per_token():
    """Each token's check tries only the sizes its characters can have made: trying every size
    costs the stop string's length squared per token, in the engine thread."""
    stop = CountingStop("q" * 500 + "!")
    inc = IncrementalText(lambda ids: "ab " * len(ids), (stop,))
    for _ in range(300):
        inc.push([0])
    assert len(inc.text) == 900 and inc.released == 900
    assert stop.pieces <= 900
    inc = IncrementalText(lambda ids: "".join("q" if i else "x" for i in ids), (stop,))
    for token in [1] * 450 + [0] + [1] * 10:  # a long start of the stop string, broken, begun again
        inc.push([token])
    assert inc.released == len(inc.text) - 10 == 451
