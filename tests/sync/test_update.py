import pytest
import torch

from whetstone.errors import WhetstoneError
from whetstone.sync import TensorUpdate, WeightUpdate, apply_update, merge_updates


def sparse(indices, values, shape, dtype=torch.bfloat16):
    return TensorUpdate(torch.tensor(values, dtype=dtype), torch.tensor(indices), shape)


def test_apply_overwrites_in_place_without_replacing_tensors():
    weight = torch.zeros(2, 3, dtype=torch.bfloat16)
    state = {"w": weight}
    apply_update(state, WeightUpdate(1, 0, {"w": sparse([1, 5], [1.5, -2.0], (2, 3))}))
    assert state["w"] is weight
    assert weight.tolist() == [[0, 1.5, 0], [0, 0, -2.0]]


def test_apply_converts_to_the_engine_dtype_exactly():
    state = {"w": torch.zeros(4, dtype=torch.float32)}
    value = torch.tensor([1.0078125], dtype=torch.bfloat16)  # exactly representable in fp32
    apply_update(state, WeightUpdate(1, 0, {"w": TensorUpdate(value, torch.tensor([2]), (4,))}))
    assert state["w"][2].item() == 1.0078125


def test_apply_whole_tensors_new_tensors_and_removals():
    transposed = torch.zeros(2, 2).t()  # flat indices are in logical (row-major) order
    state = {"w": torch.zeros(2), "gone": torch.ones(1), "t": transposed}
    update = WeightUpdate(
        3,
        None,
        {
            "w": TensorUpdate(torch.tensor([7.0, 8.0]), None, (2,)),
            "new": TensorUpdate(torch.tensor([1.0, 2.0, 3.0]), None, (3,)),
            "t": sparse([1], [5.0], (2, 2), torch.float32),  # a non-contiguous target
        },
        removed=["gone"],
    )
    apply_update(state, update)
    assert state["w"].tolist() == [7.0, 8.0] and state["new"].tolist() == [1.0, 2.0, 3.0]
    assert "gone" not in state
    assert state["t"] is transposed and transposed.tolist() == [[0.0, 5.0], [0.0, 0.0]]


def test_merged_updates_equal_updates_applied_in_order():
    torch.manual_seed(0)
    shape = (50,)
    updates = [WeightUpdate(0, None, {"w": TensorUpdate(torch.randn(50), None, shape)})]
    for version in range(1, 6):
        indices = torch.randint(0, 50, (10,)).unique()
        updates.append(
            WeightUpdate(version, version - 1, {"w": TensorUpdate(torch.randn(len(indices)), indices, shape)})
        )
    one_by_one = {}
    for update in updates:
        apply_update(one_by_one, update)
    for start in (0, 1):  # merged from a full version, and merged deltas only
        merged_state = {} if start == 0 else {"w": updates[0].tensors["w"].values.clone()}
        apply_update(merged_state, merge_updates(updates[start:]))
        assert torch.equal(merged_state["w"], one_by_one["w"])


@pytest.mark.gpu
def test_apply_writes_host_updates_into_gpu_weights():
    weight = torch.zeros(2, 3, device="cuda")
    state = {"w": weight, "b": torch.zeros(3, device="cuda").expand(2, 3).contiguous().t()}  # one not contiguous
    update = WeightUpdate(1, 0, {"w": sparse([1, 5], [1.5, -2.0], (2, 3)), "b": sparse([0], [3.0], (3, 2))})
    apply_update(state, update)
    assert state["w"] is weight and weight.tolist() == [[0, 1.5, 0], [0, 0, -2.0]]
    assert state["b"].is_cuda and state["b"].tolist() == [[3.0, 0], [0, 0], [0, 0]]


def test_an_update_that_does_not_fit_the_weights_writes_nothing():
    """A delta on a tensor held in another shape (or not held) is refused before the tensors
    listed ahead of it are written: the weights stay as they were, whole."""
    state = {"a": torch.zeros(4), "b": torch.zeros(2, 3)}
    update = WeightUpdate(
        5, 4, {"a": sparse([0], [1.0], (4,), torch.float32), "b": sparse([0], [1.0], (3, 2), torch.float32)}
    )
    with pytest.raises(
        WhetstoneError, match=r"update 5 changes tensor 'b' of shape \(3, 2\), but the weights hold \(2, 3\)"
    ):
        apply_update(state, update)
    update.tensors["b"] = sparse([0], [1.0], (2, 3), torch.float32)
    update.tensors["c"] = sparse([0], [1.0], (2,), torch.float32)
    with pytest.raises(WhetstoneError, match="tensor 'c' of shape \\(2,\\), but the weights hold no such tensor"):
        apply_update(state, update)
    del update.tensors["c"]
    update.tensors["d"] = TensorUpdate(torch.ones(6), None, (-2, -3))  # a whole tensor of a shape none can have
    with pytest.raises(WhetstoneError, match=r"update 5 carries 6 values for tensor 'd' of shape \(-2, -3\)"):
        apply_update(state, update)
    assert not state["a"].any() and not state["b"].any() and "d" not in state
