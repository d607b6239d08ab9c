"""A store with a corrupt version: found by `inspect --verify`, repaired by withdrawing it and
publishing a keyframe in its place; subscribers that rejected it take the new one, and those that
held a withdrawn version re-sync, all ending bit-identical to the repaired store."""

import copy
import json
import shutil
import threading
import uuid

import pytest
from safetensors.torch import save_file
from typer.testing import CliRunner

from tests.sync.conftest import FakeTrainer, bit_identical, published
from tests.sync.test_publish_subscribe import corrupt
from whetstone.errors import WhetstoneError
from whetstone.store import LocalStore
from whetstone.sync import Publisher, Subscriber, WeightStore
from whetstone.sync.cli import app
from whetstone.sync.manifest import manifest_key

runner = CliRunner()


def checkpoint(path, state) -> str:
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return str(path)


def test_inspect_verify_names_the_corrupt_version_and_chunk(weights, config, trainer):
    publisher = Publisher(weights, config)
    manifests = [publisher.publish(trainer.step()) for _ in range(4)]
    store = str(weights.objects.root)
    result = runner.invoke(app, ["inspect", store, "--verify"])
    assert result.exit_code == 0, result.output
    assert "every chunk of the 4 versions reads back intact" in result.output

    bad = manifests[2].chunks[1].key
    corrupt(weights, bad, "flip")
    assert runner.invoke(app, ["inspect", store]).exit_code == 0  # without --verify no chunk is read
    result = runner.invoke(app, ["inspect", store, "--verify"])
    assert result.exit_code != 0
    assert f"version 2: chunk {bad} fails its checksum" in result.output
    assert "version 3: a delta on version 2, which cannot be taken" in result.output
    message = str(result.exception)
    assert isinstance(result.exception, WhetstoneError) and "2 of 4 versions" in message
    assert f"whetstone sync withdraw {store} --from 2" in message


def test_withdraw_then_a_keyframe_repairs_the_store_and_every_subscriber_converges(weights, config, trainer, tmp_path):
    store = str(weights.objects.root)
    publisher = Publisher(weights, config)  # keyframe every 5: versions 1..4 are deltas
    for _ in range(2):
        publisher.publish(trainer.step())
    behind = Subscriber(weights, config, name="behind")  # will reject version 2
    behind.poll()
    publisher.publish(trainer.step())
    stale_2 = Subscriber(weights, config, name="stale-2")  # holds version 2 as first published
    stale_2.poll()
    publisher.publish(trainer.step())
    ahead = Subscriber(weights, config, name="ahead")  # holds version 3, built on it
    ahead.poll()
    corrupt(weights, weights.manifest(2).chunks[0].key, "flip")
    assert behind.poll() == 1 and "checksum" in behind.rejected[2]

    result = runner.invoke(app, ["withdraw", store, "--from", "2"])
    assert result.exit_code == 0, result.output
    assert "withdrew versions 2, 3; latest is now 1" in result.output
    assert weights.versions() == [0, 1] and weights.latest() == 1
    assert ahead.poll() == 1  # its version 3 is gone: back to the store's latest through the keyframe
    assert bit_identical(ahead.state, behind.state)

    repaired = FakeTrainer(seed=7)
    result = runner.invoke(app, ["publish", store, checkpoint(tmp_path / "fix.safetensors", repaired.step()), "--full"])
    assert result.exit_code == 0, result.output
    assert "published version 2 (full)" in result.output
    result = runner.invoke(app, ["publish", store, checkpoint(tmp_path / "next.safetensors", repaired.step())])
    assert "published version 3 (delta)" in result.output
    assert weights.manifest(3).base_manifest == weights.manifest(2).digest

    for subscriber in (behind, stale_2, ahead):
        assert subscriber.poll() == 3, subscriber.name
        assert bit_identical(subscriber.state, published(repaired.state)), subscriber.name
    assert 2 not in behind.rejected  # tried again once published again, and taken

    # The trainer that published the withdrawn chain notices and starts a keyframe after the repair.
    manifest = publisher.publish(trainer.step())
    assert (manifest.version, manifest.kind) == (4, "full")
    assert behind.poll() == 4 and bit_identical(behind.state, published(trainer.state))


