"""The whole build on a small real code tree: split, tokenizer, packing, stats, cache."""

import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import whetstone.data.build as build
from whetstone.data import Corpus, build_corpus
from whetstone.data.build import cache_key, split_documents
from whetstone.data.sources import Document, list_sources
from whetstone.errors import WhetstoneError
from whetstone.tokenizer import Tokenizer


def documents_of(corpus, split):
    """The texts packed into a split's stream, cut at the EOS separators."""
    stream = np.asarray(corpus.train_tokens if split == "train" else corpus.val_tokens)
    ends = np.flatnonzero(stream == corpus.eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [corpus.tokenizer.decode(stream[s:e].tolist()) for s, e in zip(starts, ends)]


def test_build_splits_by_file_and_packs_every_document(config, code_dir):
    corpus = build_corpus(config)
    names = json.loads((corpus.path / "documents.json").read_text())
    assert names["train"] and names["val"] and not set(names["train"]) & set(names["val"])
    for split in ("train", "val"):
        texts = [(code_dir / n.removeprefix(str(code_dir) + "/")).read_text() for n in names[split]]
        assert documents_of(corpus, split) == texts

    m = corpus.manifest
    assert m["sources"]["files"] == 13 and m["split"]["train_documents"] + m["split"]["val_documents"] == 13
    assert m["tokens"] == {"train": len(corpus.train_tokens), "val": len(corpus.val_tokens), "dtype": "uint16"}
    assert m["tokenizer"]["vocab_size"] == corpus.tokenizer.vocab_size <= 400
    assert 1.5 < m["bytes_per_token"] < 6.0  # BPE merged bytes


def test_entropy_is_the_train_unigram_entropy(config):
    corpus = build_corpus(config)
    counts = np.bincount(np.asarray(corpus.train_tokens)).astype(float)
    p = counts[counts > 0] / counts.sum()
    assert corpus.unigram_entropy == pytest.approx(-(p * np.log(p)).sum())
    assert 0 < corpus.unigram_entropy < np.log(corpus.vocab_size)
    smoothed = np.bincount(np.asarray(corpus.train_tokens), minlength=corpus.vocab_size) + 1
    log_p = np.log(smoothed / smoothed.sum())
    assert corpus.manifest["val_unigram_cross_entropy"] == pytest.approx(-log_p[np.asarray(corpus.val_tokens)].mean())


def test_tokenizer_never_sees_validation_text(config, code_dir):
    # Put a long made-up word only into the validation files: a BPE trained on them would learn it.
    val = json.loads((build_corpus(config).path / "documents.json").read_text())["val"]
    for name in val:
        path = code_dir / name.removeprefix(str(code_dir) + "/")
        path.write_text(path.read_text() + "\n# " + "zqxvbn " * 400 + "\n")
    corpus = build_corpus(config)
    assert json.loads((corpus.path / "documents.json").read_text())["val"] == val
    vocabulary = [corpus.tokenizer.id_to_token(i) for i in range(corpus.vocab_size)]
    assert not [t for t in vocabulary if "zqx" in t]


def test_unchanged_config_reuses_the_build_and_changes_rebuild(config, code_dir):
    first = build_corpus(config)
    stamp = os.stat(first.path / "manifest.json").st_mtime_ns
    assert build_corpus(config.model_copy(update={"seq_len": 64, "demo_weight": 0.5})).path == first.path
    assert os.stat(first.path / "manifest.json").st_mtime_ns == stamp  # not rebuilt
    assert build_corpus(config.model_copy(update={"vocab_size": 380})).path != first.path
    (code_dir / "pkg" / "new_module.py").write_text("def added():\n    return 'a new file changes the key'\n" * 3)
    assert build_corpus(config).path != first.path
    assert os.stat(build_corpus(config, rebuild=True).path / "manifest.json").st_mtime_ns != stamp


def test_duplicates_are_counted_and_left_out(config, code_dir):
    source = (code_dir / "pkg" / "textwrap.py").read_text()
    (code_dir / "pkg" / "textwrap_copy.py").write_text(source)
    (code_dir / "pkg" / "textwrap_vendored.py").write_text("# vendored\n" + source)
    corpus = build_corpus(config)
    assert corpus.manifest["dedup"]["exact_duplicates"] == 1
    assert corpus.manifest["dedup"]["near_duplicates"] == 1
    names = json.loads((corpus.path / "documents.json").read_text())
    assert not [n for n in names["train"] + names["val"] if "textwrap_" in n]


def test_a_given_tokenizer_is_used_as_is(config, tmp_path):
    Tokenizer.train(["def f(x):\n    return x + 1\n" * 50], vocab_size=300).save(tmp_path / "external")
    corpus = build_corpus(config.model_copy(update={"tokenizer": str(tmp_path / "external")}))
    assert corpus.manifest["tokenizer"]["source"] == str(tmp_path / "external")
    assert corpus.tokenizer.encode("return x") == Tokenizer.load(tmp_path / "external").encode("return x")


def test_failed_build_leaves_no_cache_entry(config):
    def broken_demos():
        return [[{"role": "user", "content": "hi"}, {"role": "robot", "content": "?"}]]

    with pytest.raises(WhetstoneError, match="demonstration 0: chat: message 1 has role 'robot'"):
        build_corpus(config, demos=broken_demos)
    assert os.listdir(config.cache_dir) == []  # not even a temporary folder


def test_split_holds_out_at_least_one_document_each_side():
    documents = [Document(f"m{i}.py", "x") for i in range(3)]
    train, val = split_documents(documents, validation_fraction=0.01, seed=0)
    assert len(val) == 1 and len(train) == 2
    assert split_documents(documents, 0.01, seed=0) == (train, val)
    with pytest.raises(WhetstoneError, match="1 document"):
        split_documents(documents[:1], 0.5, seed=0)


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda path: (path / "train.npy").write_bytes((path / "train.npy").read_bytes()[:-100]), "train.npy"),
        (lambda path: (path / "val.npy").unlink(), "val.npy: No such file"),
        (lambda path: (path / "val.npy").write_bytes(b"not a numpy file"), "val.npy"),
        (lambda path: np.save(path / "val.npy", np.zeros(3, np.uint16)), r"val.npy holds shape \(3,\)"),
        (lambda path: (path / "manifest.json").write_text('{"format_version": 1, "tok'), "manifest.json cannot be"),
        (lambda path: (path / "manifest.json").write_text('{"format_version": 1}'), "manifest.json lacks 'tokens'"),
    ],
)
def test_a_damaged_cache_entry_is_named_with_what_to_do(config, damage, problem):
    path = build_corpus(config).path
    damage(path)
    with pytest.raises(WhetstoneError, match=rf"{path} is a damaged corpus build \({problem}.*delete the folder"):
        build_corpus(config)
    shutil.rmtree(path)
    assert build_corpus(config).path == path  # built again


