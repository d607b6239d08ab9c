import json
import os
import tracemalloc

import pytest

from whetstone.config import load_config
from whetstone.data import CorpusConfig, DirectorySource, JsonlSource
from whetstone.data.sources import _read_jsonl, glob_regex, list_sources, read_documents
from whetstone.errors import ConfigError, WhetstoneError


@pytest.mark.parametrize(
    ("pattern", "path", "matches"),
    [
        ("**/*.py", "a.py", True),
        ("**/*.py", "a/b/c.py", True),
        ("*.py", "a/b.py", False),
        ("**/test/**", "test/x.py", True),
        ("**/test/**", "a/test/b/x.py", True),
        ("**/test/**", "a/testing/x.py", False),
        ("pkg/?.py", "pkg/a.py", True),
    ],
)
def test_globs_span_directories_only_with_double_star(pattern, path, matches):
    assert bool(glob_regex(pattern).match(path)) == matches


def test_stdlib_listing_skips_tests_and_installed_packages():
    names = [f.name for f in list_sources(CorpusConfig())]
    assert "stdlib/json/decoder.py" in names and "stdlib/asyncio/events.py" in names
    assert not [n for n in names if "/test/" in n or "/tests/" in n or "site-packages" in n]
    assert names == sorted(names)


def test_directory_include_and_exclude(tmp_path):
    for name in ("a.py", "sub/b.py", "sub/c.txt", "build/d.py", "sub/build/e.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    source = DirectorySource(path=str(tmp_path), include=["**/*.py", "**/*.txt"], exclude=["build/**", "**/c.txt"])
    files = list_sources(CorpusConfig(stdlib=False, directories=[source]))
    assert [f.name for f in files] == [f"{tmp_path}/a.py", f"{tmp_path}/sub/b.py", f"{tmp_path}/sub/build/e.py"]


def test_reading_filters_small_large_and_binary_files(tmp_path):
    files = {
        "good.py": "def f():\n    return 1\n" * 10,
        "tiny.py": "x = 1\n",
        "big.py": "y = 2\n" * 1000,
        "latin1.py": "s = 'caf\xe9'\n" * 20,
        "windows.py": "def g():\r\n    return 2\r\n" * 10,
    }
    for name, text in files.items():
        (tmp_path / name).write_bytes(text.encode("latin-1"))
    (tmp_path / "blob.py").write_bytes(b"\x00\x01" * 100)
    config = CorpusConfig(stdlib=False, directories=[DirectorySource(path=str(tmp_path))], max_document_bytes=4000)
    documents, stats = read_documents(list_sources(config), config)
    assert [d.name.rsplit("/", 1)[1] for d in documents] == ["good.py", "windows.py"]
    assert "\r" not in documents[1].text
    assert stats == dict(files=6, undecodable=2, too_small=1, too_large=1, over_cap=0, documents=2)


def test_size_cap_keeps_a_stable_subset(code_dir):
    config = CorpusConfig(stdlib=False, directories=[DirectorySource(path=str(code_dir))], max_total_bytes=60_000)
    documents, stats = read_documents(list_sources(config), config)
    assert sum(len(d.text.encode()) for d in documents) <= 60_000 and stats["over_cap"] > 0
    again, _ = read_documents(list_sources(config), config)
    assert [d.name for d in again] == [d.name for d in documents]


def test_jsonl_documents_are_named_by_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"code": "print('hello world')\n" * 5}), "", json.dumps({"code": "x = [1, 2, 3]\n" * 8})]
    path.write_text("\n".join(lines) + "\n")
    config = CorpusConfig(stdlib=False, jsonl=[JsonlSource(path=str(path), text_field="code")])
    documents, stats = read_documents(list_sources(config), config)
    assert [d.name for d in documents] == [f"{path}:1", f"{path}:3"]
    assert stats["documents"] == 2


