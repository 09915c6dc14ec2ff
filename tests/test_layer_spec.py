"""Speculative decoding through ``tp_replayssm.layers.TPKimiDeltaAttention``: ``layer(hidden [B, T, hidden],
slots, verify=True, parents=...)`` in every layer, then one ``pool.commit``, at tp 1 and 2 (one pool per rank in this
process, partial sums added) and on 2 gloo ranks (the layers all-reduce). Every verify output equals sequential decode
of the same tokens through layers of the same weights (a twin pool, a fork per node) and the float64 layer; after
each commit every layer's state and conv window equal a twin that decoded only the kept tokens (chains and trees,
0..T kept, rows that fold their ring, padding rows); the cursors are the contract's ``base + num_accepted``.
Scenario and runner: tests/_layer_spec_helpers.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import _dist_helpers as dh
import _layer_helpers as lh
import _layer_spec_helpers as sh
import tp_replayssm.pool.spec as pool_spec
from tp_replayssm import SlotError
from tp_replayssm.kernels.backend import use_cpu_backend
from tp_replayssm.layers import KDALayerConfig

# GVA with conv biases and an output-gate bias; no short convolution with the bounded gate
CONFIGS = {
    "gva": KDALayerConfig(64, 2, 8, 16, 16, 16, conv_size=4, conv_bias=True, gate_bias=True),
    "noconv-lb": KDALayerConfig(64, 4, 4, 16, 16, 16, conv_size=0, gate_bias=False, lower_bound=-4.0),
}
TOL = 2e-5  # fp32 against float64 and against the fp32 twin: max abs error over max abs value


def _check(res: dict, tol: float = TOL) -> None:
    assert res["errs"] and max(res["errs"].values()) < tol, res["errs"]
    assert {"verify vs twin", "verify vs plain", "state vs twin", "state vs plain", "decode vs plain"} <= set(
        res["errs"])
    assert res["padding_zero"], "a padding row's verify output is not zero"
    assert res["cursors_ok"], "a cursor after commit is not base + num_accepted"
    assert res["folds"] >= 3, res["folds"]  # rows whose drafts did not fit folded their committed ring


@pytest.mark.parametrize("name,tp,layout", [("gva", 1, "predecayed"), ("gva", 2, "predecayed"),
                                             ("gva", 1, "sglang"), ("noconv-lb", 2, "predecayed")])
def test_layer_verify_matches_sequential_decode(name: str, tp: int, layout: str) -> None:
    """Two layers, three sequences, chain verifies (T = 3) and tree verifies (T = 4) keeping 0..T tokens, with
    decodes between: outputs, states and windows against the twin and the float64 layer after every step."""
    cfg = CONFIGS[name]
    weights = [lh.random_weights(cfg, seed) for seed in (30, 31)]
    prompts, x0, steps = sh.scenario(cfg.hidden_size, 5)
    ranks = [sh.build_rank(cfg, weights, len(prompts), rank=r, tp=tp, ring_layout=layout) for r in range(tp)]
    assert len({tuple(rk.slots) for rk in ranks}) == 1
    _check(sh.run(cfg, weights, ranks, prompts, x0, steps))


@pytest.mark.timeout(240)
def test_layer_verify_gloo(tmp_path: Path) -> None:
    """On 2 gloo ranks each rank's all-reduced verify outputs, its states and windows pass the same checks."""
    cfg = CONFIGS["gva"]
    weights = [lh.random_weights(cfg, seed) for seed in (40, 41)]
    results = dh.run_ranks(sh.gloo_worker, 2, tmp_path, cfg, weights, timeout_s=200)
    for r, res in enumerate(results):
        _check(res)
        assert res["v_heads"] == list(range(4 * r, 4 * r + 4))


