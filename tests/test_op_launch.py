"""How the decode op reaches its kernel: CPU tensors take the PyTorch path by default, the interpreter backend needs
``TRITON_INTERPRET=1``, the pool's entry point reads the cursor table, the cache row views are cached per tensor,
and the interpreter's shim multiplies bf16 dot operands as values.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tp_replayssm import ops, reference
from tp_replayssm.kernels import args as kernel_args
from tp_replayssm.kernels.launch import run_decode
from tp_replayssm.validation import DecodeCall
from _decode_scenario import record_kernel_args
from _op_helpers import B, HV, K, L, S, V, _refused_and_unwritten, _tensors

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- CPU tensors: the torch path, or the interpreter


@pytest.mark.parametrize("ring_layout", ["sglang", "predecayed"])
def test_op_on_cpu_tensors_takes_the_torch_path_by_default(ring_layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the interpreter backend the op on CPU tensors runs the PyTorch path: bit for bit the reference
    (outputs and every cache; a flush row, an append row, a padding row with a forced flush), and no kernel
    launch."""
    from tp_replayssm.kernels import launch

    monkeypatch.setattr(launch, "launch_decode", lambda *a: pytest.fail("the kernel launched on the torch path"))
    overrides = dict(force_flush=torch.tensor([0, 0, 1], dtype=torch.int32),
                     write_pos=torch.tensor([L - 1, 1, 0], dtype=torch.int32), lower_bound=-5.0)
    if ring_layout == "predecayed":
        overrides["k_cache"] = torch.randn(S, HV, L, K, dtype=torch.bfloat16)
    t = _tensors(**overrides)
    mine = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in t.items()}
    result = ops.replayssm_decode(**mine, ring_layout=ring_layout)
    reference.replayssm_decode(**t, ring_layout=ring_layout)
    assert result[0] is mine["out"] and result[1] is mine["initial_state"]
    for k in ("out", "initial_state", "d_cache", "k_cache", "g_cache"):
        assert torch.equal(mine[k].view(torch.uint8), t[k].view(torch.uint8)), k
    assert (mine["out"][2] == 0).all()  # the padding row


_NO_INTERPRETER_SCRIPT = """
import torch
import triton  # imported without TRITON_INTERPRET
from tp_replayssm import ops
from tp_replayssm.kernels.backend import use_cpu_backend
B, H, HV, K, V, L, S = 2, 1, 2, 16, 16, 3, 3
t = dict(mixed_qkv=torch.randn(B, 2 * H * K + HV * V), a=torch.randn(B, HV * K), b=torch.randn(B, HV),
         A_log=torch.randn(HV), dt_bias=torch.randn(HV * K), scale=None, initial_state=torch.randn(S, HV, V, K),
         d_cache=torch.randn(S, HV, L, V), k_cache=torch.randn(S, H, L, K), g_cache=torch.randn(S, HV, L, K),
         out=torch.full((B, 1, HV, V), 7.0), ssm_state_indices=torch.tensor([0, 2], dtype=torch.int32),
         write_pos=torch.tensor([L - 1, 0], dtype=torch.int32))
before = {k: v.clone() for k, v in t.items() if isinstance(v, torch.Tensor)}
try:
    with use_cpu_backend("interpreter"):
        ops.replayssm_decode(**t)
except ValueError as e:
    unwritten = all(torch.equal(t[k], v) for k, v in before.items())
    print("RESULT", "unwritten" if unwritten else "written", e)
else:
    print("RESULT no error")
"""