def test_jsonl_lines_end_at_line_feeds_only_and_may_start_with_a_byte_order_mark(tmp_path):
    # json.dumps(ensure_ascii=False) writes these separators raw inside strings: still one line each
    texts = [f"s = 'a{separator}b'  # " + "x" * 70 for separator in ("\u2028", "\u2029", "\x85")]
    path = tmp_path / "docs.jsonl"
    body = "\r\n".join(json.dumps({"text": text}, ensure_ascii=False) for text in texts)
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())
    config = CorpusConfig(stdlib=False, jsonl=[JsonlSource(path=str(path))])
    documents, _ = read_documents(list_sources(config), config)
    assert [(d.name, d.text) for d in documents] == [(f"{path}:{n}", text) for n, text in enumerate(texts, 1)]


def test_a_jsonl_text_with_a_lone_surrogate_counts_as_undecodable(tmp_path):
    path = tmp_path / "docs.jsonl"  # valid JSON, but no UTF-8 text: half of an emoji pair
    path.write_text('{"text": "s = \'\\ud83d\'  # ' + "x" * 80 + '"}\n{"text": "' + "y" * 100 + '"}\n')
    config = CorpusConfig(stdlib=False, jsonl=[JsonlSource(path=str(path))])
    documents, stats = read_documents(list_sources(config), config)
    assert [d.name for d in documents] == [f"{path}:2"] and stats["undecodable"] == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"text": "ok ok ok ok"}\n{"text": broken\n', r"docs.jsonl:2: not valid JSON"),
        ('{"text": "ok"}\n{"body": "x"}\n', r"docs.jsonl:2: no 'text' field"),
        ('{"text": 42}\n', r"docs.jsonl:1: field 'text' is int, not a string"),
        ("[1, 2]\n", r"docs.jsonl:1: no 'text' field"),
    ],
)
def test_bad_jsonl_names_file_line_and_field(tmp_path, content, message):
    path = tmp_path / "docs.jsonl"
    path.write_text(content)
    config = CorpusConfig(stdlib=False, jsonl=[JsonlSource(path=str(path))])
    with pytest.raises(WhetstoneError, match=message):
        read_documents(list_sources(config), config)


def test_unreadable_or_missing_sources_are_named(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b'{"text": "\xff\xfe"}\n')
    config = CorpusConfig(stdlib=False, jsonl=[JsonlSource(path=str(path))])
    with pytest.raises(WhetstoneError, match="docs.jsonl:1: not UTF-8 text"):
        read_documents(list_sources(config), config)
    with pytest.raises(WhetstoneError, match=r"jsonl\[0\].path .*missing.jsonl' does not exist"):
        list_sources(CorpusConfig(stdlib=False, jsonl=[JsonlSource(path=str(tmp_path / "missing.jsonl"))]))
    with pytest.raises(WhetstoneError, match=r"jsonl\[0\].path .*' is not a file"):  # a folder
        list_sources(CorpusConfig(stdlib=False, jsonl=[JsonlSource(path=str(tmp_path))]))
    with pytest.raises(WhetstoneError, match=r"directories\[0\].path .* is not a directory"):
        list_sources(CorpusConfig(stdlib=False, directories=[DirectorySource(path=str(tmp_path / "nope"))]))


def test_empty_corpus_says_why(tmp_path):
    with pytest.raises(WhetstoneError, match="no source files matched"):
        list_sources(CorpusConfig(stdlib=False))
    (tmp_path / "a.py").write_text("x = 1\n")
    config = CorpusConfig(stdlib=False, directories=[DirectorySource(path=str(tmp_path))])
    with pytest.raises(WhetstoneError, match="every document of 1 files was filtered out .1 shorter than min_doc"):
        read_documents(list_sources(config), config)


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="dedup: .*bands \\(7\\) must divide num_permutations \\(128\\)"):
        load_config(CorpusConfig, None, ["dedup.bands=7"])
    with pytest.raises(ConfigError, match="directories.0.paht"):
        load_config(CorpusConfig, None, ['directories=[{paht = "x"}]'])


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda path: path.symlink_to("nowhere.py"), "a link to nothing"),
        (lambda path: (path.symlink_to("loop.py"), path.with_name("loop.py").symlink_to(path.name)), "Too many levels"),
        (lambda path: os.mkfifo(path), "not a regular file"),  # reading it would wait forever
    ],
)
def test_a_source_file_that_cannot_be_read_is_named_with_its_exclude_setting(tmp_path, make, problem):
    (tmp_path / "good.py").write_text("def f():\n    return 1\n" * 10)
    make(tmp_path / "bad.py")
    config = CorpusConfig(stdlib=False, directories=[DirectorySource(path=str(tmp_path))])
    with pytest.raises(WhetstoneError, match=rf"{tmp_path}/(bad|loop).py.*{problem}.*directories\[0\].exclude"):
        list_sources(config)
    excluded = DirectorySource(path=str(tmp_path), exclude=["bad.py", "loop.py"])
    assert [f.path.name for f in list_sources(CorpusConfig(stdlib=False, directories=[excluded]))] == ["good.py"]


