"""Where the roles of `whetstone run` compute: each server's device, and the share of a GPU's
memory each role may allocate where roles share one.

On one GPU the trainer and the servers run side by side, each in its own process with its own
caching allocator; without a cap, whichever allocates first may hold memory the other needs.
Each role's process gets its share through `utils.processes.GPU_MEMORY_ENV`
(`torch.cuda.set_per_process_memory_fraction`, applied as the role starts).
"""

from __future__ import annotations

import torch

from whetstone.run.config import PlacementConfig
from whetstone.utils.device import resolve_device


def server_device(placement: PlacementConfig, index: int) -> str:
    """The `engine.device` of server `index`."""
    return placement.server_devices[index % len(placement.server_devices)]


def role_device(name: str) -> torch.device:
    """The device a role's process computes on for device `name`: `resolve_device` as that new
    process resolves it, `auto` and `cuda` on its current CUDA device, cuda:0. Not this process's
    current device, which mid-training here on `cuda:N` left at cuda:N."""
    device = resolve_device(name)
    return torch.device("cuda", 0) if device.type == "cuda" and name in ("auto", "cuda") else device


def gpu_memory_shares(placement: PlacementConfig, servers: int) -> dict[str, tuple[torch.device, float]]:
    """`split_gpu_memory` for this machine: the placement's devices as the roles' processes
    resolve them (`role_device`; `auto`: CUDA when present)."""
    trainer = role_device(placement.trainer_device)
    return split_gpu_memory(
        trainer,
        [role_device(server_device(placement, index)) for index in range(servers)],
        placement.trainer_memory_fraction,
    )


def split_gpu_memory(
    trainer: torch.device, servers: list[torch.device], trainer_fraction: float
) -> dict[str, tuple[torch.device, float]]:
    """Role name (`trainer`, `serve-<i>`) -> (its GPU, the share of that GPU's memory it may use),
    for the roles that share a GPU: the trainer takes `trainer_fraction` of a GPU it shares with
    servers, and the servers on a GPU split what is left equally. Roles alone on their GPU, and
    roles on the CPU, are absent (no cap)."""
    on_gpu: dict[torch.device, list[str]] = {}
    for index, device in enumerate(servers):
        if device.type == "cuda":
            on_gpu.setdefault(device, []).append(f"serve-{index}")
    shares: dict[str, tuple[torch.device, float]] = {}
    for device, names in on_gpu.items():
        left = 1.0
        if trainer == device:
            shares["trainer"] = (device, trainer_fraction)
            left -= trainer_fraction
        if len(names) > 1 or left < 1.0:
            shares.update({name: (device, left / len(names)) for name in names})
    return shares