def test_a_build_started_while_another_builds_the_same_entry_waits_and_uses_it(config, monkeypatch):
    # Two runs started together: the second must neither build the entry too nor swap the
    # first's folder away under it (the second to finish crashed renaming onto it).
    real_build, building, release, waiting = build._build_into, threading.Event(), threading.Event(), threading.Event()
    builds = []

    def paused_build(*args):
        builds.append(threading.current_thread().name)
        building.set()
        assert release.wait(60)
        return real_build(*args)

    class Waiting(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("waiting for another process building"):
                waiting.set()

    monkeypatch.setattr(build, "_build_into", paused_build)
    logging.getLogger("whetstone.data").addHandler(handler := Waiting())
    paths = {}
    threads = [threading.Thread(target=lambda n=n: paths.update({n: build_corpus(config).path}), name=n) for n in "ab"]
    try:
        threads[0].start()
        assert building.wait(60)
        threads[1].start()
        while threads[1].is_alive() and not (waiting.is_set() or len(builds) > 1):  # b waits, or builds too
            time.sleep(0.01)
    finally:
        release.set()
        for thread in threads:
            thread.join(60)
        logging.getLogger("whetstone.data").removeHandler(handler)
    assert builds == ["a"] and paths["a"] == paths["b"]
    assert os.listdir(config.cache_dir) == [paths["a"].name]  # no temporary folder, no lock file


def test_a_build_cleans_up_what_a_killed_build_of_its_entry_left(config):
    key = cache_key(config, list_sources(config), None)
    leftover = Path(config.cache_dir) / f".{key}.k1ll3d.tmp"
    (leftover / "tokenizer").mkdir(parents=True)
    (leftover / "train.npy").write_bytes(b"half")
    assert build_corpus(config).path.name == key
    assert not leftover.exists()


def test_a_cache_on_a_file_system_without_locks_still_builds(config, monkeypatch, caplog):
    # Lustre without `-o flock`, NFS without its lock service: flock fails with ENOLCK or ENOSYS.
    # The entry is built unlocked, and another build's folder is left alone (with no lock, it
    # may be one in progress).
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    key = cache_key(config, list_sources(config), None)
    other = Path(config.cache_dir) / f".{key}.other-node.tmp"
    other.mkdir(parents=True)
    caplog.set_level(logging.WARNING, logger="whetstone.data")
    assert build_corpus(config).path.name == key
    assert other.exists()
    assert "cannot be locked on its file system: building the corpus without a lock" in caplog.text


def test_a_source_file_whose_name_is_not_utf8_is_built_like_any_other(config, code_dir):
    name = os.fsencode(code_dir / "pkg") + b"/caf\xe9.py"  # a Latin-1 name, as old archives hold
    try:
        with open(name, "w") as handle:
            handle.write("def latin_one(value):\n    return value * 2 + 1  # a file with an old name\n")
    except OSError:  # a file system that takes UTF-8 names only
        pytest.skip("this file system refuses a name that is not UTF-8")
    names = json.loads((build_corpus(config).path / "documents.json").read_text())
    assert sum(n.endswith("/pkg/caf\udce9.py") for n in names["train"] + names["val"]) == 1


def _key_without_encoding_version(config, files) -> str:
    """The cache key as it was computed before the key named the encoding procedure: the
    config, the source listing, the demonstrations and the tokenizer files only."""
    import hashlib

    from whetstone.data.config import LOADER_FIELDS
    from whetstone.data.loader import MANIFEST_VERSION

    folder = Path(config.tokenizer)
    recipe = {
        "format_version": MANIFEST_VERSION,
        "config": config.model_dump(mode="json", exclude=LOADER_FIELDS),
        "files": [(f.name, f.size, f.mtime_ns) for f in files],
        "demos": None,
        "tokenizer": [build._file_hash(folder / n) for n in ("tokenizer.json", "tokenizer_config.json")],
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def test_a_corpus_cut_by_a_truncating_tokenizer_json_is_rebuilt_whole(config, code_dir, tmp_path, monkeypatch):
    # A tokenizer.json saved with a `truncation` setting cut every document to max_length tokens
    # when the encoding honoured it; now every text is encoded whole. The tokenizer files are
    # unchanged, so only a key that names the encoding procedure rebuilds the cut corpus.
    folder = tmp_path / "truncating"
    Tokenizer.train(["def f(x):\n    return x + 1\n" * 50], vocab_size=300).save(folder)
    layout = json.loads((folder / "tokenizer.json").read_text())
    layout["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    (folder / "tokenizer.json").write_text(json.dumps(layout))
    config = config.model_copy(update={"tokenizer": str(folder)})

    real_encode = build.encode_documents
    with monkeypatch.context() as patch:  # the build as the truncating encoding made it
        patch.setattr(build, "encode_documents", lambda *a: [ids[:8] for ids in real_encode(*a)])
        cut = build_corpus(config)
    old_key = _key_without_encoding_version(config, list_sources(config))
    if cut.path.name != old_key:  # file it where the earlier key put it
        cut.path.rename(cut.path.with_name(old_key))
    assert max(map(len, documents_of(Corpus.open(cut.path.with_name(old_key)), "train"))) < 100

    corpus = build_corpus(config)
    assert corpus.path.name != old_key
    names = json.loads((corpus.path / "documents.json").read_text())["train"]
    assert documents_of(corpus, "train") == [(code_dir / n.removeprefix(f"{code_dir}/")).read_text() for n in names]


def test_a_tokenizer_file_that_cannot_be_read_is_named(config, tmp_path):
    folder = tmp_path / "external"
    Tokenizer.train(["def f(x):\n    return x + 1\n" * 50], vocab_size=300).save(folder)
    (folder / "tokenizer_config.json").unlink()
    (folder / "tokenizer_config.json").mkdir()  # a copy gone wrong
    with pytest.raises(WhetstoneError, match=rf"{folder}/tokenizer_config.json cannot be read: Is a directory"):
        build_corpus(config.model_copy(update={"tokenizer": str(folder)}))
