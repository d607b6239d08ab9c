"""Bad input from the store or the command line: a clear error naming what is wrong, or a rejected
version, never a traceback of another type, a wiped store or a mirror stuck for good."""

import json
import struct

import pytest
import zstandard
from typer.testing import CliRunner

from tests.sync.test_bad_versions import held_after, replace_chunk
from whetstone.errors import WhetstoneError
from whetstone.store import LocalStore
from whetstone.sync import Publisher, Subscriber, WeightStore
from whetstone.sync.chunks import MAGIC
from whetstone.sync.cli import app
from whetstone.sync.manifest import LATEST_KEY, WITHDRAWAL_KEY

runner = CliRunner()

NOT_VERSION_NUMBERS = ["1e400", "Infinity", "-3", "2.7", "true", '"5"', "null"]


@pytest.mark.parametrize("number", NOT_VERSION_NUMBERS)
def test_a_pointer_whose_version_is_no_version_number_is_an_error_naming_it(weights, number):
    """JSON reads 1e400 as infinity, which `int` refuses with an OverflowError; a negative, a
    fraction or a boolean would otherwise be taken as some other version."""
    weights.objects.put(LATEST_KEY, f'{{"version": {number}}}'.encode())
    with pytest.raises(WhetstoneError, match=f"{LATEST_KEY} in .* is not"):
        weights.head()


@pytest.mark.parametrize("number", NOT_VERSION_NUMBERS)
def test_a_withdrawal_record_whose_first_version_is_no_version_number_is_an_error_naming_it(weights, number):
    weights.objects.put(WITHDRAWAL_KEY, f'{{"from": {number}}}'.encode())
    with pytest.raises(WhetstoneError, match=f"{WITHDRAWAL_KEY} in .* is not"):
        weights.withdrawal()


def test_withdraw_from_a_negative_version_is_refused_and_withdraws_nothing(weights, config, trainer):
    """`--from -1` is no "the newest version": it would withdraw every version in the store."""
    publisher = Publisher(weights, config)
    for _ in range(3):
        publisher.publish(trainer.step())
    result = runner.invoke(app, ["withdraw", str(weights.objects.root), "--from", "-1"])
    assert result.exit_code != 0 and "--from -1" in str(result.exception)
    assert weights.versions() == [0, 1, 2] and weights.latest() == 2


def test_a_chunk_coding_values_past_its_tensor_is_rejected_before_it_decodes(weights, config, trainer):
    """A whole block's header gives the size it decodes to; one past the manifest's tensor is
    refused before zstd allocates it (2**45 values: a MemoryError that no poll would get past)."""
    publisher, subscriber = Publisher(weights, config), Subscriber(weights, config)
    held_after(publisher, subscriber, trainer, 1)
    publisher.publish(trainer.step())
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(64))
    block = {"segments": [["embed.weight", 0, 1 << 45]], "encoding": "full", "count": 1 << 45, "length": len(frame)}
    head = json.dumps({"blocks": [block]}).encode()
    key = replace_chunk(weights, 1, 0, MAGIC + struct.pack("<I", len(head)) + head + frame)
    assert subscriber.poll() == 0
    assert subscriber.rejected[1].startswith(f"chunk {key}: chunk codes values [0, 35184372088832) of tensor")
    assert "which has 640" in subscriber.rejected[1]
    assert "version 1 was rejected" in subscriber.blocked()


def test_a_mirror_whose_pointer_cannot_be_read_gets_it_written_again(tmp_path, config, trainer):
    """The publisher is the mirror's one writer: an unreadable pointer there (written half by a
    tool that copied the store) is replaced, as in the store itself, not a failure at every publish."""
    config = config.model_copy(update={"mirrors": [str(tmp_path / "mirror")]})
    publisher = Publisher(WeightStore(LocalStore(tmp_path / "weights")), config)
    (mirror,) = publisher.mirrors
    publisher.publish(trainer.step())
    mirror.objects.put(LATEST_KEY, b'{"vers')
    publisher.publish(trainer.step())
    assert mirror.head() == publisher.store.head() and mirror.latest() == 1
