import numpy as np

from whetstone.data.packing import document_positions, document_starts, pack, token_dtype, window_count, windows

EOS = 0


def test_pack_ends_every_document_with_eos():
    stream = pack([[5, 6, 7], [8], [9, 10]], EOS, token_dtype(4096))
    assert stream.tolist() == [5, 6, 7, 0, 8, 0, 9, 10, 0]
    assert stream.dtype == np.uint16 and token_dtype(151_669) == np.uint32


def test_windows_hold_inputs_and_shifted_targets():
    stream = np.arange(11)
    assert window_count(len(stream), seq_len=3) == 3  # the tail [9, 10] cannot complete a 4th window
    rows = windows(stream, np.array([2, 0]), seq_len=3)
    assert rows.tolist() == [[6, 7, 8, 9], [0, 1, 2, 3]]
    assert window_count(3, seq_len=3) == 0


def test_every_document_starts_a_window_the_last_ones_running_on_into_the_first():
    stream = pack([[5, 6, 7], [8], [9, 10]], EOS, token_dtype(4096))  # 5 6 7 0 8 0 9 10 0
    starts = document_starts(stream, EOS, seq_len=4)
    assert starts.tolist() == [0, 4, 6]
    rows = windows(stream, np.array([2, 1, 0]), seq_len=4, starts=starts)
    assert rows.tolist() == [[9, 10, 0, 5, 6], [8, 0, 9, 10, 0], [5, 6, 7, 0, 8]]
    assert document_starts(stream, EOS, seq_len=len(stream)).size == 0  # no window fits the stream


def test_positions_restart_after_each_eos():
    inputs = np.array([[4, 4, 0, 5, 5, 5, 0, 6], [0, 7, 7, 7, 7, 7, 7, 7]])
    positions, documents = document_positions(inputs, EOS)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 0, 1, 2, 3, 4, 5, 6]]
    assert documents.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1, 1, 1]]