def test_a_repair_while_a_delta_uploads_makes_that_publish_a_keyframe(weights, config, trainer, monkeypatch):
    publisher = Publisher(weights, config)
    for _ in range(2):
        publisher.publish(trainer.step())
    put_chunk, fixed = weights.put_chunk, FakeTrainer(seed=7)

    def repair_first(key, blob):  # `sync withdraw --from 1`, then `sync publish --full`: a new version 1
        monkeypatch.setattr(weights, "put_chunk", put_chunk)
        weights.withdraw(1)
        Publisher(weights, config).publish(fixed.step(), full=True)
        return put_chunk(key, blob)

    monkeypatch.setattr(weights, "put_chunk", repair_first)
    manifest = publisher.publish(trainer.step())  # coded as a delta on the withdrawn version 1
    assert (manifest.version, manifest.kind) == (2, "full") and weights.verify() == {}
    assert weights.objects.list("versions/0000000002/") == sorted([*(c.key for c in manifest.chunks), manifest_key(2)])
    subscriber = Subscriber(weights, config)
    assert subscriber.poll() == 2 and bit_identical(subscriber.state, published(trainer.state))


def test_a_delta_created_on_a_base_withdrawn_that_moment_is_rejected_until_the_next_keyframe(
    weights, config, trainer, monkeypatch
):
    publisher = Publisher(weights, config)
    for _ in range(2):
        publisher.publish(trainer.step())
    publish, fixed = weights.publish, FakeTrainer(seed=7)

    def repair_first(manifest):  # the repair lands between the publisher's last check and its manifest
        monkeypatch.setattr(weights, "publish", publish)
        weights.withdraw(1)
        Publisher(weights, config).publish(fixed.step(), full=True)
        publish(manifest)

    monkeypatch.setattr(weights, "publish", repair_first)
    assert publisher.publish(trainer.step()).kind == "delta"  # version 2, on the withdrawn version 1
    assert weights.verify() == {2: "a delta on a withdrawn publish of version 1"}
    subscriber = Subscriber(weights, config)
    for _ in range(2):  # re-synced once, then rejected: it stays on the repaired version 1
        assert subscriber.poll() == 1 and "continues another publish of version 1" in subscriber.rejected[2]
    assert subscriber.blocked().startswith("cannot take weight version 2: version 2 was rejected")
    assert bit_identical(subscriber.state, published(fixed.state))
    manifest = publisher.publish(trainer.step())  # the publisher noticed: no delta on that chain
    assert (manifest.version, manifest.kind) == (3, "full")
    assert subscriber.poll() == 3 and bit_identical(subscriber.state, published(trainer.state))


@pytest.fixture(params=["local", "s3"])
def any_weights(request, weights, config) -> WeightStore:
    """The tests' weight store, or one on S3 (moto)."""
    if request.param == "local":
        return weights
    endpoint = request.getfixturevalue("s3_endpoint")
    return WeightStore.open(
        config.model_copy(update={"store": f"s3://whetstone/{uuid.uuid4().hex}", "endpoint_url": endpoint})
    )


def test_a_subscriber_holding_a_version_published_again_does_not_apply_the_new_chain_on_it(
    any_weights, config, trainer
):
    weights = any_weights
    publisher = Publisher(weights, config)
    for _ in range(3):
        publisher.publish(trainer.step())
    holder = Subscriber(weights, config)
    assert holder.poll() == 2
    weights.withdraw(2)
    other = FakeTrainer(seed=3)
    again = Publisher(weights, config)
    assert again.resume() == 1
    again.publish(other.step())  # version 2 again, a delta on 1 this time
    again.publish(other.step())  # version 3, a delta on the new version 2
    assert weights.manifest(2).digest != holder._held_digest
    assert holder.poll() == 3 and not holder.rejected
    assert bit_identical(holder.state, published(other.state))


def test_publish_on_a_store_whose_latest_cannot_be_read_publishes_a_keyframe_after_it(
    weights, config, trainer, tmp_path
):
    store = str(weights.objects.root)
    publisher = Publisher(weights, config)
    for _ in range(3):
        publisher.publish(trainer.step())
    corrupt(weights, weights.manifest(2).chunks[0].key, "truncate")
    result = runner.invoke(app, ["publish", store, checkpoint(tmp_path / "c.safetensors", trainer.step()), "--full"])
    assert result.exit_code == 0, result.output
    assert "published version 3 (full)" in result.output and "version 2 cannot be rebuilt" in result.output