def test_verify_arguments() -> None:
    """A malformed verify raises ValueError naming the argument before anything is written; `parents` without
    verify=True, and cu_seqlens / advance / force_flush with it, are refused."""
    cfg = CONFIGS["gva"]
    rk = sh.build_rank(cfg, [lh.random_weights(cfg, 1)], 2, ring_length=4)
    layer, pool = rk.layers[0], rk.pool
    slots = torch.tensor(rk.slots, dtype=torch.int32)
    before = [t.clone() for t in (pool.checkpoint, pool.d_cache, pool.k_cache, pool.g_cache, pool.cursors,
                                  pool.conv_state)]
    x = torch.randn(2, 3, 64)
    chain = torch.tensor([[-1, 0, 1]] * 2, dtype=torch.int32)
    cases = [
        (lambda: layer(torch.randn(2, 64), slots, verify=True), r"`hidden` must be \[B, T, hidden_size\]"),
        (lambda: layer(x.double(), slots, verify=True), "dtype torch.float32"),
        (lambda: layer(x, slots.long(), verify=True), "`slots` must be a 1-D torch.int32"),
        (lambda: layer(x[:1], slots, verify=True), "one id per row"),
        (lambda: layer(torch.randn(2, 4, 64), slots, verify=True), r"ring_length - 1 = 3"),
        (lambda: layer(x, slots, verify=True, parents=chain[:, :2]), "`parents`"),
        (lambda: layer(x, slots, verify=True, parents=chain.long()), "`parents`"),
        (lambda: layer(x[:, 0], slots, parents=chain), "pass verify=True"),
        (lambda: layer(x, slots, torch.tensor([0, 3], dtype=torch.int32), verify=True), "`cu_seqlens` does not"),
        (lambda: layer(x, slots, verify=True, advance=True), "`advance` does not apply"),
        (lambda: layer(x, slots, verify=True, force_flush=slots), "`force_flush` does not apply"),
    ]
    for fn, match in cases:
        with pytest.raises(ValueError, match=match):
            fn()
    for a, b in zip(before, (pool.checkpoint, pool.d_cache, pool.k_cache, pool.g_cache, pool.cursors,
                             pool.conv_state)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="no verify since the last commit"):
        pool.commit(slots, torch.zeros(2, dtype=torch.int32))


def test_commit_zero_keeps_the_state() -> None:
    """A verify then commit(0) leaves every output of a later decode as if the verify had not happened (the drafts
    beyond the cursor are invisible), also when the verify folded the ring."""
    cfg = CONFIGS["gva"]
    weights = [lh.random_weights(cfg, 2)]
    rk = sh.build_rank(cfg, weights, 2, ring_length=4)
    slots = torch.tensor(rk.slots, dtype=torch.int32)
    tslots = torch.tensor(rk.twin_slots, dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):  # cursor 2: T = 3 drafts do not fit, the verify folds
        x = torch.randn(2, 64, generator=g)
        rk.layers[0](x, slots, advance=True)
        rk.twin_layers[0](x, tslots, advance=True)
    rk.layers[0](torch.randn(2, 3, 64, generator=g), slots, verify=True)
    rk.pool.commit(slots, torch.zeros(2, dtype=torch.int32))
    assert rk.pool.cursors[slots.long()].tolist() == [0, 0]
    for _ in range(3):
        x = torch.randn(2, 64, generator=g)
        got, want = rk.layers[0](x, slots, advance=True), rk.twin_layers[0](x, tslots, advance=True)
        assert lh.rel(got, want) < TOL
    assert lh.rel(rk.pool.read_state(0, slots), rk.twin.read_state(0, tslots)) < TOL
    rk.pool.check()