def test_a_source_file_gone_before_it_is_read_is_named(tmp_path):
    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text("def f():\n    return 1\n" * 10)
    config = CorpusConfig(stdlib=False, directories=[DirectorySource(path=str(tmp_path))])
    files = list_sources(config)
    (tmp_path / "b.py").unlink()
    with pytest.raises(WhetstoneError, match=rf"cannot read {tmp_path}/b.py \(No such file or directory\)"):
        read_documents(files, config)


def test_a_source_folder_that_cannot_be_read_is_named_with_its_exclude_setting(tmp_path, monkeypatch):
    # a folder of another user, or an I/O error: its files must not silently drop out of the corpus
    import os

    (tmp_path / "pkg").mkdir()
    for path in (tmp_path / "good.py", tmp_path / "pkg" / "mod.py"):
        path.write_text("def f():\n    return 1\n" * 10)
    denied, scandir = tmp_path / "pkg", os.scandir

    def unreadable(path="."):
        if os.fspath(path) == os.fspath(denied):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", unreadable)
    config = CorpusConfig(stdlib=False, directories=[DirectorySource(path=str(tmp_path))])
    with pytest.raises(
        WhetstoneError,
        match=rf"cannot read the folder {tmp_path}/pkg \(Permission denied\): add it to directories\[0\].exclude",
    ):
        list_sources(config)
    excluded = DirectorySource(path=str(tmp_path), exclude=["pkg/**"])
    assert [f.path.name for f in list_sources(CorpusConfig(stdlib=False, directories=[excluded]))] == ["good.py"]
    # one deleted while the walk goes (a cache, a build's temporaries) is not an error: it is gone

    def deleted(path="."):
        if os.fspath(path) == os.fspath(denied):
            raise FileNotFoundError(2, "No such file or directory", os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", deleted)
    assert [f.path.name for f in list_sources(config)] == ["good.py"]


def test_a_jsonl_file_is_read_line_by_line_as_its_documents_are_taken(tmp_path):
    # The first document comes before the rest of the file is read: a line past the reader's
    # buffer, changed on disk after that, is read as it is then (here: no longer JSON).
    path = tmp_path / "docs.jsonl"
    late = b'{"text": "late"}\n'
    path.write_bytes(b'{"text": "first"}\n' + json.dumps({"text": "x" * 8_000_000}).encode() + b"\n" + late)
    (file,) = list_sources(CorpusConfig(stdlib=False, jsonl=[JsonlSource(path=str(path))]))
    documents = _read_jsonl(file)
    assert next(documents).text == "first"
    with path.open("r+b") as handle:  # the same file, rewritten in place
        handle.seek(path.stat().st_size - len(late))
        handle.write(b"not JSON at all\n".ljust(len(late)))
    assert len(next(documents).text) == 8_000_000
    with pytest.raises(WhetstoneError, match=rf"{path}:3: not valid JSON"):
        next(documents)


def test_reading_a_jsonl_file_holds_no_more_than_a_line_of_what_it_leaves_out(tmp_path):
    path = tmp_path / "docs.jsonl"
    too_large = json.dumps({"text": "y" * 1_000_000})
    path.write_text("\n".join([too_large] * 16 + [json.dumps({"text": "def f():\n    return 1\n" * 5})]) + "\n")
    config = CorpusConfig(stdlib=False, jsonl=[JsonlSource(path=str(path))], max_document_bytes=100_000)
    tracemalloc.start()
    try:
        documents, stats = read_documents(list_sources(config), config)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [d.name for d in documents] == [f"{path}:17"] and stats["too_large"] == 16
    assert peak < 8_000_000  # the file is 16 MB: read whole, it would be held at least once