def test_withdraw_records_itself_moves_the_pointer_then_manifests_newest_first_then_chunks(tmp_path, config, trainer):
    class Recording(LocalStore):
        def __init__(self, root):
            super().__init__(root)
            self.log = []

        def put(self, key, data):
            self.log.append(("put", key))
            super().put(key, data)

        def delete(self, key):
            self.log.append(("delete", key))
            super().delete(key)

    objects = Recording(tmp_path / "weights")
    weights = WeightStore(objects)
    publisher = Publisher(weights, config)
    for _ in range(4):
        publisher.publish(trainer.step())
    objects.log.clear()
    assert weights.withdraw(2) == [2, 3]
    assert objects.log[:2] == [("put", "withdrawal.json"), ("put", "latest.json")]
    assert json.loads(objects.get("latest.json")) == {"version": 1, "manifest": weights.manifest(1).digest}
    assert objects.log[2:4] == [
        ("delete", "versions/0000000003/manifest.json"),
        ("delete", "versions/0000000002/manifest.json"),
    ]
    assert all(key.endswith(".bin") or key.endswith("manifest.json") for _, key in objects.log[4:-1])
    assert objects.log[-1] == ("delete", "withdrawal.json") and weights.withdrawal() is None
    assert objects.list("versions/0000000002/") == objects.list("versions/0000000003/") == []


def test_withdrawing_everything_empties_the_store_and_numbering_starts_again(weights, config, trainer):
    publisher = Publisher(weights, config)
    for _ in range(2):
        publisher.publish(trainer.step())
    holder = Subscriber(weights, config)
    holder.poll()
    assert weights.withdraw(0) == [0, 1] and weights.latest() is None
    assert holder.poll() is None  # nothing to re-sync to: it forgets its version, keeps its weights
    manifest = publisher.publish(trainer.step())
    assert (manifest.version, manifest.kind) == (0, "full")
    assert holder.poll() == 0 and bit_identical(holder.state, published(trainer.state))


def test_withdraw_names_what_it_cannot_do(weights, config, trainer):
    Publisher(weights, config).publish(trainer.step())
    result = runner.invoke(app, ["withdraw", str(weights.objects.root), "--from", "5"])
    assert result.exit_code != 0 and "no version 5 or newer" in str(result.exception)


@pytest.mark.parametrize(
    "command", [["inspect"], ["inspect", "--verify"], ["watch", "--timeout", "0"], ["withdraw", "--from", "0"]]
)
def test_commands_that_read_refuse_a_store_that_does_not_exist(tmp_path, command):
    missing = tmp_path / "wieghts"
    result = runner.invoke(app, [command[0], str(missing), *command[1:]])
    assert result.exit_code != 0 and isinstance(result.exception, WhetstoneError)
    assert f"no store at {missing}: the directory does not exist" in str(result.exception)
    assert not missing.exists()


def test_watch_until_a_version_that_does_not_come_fails_after_the_timeout(weights, config, trainer):
    publisher = Publisher(weights, config)
    for _ in range(2):
        publisher.publish(trainer.step())
    result = runner.invoke(
        app, ["watch", str(weights.objects.root), "--until", "5", "--timeout", "0.2", "--poll-interval", "0.05"]
    )
    assert result.exit_code != 0
    assert "version 5 not reached within 0.2 s: holding 1, the store's latest is 1" in str(result.exception)
    corrupt(weights, publisher.publish(trainer.step()).chunks[0].key, "flip")
    result = runner.invoke(
        app, ["watch", str(weights.objects.root), "--until", "2", "--timeout", "0.2", "--poll-interval", "0.05"]
    )
    assert "cannot take weight version 2: version 2 was rejected" in str(result.exception)


