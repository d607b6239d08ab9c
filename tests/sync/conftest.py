import pytest
import torch

from whetstone.store import LocalStore
from whetstone.sync import SyncConfig, WeightStore


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


@pytest.fixture
def weights(tmp_path) -> WeightStore:
    return WeightStore(LocalStore(tmp_path / "weights"))


@pytest.fixture
def config() -> SyncConfig:
    # Small chunks so that tensors span chunks and chunks hold several tensors; keyframes by
    # interval only (the chain budget has its own test).
    return SyncConfig(
        chunk_elements=700, keyframe_interval=5, chain_budget=100.0, keep_keyframes=2, poll_interval=0.01, workers=2
    )


class FakeTrainer:
    """fp32 master weights moved by small random AdamW-like steps (sign of a random gradient
    times lr), so that, as in RL, most published bf16 values do not change from step to step."""

    def __init__(self, seed: int = 0, lr: float = 1e-5):
        self.generator = torch.Generator().manual_seed(seed)
        self.lr = lr
        self.state = {
            "embed.weight": torch.randn(40, 16, generator=self.generator),
            "layer.0.norm.weight": torch.ones(16),
            "layer.0.mlp.weight": torch.randn(32, 16, generator=self.generator) * 0.05,
            "step": torch.zeros((), dtype=torch.int64),
        }

    def step(self) -> dict[str, torch.Tensor]:
        for tensor in self.state.values():
            if tensor.is_floating_point():
                tensor -= self.lr * torch.randn(tensor.shape, generator=self.generator).sign()
        self.state["step"] += 1
        return self.state


@pytest.fixture
def trainer() -> FakeTrainer:
    return FakeTrainer()


def published(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.bfloat16() if v.is_floating_point() else v.clone() for k, v in state.items()}


def bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    from whetstone.sync.bits import int_view

    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and (int_view(a[k]) == int_view(b[k])).all() for k in a
    )


@pytest.fixture(scope="session")
def s3_endpoint():
    from whetstone.store.moto import local_s3

    with local_s3("whetstone") as endpoint:
        yield endpoint