def test_prefill_of_a_slot_between_verify_and_commit_is_refused() -> None:
    """A layer's prefill of a slot in the open verify step raises SlotError (it syncs anyway) before anything is
    written; after the commit the prefill runs."""
    cfg = CONFIGS["gva"]
    rk = sh.build_rank(cfg, [lh.random_weights(cfg, 4)], 2, ring_length=4)
    slots = torch.tensor(rk.slots, dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    rk.layers[0](torch.randn(2, 3, 64, generator=g), slots, verify=True)
    snap = rk.pool.checkpoint.clone(), rk.pool.conv_state.clone(), rk.pool.cursors.clone()
    prompt = torch.randn(5, 64, generator=g)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(SlotError, match=rf"prefill\(layer=0\): slots between a verify and its commit .*"
                                        rf"\[{rk.slots[1]}\]"):
        rk.layers[0](prompt, slots[1:], cu_seqlens=cu)
    assert all(torch.equal(a, b) for a, b in zip(snap, (rk.pool.checkpoint, rk.pool.conv_state, rk.pool.cursors)))
    rk.pool.commit(slots, torch.zeros(2, dtype=torch.int32))
    rk.layers[0](prompt, slots[1:], cu_seqlens=cu)
    rk.pool.check()


# ---- the kernels' path on the CPU ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gva", "noconv-lb"])
def test_verify_hands_the_kernel_contiguous_columns(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``mixed_qkv`` the layer's verify hands the verify launch (post-conv with a short convolution) has
    ``stride(-1) == 1``: the kernel's arguments view its q, k and v columns assuming it (kernels/verify_args.py).
    Chains and trees, with and without the conv."""
    cfg = CONFIGS[name]
    rk = sh.build_rank(cfg, [lh.random_weights(cfg, 3)], 2)
    slots = torch.tensor([rk.slots[0], -1, rk.slots[1]], dtype=torch.int32)
    seen: list[tuple[int, ...]] = []
    run_verify = pool_spec.run_verify

    def recording(call, *args, **kwargs):  # noqa: ANN001, ANN202 - run_verify's own signature
        seen.append(tuple(call.mixed_qkv.stride()))
        return run_verify(call, *args, **kwargs)

    monkeypatch.setattr(pool_spec, "run_verify", recording)
    g = torch.Generator().manual_seed(4)
    for parents in (None, torch.tensor([[-1, 0, 0]] * 3, dtype=torch.int32)):
        rk.layers[0](torch.randn(3, 3, 64, generator=g), slots, verify=True, parents=parents)
        rk.pool.commit(slots, torch.tensor([1, 0, 2], dtype=torch.int32),
                       path=None if parents is None else torch.tensor([[0, 1, 0]] * 3, dtype=torch.int32))
    assert len(seen) == 2 and all(st[-1] == 1 for st in seen), seen


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter cases run on machines without CUDA")
@pytest.mark.timeout(300)
def test_layer_verify_through_the_kernels_matches_the_torch_path() -> None:
    """The layer's verify and commit through the Helion verify, commit and conv kernels (in Triton's interpreter:
    the path CUDA tensors take) equal the PyTorch path: after a prefill, a chain verify (T = 3, the conv continuing
    the committed windows, a padding row) and its commit, then a tree verify whose rows fold, and its commit; every
    output, state, conv window and cursor."""
    cfg = CONFIGS["gva"]
    weights = [lh.random_weights(cfg, 60)]
    g = torch.Generator().manual_seed(61)
    x0, cu = torch.randn(7, 64, generator=g), torch.tensor([0, 4, 7], dtype=torch.int32)
    ranks = {be: sh.build_rank(cfg, weights, 2) for be in ("torch", "interpreter")}
    for rk in ranks.values():
        rk.layers[0](x0, torch.tensor(rk.slots, dtype=torch.int32), cu, advance=True)
    tree = torch.tensor([[-1, 0, 0], [-1, 0, 0], [-1, -1, 1]], dtype=torch.int32)
    kept = torch.tensor([[0, 2, 0], [0, 0, 0], [1, 2, 0]], dtype=torch.int32)  # nodes 0, 2 and 1, 2
    steps = [(None, [3, 0, 2], None), (tree, [2, 0, 2], kept)]
    for parents, accepted, path in steps:  # cursors 0, 0 (the drafts fit), then 3, 2 (both rows fold)
        x = torch.randn(3, 3, 64, generator=g)
        out, state = {}, {}
        for be, rk in ranks.items():
            slots = torch.tensor([rk.slots[0], -1, rk.slots[1]], dtype=torch.int32)
            with use_cpu_backend(be):
                out[be] = rk.layers[0](x, slots, verify=True, parents=parents)
                rk.pool.commit(slots, torch.tensor(accepted, dtype=torch.int32), path=path)
            ids = torch.tensor(rk.slots, dtype=torch.int32)
            state[be] = (rk.pool.read_state(0, ids), rk.pool.read_conv_state(0, ids), rk.pool.cursors.clone())
        assert lh.rel(out["interpreter"], out["torch"]) < TOL, lh.rel(out["interpreter"], out["torch"])
        assert bool((out["interpreter"][1] == 0).all())
        assert lh.rel(state["interpreter"][0], state["torch"][0]) < TOL
        assert torch.equal(state["interpreter"][1], state["torch"][1])
        assert torch.equal(state["interpreter"][2], state["torch"][2])
    assert ranks["torch"].pool.cursors[torch.tensor(ranks["torch"].slots)].tolist() == [2, 2]
    for rk in ranks.values():
        rk.pool.check()


# ---- GPU (the device) -------------------------------------------------------------------------------------------

GPU_TOL = 1e-4  # fp32 on the GPU (other summation orders in the kernels and GEMMs)


@pytest.mark.gpu
def test_gpu_layer_verify_scenario() -> None:
    """fp32 on one GPU: the scenario through the Helion verify and commit kernels (the twin decodes with the decode
    kernel), every check as on the CPU."""
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = CONFIGS["gva"]
    weights = [lh.random_weights(cfg, seed) for seed in (30, 31)]
    prompts, x0, steps = sh.scenario(cfg.hidden_size, 5)
    res = sh.run(cfg, weights, [sh.build_rank(cfg, weights, len(prompts), device=dev)], prompts, x0, steps)
    _check(res, GPU_TOL)


@pytest.mark.gpu
def test_gpu_graph_captured_verify_and_commit() -> None:
    """Two layers' verify (T = 3, a padding row) and the commit captured in one CUDA graph, replayed with new drafts
    and acceptance counts: every output against sequential decode on the twin, and every layer's state and window
    after each commit against the twin that decoded only the kept tokens (ring length 5: rows fold)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg, T = CONFIGS["gva"], 3
    weights = [lh.random_weights(cfg, seed) for seed in (50, 51)]
    rk = sh.build_rank(cfg, weights, 3, device=dev)
    seqs = [0, 1, 2, None]
    slots = torch.tensor([*rk.slots, -1], dtype=torch.int32, device=dev)
    ids, tids = slots[:3], torch.tensor(rk.twin_slots, dtype=torch.int32, device=dev)
    g = torch.Generator().manual_seed(6)
    x0, cu = torch.randn(12, 64, generator=g).to(dev), torch.tensor([0, 4, 5, 12], dtype=torch.int32, device=dev)
    for layers, s in ((rk.layers, ids), (rk.twin_layers, tids)):
        for i, layer in enumerate(layers):
            layer(x0, s, cu, advance=i == len(layers) - 1)
    static_x = torch.zeros(4, T, 64, device=dev)
    static_n = torch.zeros(4, dtype=torch.int32, device=dev)

    def step() -> list[torch.Tensor]:
        ys = [layer(static_x, slots, verify=True) for layer in rk.layers]
        rk.pool.commit(slots, static_n)
        return ys

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles; commit(0) keeps every committed state)
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_ys = step()
    for k in range(6):
        x = torch.randn(4, T, 64, generator=g)
        n = torch.randint(0, T + 1, (4,), generator=g, dtype=torch.int32)
        n[3] = 0
        st = sh.Step("verify", seqs, x, accepted=n.tolist())
        want = sh._twin_nodes(rk, st, torch.float32)
        static_x.copy_(x.to(dev))
        static_n.copy_(n.to(dev))
        graph.replay()
        got = torch.stack([y.double().cpu() for y in static_ys])
        assert lh.rel(got, want) < GPU_TOL, (k, lh.rel(got, want))
        assert bool((got[:, 3] == 0).all())
        sh._twin_keep(rk, st, torch.float32)
        for li in range(2):
            assert lh.rel(rk.pool.read_state(li, ids), rk.twin.read_state(li, tids)) < GPU_TOL, (k, li)
            assert lh.rel(rk.pool.read_conv_state(li, ids), rk.twin.read_conv_state(li, tids)) < GPU_TOL, (k, li)
    rk.pool.check()
    rk.twin.check()