@pytest.mark.timeout(120)
def test_interpreter_backend_without_triton_interpret_is_refused() -> None:
    """The interpreter backend needs ``TRITON_INTERPRET=1`` set before triton's import: in a process started without
    it, asking for the interpreter raises a ``ValueError`` naming the variable, before anything is written."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "HELION_INTERPRET", "TP_REPLAYSSM_CPU_BACKEND")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _NO_INTERPRETER_SCRIPT], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=110)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-3000:]
    assert line.startswith("RESULT unwritten ") and "TRITON_INTERPRET=1" in line, line


# ---------------------------------------------------------------- the pool's entry point (cursor table)


def test_cursor_table_entry_matches_row_cursors_bitwise(monkeypatch: pytest.MonkeyPatch, interpreter: None) -> None:
    """``run_decode(..., cursor_table=True)`` (the kernel reads ``cursors[slot]``) == ``replayssm_decode`` with
    ``write_pos = cursors[slots]``: same outputs and caches, bit for bit, flush and padding rows included."""
    gen = torch.Generator().manual_seed(11)
    t = _tensors(ssm_state_indices=torch.tensor([4, -1, 1], dtype=torch.int32),
                 force_flush=torch.tensor([0, 1, 0], dtype=torch.int32))
    for k, v in t.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and k not in ("mixed_qkv", "a", "b"):
            t[k] = (0.1 * torch.randn(v.shape, generator=gen)).to(v.dtype)
    t["out"] = torch.full((B, 1, HV, V), float("nan"), dtype=torch.bfloat16)
    cursors = torch.tensor([0, L - 1, 2, 1, 2, 3], dtype=torch.int32)  # [S + 1]; slot 1 flushes at L-1
    rows = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in t.items()}
    rows["write_pos"] = cursors[rows["ssm_state_indices"].clamp(0, S).long()]
    seen = record_kernel_args(monkeypatch, "cursors_by_slot")
    ops.replayssm_decode(**rows)
    table = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in t.items()}
    table["write_pos"] = cursors.clone()
    run_decode(DecodeCall(**table), ring_layout="sglang", cursor_table=True)
    assert seen == [(False,), (True,)]
    for k in ("out", "initial_state", "d_cache", "k_cache", "g_cache"):
        assert torch.equal(table[k], rows[k]), k
    assert torch.equal(table["write_pos"], cursors)  # read only
    assert not torch.equal(rows["initial_state"], t["initial_state"])  # the flush row did write


def test_cursor_table_of_the_wrong_shape_is_refused_before_anything_is_written() -> None:
    t = _tensors()  # write_pos per row, not the table [S + 1]
    _refused_and_unwritten(lambda **t: run_decode(DecodeCall(**t), ring_layout="sglang", cursor_table=True), t,
                           r"`cursors`.*\[6\].*\[3\]")


def test_cache_row_views_are_cached_per_tensor_and_dropped_with_it() -> None:
    import gc

    big = torch.zeros(2, S, HV, L, V)
    layer = big[1]
    gc.collect()  # entries of earlier tests' dead tensors go now, not in the count below
    first = kernel_args.rows_view(layer)
    assert kernel_args.rows_view(layer) is first  # same tensor object: no new views
    assert first[0].data_ptr() == layer.data_ptr() and first[1] == tuple(layer.stride()[:3])
    n = len(kernel_args._ROWS_VIEWS)
    del layer, first
    gc.collect()
    assert len(kernel_args._ROWS_VIEWS) == n - 1  # the entry died with its tensor
    t = torch.zeros(S, HV, L, V)
    view = kernel_args.rows_view(t)
    t.set_(torch.zeros(S, HV, L, V).untyped_storage(), 0, t.shape, t.stride())  # new data pointer: rebuilt
    assert kernel_args.rows_view(t)[0].data_ptr() == t.data_ptr() != view[0].data_ptr()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim patches the Triton interpreter (CPU runs)")
def test_interpreter_shim_multiplies_bf16_dot_operands_as_values() -> None:
    """Triton 3.9's interpreter stores bf16 as raw uint16 bits and its ``tl.dot`` multiplied those bits as
    integers; after ``install_libdevice_shim`` a bf16 dot with fp32 accumulation equals the exact product
    of the bf16 values (what kernel variants with tensor-core products compute on the GPU)."""
    import triton
    import triton.language as tl

    from tp_replayssm.kernels.interpreter import install_libdevice_shim

    install_libdevice_shim()

    @triton.jit
    def dot16(a_ptr, b_ptr, c_ptr):  # noqa: ANN001, ANN202 - a Triton kernel
        i = tl.arange(0, 16)
        a = tl.load(a_ptr + i[:, None] * 16 + i[None, :])
        b = tl.load(b_ptr + i[:, None] * 16 + i[None, :])
        tl.store(c_ptr + i[:, None] * 16 + i[None, :], tl.dot(a, b, out_dtype=tl.float32))

    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=gen).bfloat16() for _ in range(2))
    c = torch.full((16, 16), float("nan"))
    dot16[(1,)](a, b, c)
    torch.testing.assert_close(c, a.double().matmul(b.double()).float(), rtol=1e-6, atol=1e-5)
