import json

from whetstone.utils.jsonl import JsonLine, json_lines, read_json_lines


def test_a_record_holding_a_unicode_line_separator_stays_one_line(tmp_path):
    records = [{"text": "a\u2028b\u2029c\x85d"}, {"text": "next"}]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    assert [line.value for line in read_json_lines(path)] == records


def test_a_bad_line_is_its_own_problem_under_its_number():
    lines = b'{"a": 1}\n\n\xff\xfe\n{torn\n[2]'.split(b"\n")
    read = list(json_lines(lines))
    assert [line.number for line in read] == [1, 3, 4, 5]
    assert read[0] == JsonLine(1, {"a": 1}) and read[3] == JsonLine(5, [2])
    assert read[1].problem.startswith("not UTF-8 text") and read[1].value is None
    assert read[2].problem.startswith("not valid JSON")


def test_a_byte_order_mark_before_the_first_line_is_skipped():
    assert [line.value for line in json_lines(b'\xef\xbb\xbf{"a": 1}\n{"b": 2}\n'.split(b"\n"))] == [{"a": 1}, {"b": 2}]


def test_json_that_python_refuses_past_the_parser_is_a_problem_too():
    huge, deep = b'{"a": ' + b"1" * 5000 + b"}", b"[" * 100_000 + b"]" * 100_000
    assert [line.problem.startswith("not valid JSON") for line in json_lines([huge, deep])] == [True, True]
