"""Tensor-parallel equivalence on spawned gloo ranks, and process-group setup from torchrun's env."""

from __future__ import annotations

import pytest
import torch

import _dist_helpers as h
import _distributed_workers as dw
from tp_replayssm.tp import distributed


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("world", "H", "HV", "L", "cache", "tol_ref", "tol_oracle"),
    [
        # H = HV, q/k heads split; bf16 rings. The stored ring entries are rounded to bf16 (in the pre-decayed
        # layout other values than the reference's sglang-layout entries; on the GPU the kernel's fp32 sums run in
        # another order), so the tolerance against the reference is that of the rounding, not 1e-6.
        (2, 4, 4, 2, "bfloat16", 1e-2, 2e-2),
        (4, 2, 8, 3, "float32", 1e-5, 1e-4),  # H < tp: each q/k head replicated on 2 ranks; fp32 rings
    ],
    ids=["tp2-H4-HV4", "tp4-H2-HV8"],
)
def test_tp_equivalence(tmp_path, world, H, HV, L, cache, tol_ref, tol_oracle) -> None:  # noqa: ANN001
    """Each rank's pool in both ring layouts (one spawn): the gathered outputs equal the single-rank reference and
    the float64 recurrence."""
    by_layout = h.run_ranks(dw.tp_equivalence, world, tmp_path, H, HV, L, 3, cache, timeout_s=220)
    assert all(sorted(r) == ["predecayed", "sglang"] for r in by_layout)
    for layout in ("sglang", "predecayed"):
        results = [r[layout] for r in by_layout]
        r0 = results[0]
        for r in results:  # every rank gathered the same outputs and ran the same reference
            assert r["err_ref"] == r0["err_ref"] and r["err_oracle"] == r0["err_oracle"]
            assert r["padding_zero"] and r["cursors_ok"]
        assert r0["err_ref"] < tol_ref, (layout, r0)
        assert r0["err_oracle"] < tol_oracle, (layout, r0)
        # the k ring holds one key per local q/k head (sglang) or per local value head (pre-decayed)
        assert r0["k_cache"][2] == (len(r0["q_heads"]) if layout == "sglang" else len(r0["v_heads"])), (layout, r0)
        # the sharding rule as the pool applied it
        assert [r["v_heads"] for r in results] == [list(range(t * HV // world, (t + 1) * HV // world))
                                                   for t in range(world)]
        if H % world == 0:
            assert [r["q_heads"] for r in results] == [list(range(t * H // world, (t + 1) * H // world))
                                                       for t in range(world)]
        else:
            assert [r["q_heads"] for r in results] == [[t * H // world] for t in range(world)]


@pytest.mark.timeout(120)
def test_init_uses_rank_not_local_rank(tmp_path) -> None:  # noqa: ANN001
    """Every rank has LOCAL_RANK=0 (one process per node): the global ranks still come from RANK."""
    infos = h.run_ranks(dw.dist_env, 2, tmp_path, one_per_node=True)
    assert [i["rank"] for i in infos] == [0, 1] and [i["dist_rank"] for i in infos] == [0, 1]
    assert [i["local_rank"] for i in infos] == [0, 0]
    for i in infos:
        assert i["world"] == 2 and i["backend"] == "gloo" and i["device"] == "cpu"
        assert i["same"] and i["inner_same"], "init_distributed is not idempotent"
        assert i["sum"] == 1.0
        assert not i["initialized_after"], "distributed_session did not tear the group down"


def _clear_env(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_missing_local_rank_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_env(monkeypatch, RANK="0", WORLD_SIZE="1")
    with pytest.raises(distributed.DistributedInitError, match="LOCAL_RANK is not set.*torchrun"):
        distributed.init_distributed("cpu")
    assert not torch.distributed.is_initialized()


def test_bad_env_values(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_env(monkeypatch, RANK="2", WORLD_SIZE="2", LOCAL_RANK="0")
    with pytest.raises(distributed.DistributedInitError, match=r"RANK=2 not in \[0, WORLD_SIZE=2\)"):
        distributed.init_distributed("cpu")
    _clear_env(monkeypatch, RANK="0", WORLD_SIZE="x", LOCAL_RANK="0")
    with pytest.raises(distributed.DistributedInitError, match="WORLD_SIZE='x' is not an integer"):
        distributed.init_distributed("cpu")
    assert not torch.distributed.is_initialized()


def test_local_rank_beyond_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(distributed.DistributedInitError, match="LOCAL_RANK=2 but only 2 CUDA device"):
        distributed.rank_device("cuda", 2)
    assert distributed.rank_device("cuda", 1) == torch.device("cuda", 1)
    assert distributed.rank_device("cpu", 7) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_requested_without_cuda() -> None:
    with pytest.raises(distributed.DistributedInitError, match=r"device 'cuda' requested but "
                                                               r"torch\.cuda\.is_available\(\) is False"):
        distributed.rank_device("cuda", 0)