class Dying(LocalStore):
    """A local store whose `dies_at`-th write or delete from the moment it is armed raises: the
    process doing them died there."""

    dies_at: int | None = None

    def _step(self) -> None:
        if self.dies_at is not None:
            self.dies_at -= 1
            if self.dies_at == 0:
                self.dies_at = None
                raise RuntimeError("killed")

    def put(self, key, data):
        self._step()
        super().put(key, data)

    def delete(self, key):
        self._step()
        super().delete(key)


def test_readers_and_a_resuming_publisher_never_see_versions_being_withdrawn(weights, config, trainer):
    publisher = Publisher(weights, config)
    for _ in range(5):
        publisher.publish(trainer.step())
    holder = Subscriber(weights, config)
    assert holder.poll() == 4
    seen, resumed, busy = [], [], False
    delete = weights.objects.delete

    def watched_delete(key):  # what readers and a publisher restarted now see, at every delete
        nonlocal busy
        if not busy:
            busy = True
            try:
                seen.append((weights.head().version, weights.latest(), Subscriber(weights, config).try_poll()))
                if key.endswith("manifest.json") and not resumed:
                    resumed.append(Publisher(weights, config).resume())
            finally:
                busy = False
        delete(key)

    weights.objects.delete = watched_delete
    assert weights.withdraw(2) == [2, 3, 4]
    assert seen and set(seen) == {(1, 1, 1)} and resumed == [1]
    assert weights.versions() == [0, 1] and weights.withdrawal() is None and holder.poll() == 1


@pytest.mark.parametrize("after", ["a restart", "the next publish"])
def test_a_withdraw_that_dies_anywhere_is_finished_by_the_publisher_never_undone(tmp_path, config, trainer, after):
    template = Publisher(WeightStore(LocalStore(tmp_path / "template")), config)
    for _ in range(5):  # versions 0..4, copied for each try
        template.publish(trainer.step())
    died_at = 0
    while True:  # the withdraw dies at its 1st write or delete, then at its 2nd, ... until it completes
        died_at += 1
        shutil.copytree(tmp_path / "template", tmp_path / str(died_at))
        objects, stepped = Dying(tmp_path / str(died_at)), copy.deepcopy(trainer)
        weights = WeightStore(objects)
        running = Publisher(weights, config)
        assert running.resume() == 4  # up before the withdraw, with version 4 to build on
        objects.dies_at = died_at
        try:
            weights.withdraw(2)
        except RuntimeError:
            pass
        else:
            break
        started = died_at > 1  # the record is its first write: dying there, nothing was withdrawn
        assert weights.head().version == (1 if died_at > 2 else 4), died_at  # the pointer moves 2nd
        publisher = running
        if after == "a restart":
            assert Publisher(weights, config).resume() == (1 if started else 4), died_at
            assert weights.head().version == (1 if started else 4), died_at
            publisher = Publisher(weights, config)
            publisher.resume()
        manifest = publisher.publish(stepped.step())
        # restarted, it continues the chain at 1; running, it finds its version 4 gone: a keyframe
        kind = "delta" if started and after == "a restart" else "full"  # 5 is a keyframe by interval
        assert (manifest.version, manifest.kind) == (2 if started else 5, kind), died_at
        assert weights.versions() == ([0, 1, 2] if started else [0, 1, 2, 3, 4, 5]), died_at
        assert weights.head() == (manifest.version, manifest.digest), died_at
        assert not objects.exists("withdrawal.json"), died_at
        follower = Subscriber(weights, config)
        assert follower.poll() == manifest.version and bit_identical(follower.state, published(stepped.state))
    assert died_at > 10 and weights.versions() == [0, 1] and not objects.exists("withdrawal.json")


def test_a_withdraw_finishes_one_from_an_older_version_that_did_not_complete(tmp_path, config, trainer):
    objects = Dying(tmp_path / "weights")
    weights = WeightStore(objects)
    publisher = Publisher(weights, config)
    for _ in range(5):
        publisher.publish(trainer.step())
    objects.dies_at = 3  # after the record and the pointer: versions 2..4 withdrawn as readers go
    with pytest.raises(RuntimeError):
        weights.withdraw(2)
    assert weights.head().version == 1 and weights.withdrawal() == 2
    result = runner.invoke(app, ["inspect", str(objects.root)])
    assert "a withdrawal of versions from 2 on is running or did not complete" in result.output
    assert weights.withdraw(4) == [2, 3, 4] and weights.head().version == 1 and weights.withdrawal() is None


