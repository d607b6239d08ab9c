"""The feedback store's contract, on a SQLite file and on a real PostgreSQL server alike."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from whetstone.errors import WhetstoneError
from whetstone.store.feedback import DuplicateFeedback, FeedbackStore, ResponseRecord, UnknownResponse, database_url


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        return str(tmp_path / "feedback.db")
    return request.getfixturevalue("fresh_postgres")


def record(response_id: str, choice: int = 0, **changes) -> ResponseRecord:
    fields = dict(
        response_id=response_id,
        choice=choice,
        model="tiny",
        priority="interactive",
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        finish_reason="stop",
        prompt_ids=[5, 6, 7],
        completion_ids=[8, 9],
        logprobs=[-0.12345678901234567, -3.0000000000000004e-05],
        versions=[3, 4],
        routes={"shape": [4, 1, 2], "dtype": "uint8", "data": "AAECAwABAgM="},
    )
    return ResponseRecord(**(fields | changes))


def test_a_rated_response_comes_back_exactly_as_recorded(store_url):
    store = FeedbackStore.open(store_url)
    store.record([record("chatcmpl-a"), record("chatcmpl-a", 1, completion_ids=[1], logprobs=[-1.5], versions=[4])])
    seq = store.add_feedback("chatcmpl-a", 1, "score", 0.25)
    [rated] = store.rated_after(0, limit=10)
    assert rated.seq == seq and rated.rating == "score" and rated.score == 0.25
    assert rated.response.completion_ids == [1] and rated.response.logprobs == [-1.5]
    assert store.response("chatcmpl-a").logprobs == [-0.12345678901234567, -3.0000000000000004e-05]  # bit for bit
    assert store.response("chatcmpl-a").routes == record("x").routes
    store.close()


def test_duplicate_and_unknown_feedback_are_refused(store_url):
    store = FeedbackStore.open(store_url)
    store.record([record("chatcmpl-a")])
    store.add_feedback("chatcmpl-a", 0, "thumbs_up")
    with pytest.raises(DuplicateFeedback, match="already has feedback"):
        store.add_feedback("chatcmpl-a", 0, "thumbs_down")
    with pytest.raises(UnknownResponse, match="no response 'chatcmpl-b'"):
        store.add_feedback("chatcmpl-b", 0, "thumbs_up")
    with pytest.raises(UnknownResponse, match=r"has choices \[0\], not 3"):
        store.add_feedback("chatcmpl-a", 3, "thumbs_up")
    assert store.count_after(0) == 1
    store.close()


def test_accepted_feedback_survives_a_restart(store_url):
    first = FeedbackStore.open(store_url)
    first.record([record("chatcmpl-a"), record("chatcmpl-b")])
    first.add_feedback("chatcmpl-a", 0, "edit_kept")
    first.close()  # the server process goes away
    again = FeedbackStore.open(store_url)
    assert [r.rating for r in again.rated_after(0, 10)] == ["edit_kept"]
    with pytest.raises(DuplicateFeedback):
        again.add_feedback("chatcmpl-a", 0, "edit_reverted")
    again.add_feedback("chatcmpl-b", 0, "edit_reverted")
    assert [r.response.response_id for r in again.rated_after(0, 10)] == ["chatcmpl-a", "chatcmpl-b"]
    again.close()


def test_of_concurrent_duplicates_exactly_one_wins(store_url):
    stores = [FeedbackStore.open(store_url) for _ in range(4)]  # four servers on one database
    stores[0].record([record("chatcmpl-a")])
    outcomes = []

    def rate(store):
        try:
            outcomes.append(store.add_feedback("chatcmpl-a", 0, "thumbs_up"))
        except DuplicateFeedback:
            outcomes.append("duplicate")

    threads = [threading.Thread(target=rate, args=(store,)) for store in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes, key=str).count("duplicate") == 3
    for store in stores:
        store.close()


def test_events_commit_in_the_order_of_their_numbers(store_url):
    # the loop reads past the newest committed event: one numbered lower that committed later
    # would never be read
    import sqlalchemy as sa

    first, second = FeedbackStore.open(store_url), FeedbackStore.open(store_url)
    first.record([record("a"), record("b")])
    inserted, release, seqs = threading.Event(), threading.Event(), {}

    @sa.event.listens_for(first.engine, "commit")
    def slow_commit(connection):  # "a" has its number; its commit is slow
        inserted.set()
        release.wait(10)

    writers = [
        threading.Thread(target=lambda: seqs.setdefault("a", first.add_feedback("a", 0, "thumbs_up"))),
        threading.Thread(target=lambda: seqs.setdefault("b", second.add_feedback("b", 0, "thumbs_down"))),
    ]
    writers[0].start()
    assert inserted.wait(10)
    writers[1].start()
    writers[1].join(0.5)
    assert second.rated_after(0, 10) == []  # "b" waits for "a" (or goes first, numbered after it)
    release.set()
    for writer in writers:
        writer.join(10)
    assert [event.response.response_id for event in second.rated_after(0, 10)] == sorted(seqs, key=seqs.get)


def test_the_cursor_reads_oldest_first_in_pages(store_url):
    store = FeedbackStore.open(store_url)
    store.record([record(f"chatcmpl-{i}") for i in range(5)])
    seqs = [store.add_feedback(f"chatcmpl-{i}", 0, "thumbs_up") for i in range(5)]
    page = store.rated_after(0, limit=2)
    assert [r.seq for r in page] == seqs[:2]
    assert [r.seq for r in store.rated_after(page[-1].seq, limit=10)] == seqs[2:]
    assert store.count_after(seqs[2]) == 2
    store.close()


def test_old_responses_go_once_their_feedback_is_read(store_url):
    store = FeedbackStore.open(store_url)
    old, new = 1000.0, 2000.0
    store.record([record(f"old-{i}", created=old) for i in range(4)] + [record("new-0", created=new)])
    read = [store.add_feedback(f"old-{i}", 0, "thumbs_up") for i in range(2)]  # the loop reads these two
    unread = store.add_feedback("old-2", 0, "thumbs_down")
    store.add_feedback("new-0", 0, "thumbs_up")
    # old-0, old-1: read, so deleted with their feedback; old-3: never rated, deleted; old-2: its
    # feedback is not read yet, kept; new-0: recent, kept.
    assert store.prune(before=1500.0, consumed=read[-1]) == (3, 2)
    assert [r.seq for r in store.rated_after(0, 10)] == [unread, unread + 1]
    assert store.response("old-2") is not None and store.response("old-3") is None
    with pytest.raises(UnknownResponse, match="pruned as too old"):
        store.add_feedback("old-3", 0, "thumbs_up")
    assert store.prune(before=1500.0, consumed=read[-1]) == (0, 0)  # nothing more to do
    store.close()


def test_pruning_never_lets_a_new_event_take_an_old_number(store_url):
    store = FeedbackStore.open(store_url)
    store.record([record(f"r-{i}", created=1000.0) for i in range(3)] + [record("r-3", created=2000.0)])
    seqs = [store.add_feedback(f"r-{i}", 0, "thumbs_up") for i in range(3)]
    cursor = seqs[-1]  # the loop read everything
    assert store.prune(before=1500.0, consumed=cursor) == (2, 2)  # the newest event (and response) stay
    # SQLite numbers a row max(seq) + 1: had the newest event gone, this one would reuse its seq,
    # below the cursor, and the loop would never read it.
    assert store.add_feedback("r-3", 0, "thumbs_down") > cursor
    assert [r.response.response_id for r in store.rated_after(cursor, 10)] == ["r-3"]
    store.close()


def test_store_names_become_urls(tmp_path):
    import sqlalchemy as sa

    assert database_url(str(tmp_path / "a" / "f.db")) == f"sqlite:///{tmp_path}/a/f.db"
    assert (tmp_path / "a").is_dir()
    odd = tmp_path / "b" / "f?x=1#%20é.db"  # a URL's query, fragment and escapes, in a file name
    assert sa.engine.make_url(database_url(str(odd))).database == str(odd)
    assert database_url("postgresql://u@h:5432/db") == "postgresql+psycopg://u@h:5432/db"
    assert database_url("sqlite:////x/y.db") == "sqlite:////x/y.db"


def test_a_store_path_has_home_and_variables_expanded_and_a_url_is_left_as_given(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FEEDBACK_DIR", str(tmp_path / "fb"))
    monkeypatch.chdir(tmp_path)
    assert database_url("~/f.db") == f"sqlite:///{tmp_path}/home/f.db"
    assert database_url("${FEEDBACK_DIR}/f.db") == f"sqlite:///{tmp_path}/fb/f.db"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fb", "home"]  # no folder named `$FEEDBACK_DIR`
    assert database_url("postgresql://u:pa$word@h/db") == "postgresql+psycopg://u:pa$word@h/db"


def test_a_database_other_than_sqlite_or_postgresql_is_refused():
    with pytest.raises(WhetstoneError, match=r"mysql://u:\*\*\*@h/db: only SQLite .* and PostgreSQL"):
        FeedbackStore.open("mysql://u:secret@h/db")


def test_an_unreachable_database_is_named_without_its_password():
    with pytest.raises(WhetstoneError, match=r"cannot open the feedback store postgresql://u:\*\*\*@127.0.0.1:9/db"):
        FeedbackStore.open("postgresql://u:secret@127.0.0.1:9/db")


def test_a_url_is_named_without_its_password_up_to_its_host_and_database():
    # the password may hold a `/`, the query an `@`: neither hides the host nor shows the password
    with pytest.raises(WhetstoneError) as refused:
        FeedbackStore.open("postgresql://u:se/cret@127.0.0.1:9/db?application_name=a@b")
    assert "the feedback store postgresql://u:***@127.0.0.1:9/db?application_name=a@b: " in str(refused.value)
    assert "se/cret" not in str(refused.value)


def test_servers_opening_a_new_store_at_once_all_get_it(store_url):
    """Servers sharing a store start together: each checks which tables are missing, then creates
    them, and another may create one in between (seen: a server of `whetstone bench online` died
    with "table whetstone_responses already exists")."""
    from whetstone.store.feedback import metadata

    for round_ in range(6):
        start, stores, errors = threading.Barrier(4), [], []

        def open_store(start=start, stores=stores, errors=errors):
            start.wait()
            try:
                stores.append(FeedbackStore.open(store_url))
            except WhetstoneError as err:
                errors.append(err)

        threads = [threading.Thread(target=open_store) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, str(errors[0])
        assert len({store.marks().store_id for store in stores}) == 1  # one id, whoever created it
        stores[0].record([record(f"chatcmpl-{round_}")])  # the tables are there and work
        metadata.drop_all(stores[0].engine)  # the next round starts on an empty database again
        for store in stores:
            store.close()


def test_a_store_keeps_its_id_until_it_is_recreated(store_url):
    from whetstone.store.feedback import metadata

    first = FeedbackStore.open(store_url)
    first.record([record("a"), record("b")])
    first.add_feedback("a", 0, "thumbs_up")
    marks = first.marks()
    assert len(marks.store_id) == 16 and (marks.newest, marks.consumed) == (1, 0)
    assert FeedbackStore.open(store_url).marks() == marks  # another server, a restart: the same store
    first.consume(marks.store_id, 1)
    first.consume(marks.store_id, 0)  # never backwards
    first.consume("another-store", 5)  # nor for another store's position
    assert first.marks().consumed == 1
    metadata.drop_all(first.engine)  # recreated: events are numbered anew, and the id says so
    again = FeedbackStore.open(store_url)
    again.record([record("a")])
    again.add_feedback("a", 0, "thumbs_down")
    assert again.marks().store_id != marks.store_id and (again.marks().newest, again.marks().consumed) == (1, 0)
    first.close()
    again.close()


def test_a_sqlite_file_replaced_under_open_connections_is_read_anew(tmp_path):
    # (the loop's pooled connections would go on reading the deleted file, and see no new event)
    path = tmp_path / "feedback.db"
    loop = FeedbackStore.open(str(path))
    old = loop.marks().store_id
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    server = FeedbackStore.open(str(path))  # a server recreates it
    server.record([record("a")])
    server.add_feedback("a", 0, "thumbs_up")
    assert loop.marks() == server.marks() and loop.marks().store_id != old and loop.marks().newest == 1


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_server_writes_into_the_sqlite_file_at_its_path_once_its_own_is_gone(tmp_path, how):
    """A server's pooled connections would go on writing into the file they opened: a client
    gets 200 for feedback that lands in a deleted file, which the loop never reads."""
    import os

    path = tmp_path / "feedback.db"
    server = FeedbackStore.open(str(path))
    server.record([record("a")])
    server.add_feedback("a", 0, "thumbs_up")
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    if how == "deleted":
        loop = FeedbackStore.open(str(path))  # the loop recreates it
    else:
        restored = FeedbackStore.open(str(tmp_path / "backup.db"))  # a backup put in its place
        restored.close()
        os.replace(tmp_path / "backup.db", path)
        loop = FeedbackStore.open(str(path))
    server.record([record("b")])
    assert server.add_feedback("b", 0, "thumbs_up") == 1
    assert loop.count_after(0) == 1 and loop.rated_after(0, 10)[0].response.response_id == "b"
    assert server.marks() == loop.marks()
    server.close()
    loop.close()


@pytest.mark.parametrize("name", ["feedback.db", "feed back?#%20&mode=rwc é.db"], ids=["plain", "odd-characters"])
def test_a_sqlite_file_deleted_under_the_store_is_not_created_again(tmp_path, name):
    """Once the file is gone, a new connection (the stale one dropped) fails naming it, and leaves
    nothing at the path: an empty database there would hide the loss, and the next `open` would
    give it fresh tables and a new id."""
    from whetstone.inference.feedback import lost_tables
    from whetstone.store.feedback import FeedbackStoreError

    path = tmp_path / "the store" / name
    store = FeedbackStore.open(str(path))
    assert store.path == path and store.name == f"sqlite:///{path}" and path.is_file()  # the file at its own path
    assert sorted(p.name for p in path.parent.iterdir()) == [name, f"{name}-shm", f"{name}-wal"]
    store.record([record("a"), record("b")])
    store.add_feedback("a", 0, "thumbs_up")
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink()
    calls = {
        "reading its id and newest event": store.marks,
        "adding feedback": lambda: store.add_feedback("b", 0, "thumbs_up"),
        "keeping a response": lambda: store.record([record("c")]),
        "reading new feedback": lambda: store.rated_after(0, 10),
    }
    for operation, call in calls.items():
        with pytest.raises(FeedbackStoreError) as gone:
            call()
        assert (
            str(gone.value) == f"the feedback store sqlite:///{path}: {operation} failed: unable to open database file"
        )
        assert lost_tables(gone.value, store).startswith(
            f"the feedback store's database at {path} has lost its tables (no file is at that path: it was "
            "deleted, while in use): the responses and feedback it held are not there"
        )
    assert list(path.parent.iterdir()) == []  # no empty database (nor journal) in its place
    again = FeedbackStore.open(str(path))  # only `open` creates it: a server restarted on purpose
    assert store.marks() == again.marks() and again.marks().newest == 0  # the old one follows the new file
    store.close()
    again.close()


def test_responses_and_feedback_are_stamped_by_the_database_clock(store_url, monkeypatch):
    # a server whose clock is 8 days behind: its responses must not look 8 days old to the loop
    import time

    store = FeedbackStore.open(store_url)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 8 * 86400)
    store.record([record("a")])
    store.add_feedback("a", 0, "thumbs_up")
    monkeypatch.setattr(time, "time", real)
    now = store.now()
    assert abs(now - real()) < 60 and abs(store.response("a").created - now) < 60
    assert abs(store.rated_after(0, 1)[0].rated_at - now) < 60
    assert store.prune(before=now - 7 * 86400, consumed=1) == (0, 0)
    store.close()


def test_database_failures_name_the_store_and_what_failed_without_sql(store_url):
    from whetstone.store.feedback import FeedbackStoreError, metadata

    store = FeedbackStore.open(store_url)
    metadata.drop_all(store.engine)  # e.g. a database restored without whetstone's tables
    calls = {
        "reading new feedback": lambda: store.rated_after(0, 10),
        "counting new feedback": lambda: store.count_after(0),
        "adding feedback": lambda: store.add_feedback("a", 0, "thumbs_up"),
        "keeping a response": lambda: store.record([record("a")]),
        "reading its id and newest event": store.marks,
        "pruning": lambda: store.prune(1.0, 0),
    }
    for operation, call in calls.items():
        with pytest.raises(FeedbackStoreError) as failed:
            call()
        message = str(failed.value)
        assert message.startswith(f"the feedback store {store.name}: {operation} failed: ")
        assert "whetstone_" in failed.value.reason  # the database's own words: no such table / relation
        assert not any(word in message for word in ("SELECT", "INSERT", "DELETE", "[SQL", "[parameters"))
    store.close()


def test_a_corrupt_sqlite_file_is_a_feedback_store_error(tmp_path):
    import sqlite3

    from whetstone.store.feedback import FeedbackStoreError

    path = tmp_path / "feedback.db"
    store = FeedbackStore.open(str(path))
    store.record([record("a")])
    store.close()
    connection = sqlite3.connect(path)
    connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    connection.close()
    with open(path, "r+b") as file:
        file.write(b"garbage!" * 64)
    with pytest.raises(FeedbackStoreError, match="reading new feedback failed: file is not a database"):
        FeedbackStore(store.engine).rated_after(0, 10)
    with pytest.raises(FeedbackStoreError, match="cannot open the feedback store .*: file is not a database"):
        FeedbackStore.open(str(path))


def test_a_store_whose_folder_cannot_be_made_is_an_error_naming_it(tmp_path):
    from whetstone.store.feedback import FeedbackStoreError

    (tmp_path / "runs").write_text("a file where the store's folder goes")
    with pytest.raises(FeedbackStoreError, match=f"cannot open the feedback store {tmp_path}/runs/fb.db: ") as failed:
        FeedbackStore.open(str(tmp_path / "runs" / "fb.db"))
    assert f"cannot create the folder {tmp_path}/runs" in str(failed.value) and not failed.value.transient


@pytest.mark.parametrize("url", ["postgresql://u:secret@h:notaport/db", "postgresql://u:secret@[::1/db"])
def test_a_url_that_does_not_parse_is_an_error_without_its_password(url):
    with pytest.raises(WhetstoneError, match=r"postgresql://u:\*\*\*@.* is not a valid database URL") as refused:
        FeedbackStore.open(url)
    assert "secret" not in str(refused.value)
