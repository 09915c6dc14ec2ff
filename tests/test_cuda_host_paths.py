"""Host-side CUDA paths that CPU tests otherwise never run, emulated on the CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tp_replayssm import KDAHeads, ReplaySSMStatePool


def test_alloc_and_free_build_no_device_tensor_from_host_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.tensor(list, device=cuda)`` is a blocking copy (cudaStreamSynchronize): alloc and free, documented as
    sync-free (free: "pass a list to avoid that sync"), must not make one. A meta pool stands in for a CUDA one."""
    pool = ReplaySSMStatePool(KDAHeads(1, 2, 16, 16), num_layers=1, num_slots=4, ring_length=4, device="meta")
    real = torch.tensor

    def guarded(data: object, *args: object, **kwargs: object) -> torch.Tensor:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "cpu":
            raise AssertionError(f"torch.tensor(..., device={device}): a synchronous host-to-device copy on CUDA")
        return real(data, *args, **kwargs)

    monkeypatch.setattr(torch, "tensor", guarded)
    ids = pool.alloc(2)
    assert ids.device.type == "meta" and ids.dtype == torch.int32
    pool.free([0, 1])
    assert pool.num_free == 4


def test_shard_to_cpu_non_blocking_keeps_a_completion_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """``shard.to("cpu", non_blocking=True)`` from a CUDA shard is an asynchronous copy into pinned memory: the new
    shard must carry an event, so that ``ready``, ``wait()`` and pickling wait for it (fake CUDA tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    recorded: list[object] = []

    class FakeEvent:
        def record(self, stream: object) -> None:
            recorded.append(stream)

        def query(self) -> bool:
            return False

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    pool = ReplaySSMStatePool(KDAHeads(1, 2, 16, 16), num_layers=1, num_slots=4, ring_length=4, device="cpu")
    shard = pool.export_state(pool.alloc(1).tolist())
    with FakeTensorMode():
        on_gpu = dataclasses.replace(shard, states=torch.empty(shard.states.shape, device="cuda:0"))
        moved = on_gpu.to("cpu", non_blocking=True)
        blocking = on_gpu.to("cpu")
    assert moved.states.device.type == "cpu"
    assert isinstance(moved.copy_done, FakeEvent) and not moved.ready
    assert recorded == ["stream of cuda:0"]
    assert blocking.copy_done is None and blocking.ready