def test_a_publisher_finishing_a_withdrawal_that_another_process_completes_leaves_the_repair_alone(
    tmp_path, config, trainer
):
    class Pausing(LocalStore):
        """Pauses at its first chunk delete: the trainer's finishing is slow (GBs of chunks)."""

        armed = False
        paused, go = threading.Event(), threading.Event()

        def delete(self, key):
            if self.armed and key.endswith(".bin"):
                self.armed = False
                self.paused.set()
                assert self.go.wait(30)
            super().delete(key)

    class Operator(LocalStore):
        """Once its withdraw has recorded itself and moved the pointer, the trainer publishes."""

        def put(self, key, data):
            super().put(key, data)
            if key == "latest.json" and not running.is_alive():
                running.start()
                assert trainer_objects.paused.wait(30)  # the trainer is finishing the withdrawal

    trainer_objects = Pausing(tmp_path / "weights")
    weights = WeightStore(trainer_objects)
    publisher = Publisher(weights, config.model_copy(update={"keyframe_interval": 50}))
    for _ in range(7):
        publisher.publish(trainer.step())  # versions 0..6, a chain of deltas
    published_by_trainer = []
    running = threading.Thread(target=lambda: published_by_trainer.append(publisher.publish(trainer.step())))
    trainer_objects.armed = True

    operator = WeightStore(Operator(tmp_path / "weights"))  # `sync withdraw --from 5`, another process
    assert operator.withdraw(5) == [5, 6] and operator.withdrawal() is None
    fixed = FakeTrainer(seed=9)
    repair = Publisher(operator, config)
    assert repair.resume() == 4
    manifest = repair.publish(fixed.step(), full=True)  # then `sync publish --full`: version 5 again
    assert (manifest.version, manifest.kind) == (5, "full")
    trainer_objects.go.set()
    running.join(30)

    (mine,) = published_by_trainer  # its version 6 was withdrawn: a keyframe after the repair
    assert (mine.version, mine.kind) == (6, "full")
    assert weights.versions() == [5, 6] and weights.manifest_digest(5) == manifest.digest  # two keyframes kept
    assert weights.head() == (6, mine.digest) and weights.withdrawal() is None and weights.verify() == {}
    assert trainer_objects.list("versions/0000000005/") == sorted([*(c.key for c in manifest.chunks), manifest_key(5)])
    follower = Subscriber(weights, config)
    assert follower.poll() == 6 and bit_identical(follower.state, published(trainer.state))


class DiesAtAChunk(LocalStore):
    """A local store whose process dies at its first chunk delete once armed."""

    armed = False

    def delete(self, key):
        if self.armed and key.endswith(".bin"):
            self.armed = False
            raise RuntimeError("killed")
        super().delete(key)


@pytest.mark.parametrize("finisher", ["sync withdraw", "a restart"])
def test_a_withdraw_that_died_among_the_chunks_is_finished_and_leaves_no_chunk(tmp_path, config, trainer, finisher):
    objects = DiesAtAChunk(tmp_path / "weights")
    weights = WeightStore(objects)
    publisher = Publisher(weights, config)
    for _ in range(5):
        publisher.publish(trainer.step())
    objects.armed = True
    with pytest.raises(RuntimeError):
        weights.withdraw(2)
    assert weights.versions() == [0, 1] and weights.withdrawal() == 2  # every manifest gone, chunks left
    assert objects.list("versions/0000000002/")
    store = str(objects.root)
    if finisher == "sync withdraw":
        result = runner.invoke(app, ["inspect", store])
        assert f"`whetstone sync withdraw {store} --from 2`" in result.output
        result = runner.invoke(app, ["withdraw", store, "--from", "2"])
        assert result.exit_code == 0, result.output
        assert "withdrew versions 2, 3, 4; latest is now 1" in result.output
    else:
        assert Publisher(weights, config).resume() == 1
    assert weights.withdrawal() is None and weights.head().version == 1
    assert all(key.startswith(("versions/0000000000/", "versions/0000000001/")) for key in objects.list("versions/"))
