"""Candidate and leave-one-stage-out variants of the decode kernel, as edits of its source.

Each variant is a list of ``(old, new)`` text replacements applied to ``tp_replayssm/kernel.py`` as it
is now; every ``old`` must occur exactly once, so a variant that no longer fits the kernel fails loudly
instead of timing something else. :func:`materialize` writes the edited module to a file that
``benchmarks/tune_decode.py --kernel NAME=variant:NAME`` and ``benchmarks/kernel_regs.py --kernel
variant:NAME`` load in place of the library kernel (same signature, same argument tuple).

    python benchmarks/experiments/variants.py            # list the variants
    python benchmarks/experiments/variants.py no_scan    # write it, print the file's path
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import importlib.util
import sys
import tempfile
from pathlib import Path
from typing import Any

KERNEL = Path(__file__).resolve().parents[2] / "tp_replayssm" / "kernel.py"

_FORWARD_SCAN = "        after = torch.sum(g_ring, dim=0, keepdim=True) - hl.cumsum(g_ring, 0)"
_REVERSE_SCAN = "        after = hl.cumsum(g_ring, 0, reverse=True) - g_ring  # sum of the valid entries after j"
_KEYS = "            kdec, tot = _decayed_keys(g_ring, k_ring, valid, tiny_batch)  # tiny batches: reverse scan"
_SETTINGS = "_SETTINGS = dict(static_shapes=True, index_dtype=torch.int64)"


@dataclasses.dataclass(frozen=True)
class Variant:
    """``edits`` applied in order; ``timing_only``: the results are wrong by design (a stage left out)."""

    doc: str
    edits: tuple[tuple[str, str], ...]
    timing_only: bool


def _two_buffer_edits() -> tuple[tuple[str, str], ...]:
    """Edits of ``two_buffers``: the chunk loop unrolled by two with its own register buffers ``SA``/``SB``
    (and ``dA``/``dB``), each refilled right after its chunk is reduced, so every load has a whole chunk of
    the other buffer's work to hide behind (the single loop-carried buffer can be refilled only after its
    own chunk has been consumed, which ptxas schedules halfway through the loop body)."""
    text = KERNEL.read_text()
    head = "            for chunk in hl.grid(tv.begin, tv.end, value_chunk):\n"
    tail = "                    hl.store(d_rows, [dr_base + cur * dr_l, rows], delta.to(d_rows.dtype), extra_mask=live)\n"
    a, b = text.index(head), text.index(tail) + len(tail)
    body = text[a + len(head):b]
    first = "                rows = chunk + hl.arange(value_chunk)\n"
    step = "                after_rows = rows + value_chunk\n"
    if body.count(first) != 1 or body.count(step) != 1:
        raise ValueError("variant 'two_buffers': the chunk loop changed (update the variant)")
    half = body.replace(step, "                after_rows = rows + 2 * value_chunk\n")
    part_a = half.replace(first, "                rows = pair + hl.arange(value_chunk)  # VARIANT: buffer A\n")
    part_a = part_a.replace("S_next", "SA").replace("d_next", "dA")
    part_b = half.replace(first, "                rows = pair + value_chunk + hl.arange(value_chunk)  # buffer B\n")
    part_b = part_b.replace("S_next", "SB").replace("d_next", "dB")
    part_a = re.sub(r"\b(after_)?rows\b", r"\1rowsA", part_a)
    part_b = re.sub(r"\b(after_)?rows\b", r"\1rowsB", part_b)
    part_b = re.sub(r"\bback\b", "back_b", part_b)  # a second device loop needs its own index name
    loop = "            for pair in hl.grid(tv.begin, tv.end, 2 * value_chunk):\n" + part_a + part_b
    load_s = ("            S_next = hl.load(state_rows, [st_base + rows * st_v, slice(None)], "
              "extra_mask=live[:, None])\n")
    load_d = ("            d_next = hl.load(d_rows, [dr_base + j * dr_l, rows], "
              "extra_mask=ring_mask[:, None] & live[None, :])\n")
    return (
        (text[a:b], loop),
        (load_s, load_s.replace("S_next", "SA") + "            rows_b = rows + value_chunk\n"
         "            SB = hl.load(state_rows, [st_base + rows_b * st_v, slice(None)], "
         "extra_mask=(rows_b < tv.end)[:, None])\n"),
        (load_d, load_d.replace("d_next", "dA") + "            dB = hl.load(d_rows, [dr_base + j * dr_l, rows_b], "
         "extra_mask=ring_mask[:, None] & (rows_b < tv.end)[None, :])\n"),
    )


VARIANTS: dict[str, Variant] = {
    "no_scan": Variant("the ring gates' suffix sums left out (both scan forms replaced by the gates)", (
        (_FORWARD_SCAN, "        after = g_ring  # VARIANT: no scan"),
        (_REVERSE_SCAN, "        after = g_ring  # VARIANT: no scan"),
    ), True),
    "no_ring_prologue": Variant("the decayed keys set to zero: no ring loads or decays in the prologue", (
        (_KEYS, "            kdec = g_ring * 0.0  # VARIANT: no ring prologue\n            tot = g * 0.0"),
    ), True),
    "no_chunk_ring": Variant("the per-chunk ring term dropped (the ring prologue becomes dead code too)", (
        ("                spk = torch.sum(S0 * ak[None, :], dim=1) + torch.sum(d_ring * wk[:, None], dim=0)\n"
         "                spq = torch.sum(S0 * aq[None, :], dim=1) + torch.sum(d_ring * wq[:, None], dim=0)",
         "                spk = torch.sum(S0 * ak[None, :], dim=1)  # VARIANT: no ring term per chunk\n"
         "                spq = torch.sum(S0 * aq[None, :], dim=1)"),
    ), True),
    "no_replay": Variant("flush rows skip the ring replay", (
        ("                    for back in hl.grid(cur):",
         "                    for back in hl.grid(cur * 0):  # VARIANT: no replay"),
    ), True),
    "reverse_scan": Variant("the batch path's suffix sums as a reverse hl.cumsum (the kernel of 28b41a1)", (
        (_KEYS, "            kdec, tot = _decayed_keys(g_ring, k_ring, valid, True)  # VARIANT: reverse scan always"),
    ), False),
    "forward_scan": Variant("the ring's suffix sums as the forward scan on every path (with --tiny-batch on: whole-ring "
                            "loads without the reverse scan)", (
        (_KEYS, "            kdec, tot = _decayed_keys(g_ring, k_ring, valid, False)  # VARIANT: forward scan always"),
    ), False),
    "dot_suffix_sum": Variant("the batch path's suffix sums as a 3xTF32 tensor-core product with a 0/1 "
                              "upper-triangular matrix", (
        (_FORWARD_SCAN,
         "        jr = hl.arange(g_ring.size(0))  # VARIANT: suffix sums on tensor cores\n"
         "        upper = (jr[None, :] > jr[:, None]).to(torch.float32)  # upper[j, i] = 1 for i > j\n"
         "        after = hl.dot(upper, g_ring)"),
        (_SETTINGS, _SETTINGS[:-1] + ', dot_precision="tf32x3")'),
    ), False),
    "prefetch2": Variant("two value chunks of the checkpoint in flight instead of one", (
        ("            S_next = hl.load(state_rows, [st_base + rows * st_v, slice(None)], extra_mask=live[:, None])",
         "            S_next = hl.load(state_rows, [st_base + rows * st_v, slice(None)], extra_mask=live[:, None])\n"
         "            rows2 = rows + value_chunk  # VARIANT: second chunk in flight\n"
         "            S_next2 = hl.load(state_rows, [st_base + rows2 * st_v, slice(None)],"
         " extra_mask=(rows2 < tv.end)[:, None])"),
        ("                S_next = hl.load(state_rows, [st_base + after_rows * st_v, slice(None)],"
         " extra_mask=more[:, None])",
         "                S_next = S_next2\n"
         "                rows2 = rows + 2 * value_chunk\n"
         "                S_next2 = hl.load(state_rows, [st_base + rows2 * st_v, slice(None)],"
         " extra_mask=(rows2 < tv.end)[:, None])"),
    ), False),
    "ring_term_once": Variant("the ring's part of S'@k and S'@q for all value rows of the tile reduced once "
                              "per program ([Lb, K] delta tile, laid on the key axis) and picked per chunk by a "
                              "one-hot inside the chunk's key reduction (needs vt <= K, K a power of 2)", (
        ("    V = hl.specialize(v3.size(2))\n",
         "    V = hl.specialize(v3.size(2))\n    K = hl.specialize(state_rows.size(1))  # VARIANT: ring term once\n"),
        ("            S_next = hl.load(state_rows, [st_base + rows * st_v, slice(None)], extra_mask=live[:, None])",
         "            kk = hl.arange(K)\n"
         "            vidx = tv.begin + kk  # the tile's value rows on the key axis\n"
         "            S_next = hl.load(state_rows, [st_base + rows * st_v, kk], extra_mask=live[:, None])"),
        ("            d_next = hl.load(d_rows, [dr_base + j * dr_l, rows], extra_mask=ring_mask[:, None] & live[None, :])",
         "            d_next = hl.load(d_rows, [dr_base + j * dr_l, vidx],\n"
         "                             extra_mask=ring_mask[:, None] & (vidx < tv.end)[None, :])"),
        ("            kq = torch.sum(k * q, dim=0)\n",
         "            kq = torch.sum(k * q, dim=0)\n"
         "            d_all = torch.where(valid[:, None], d_next.to(torch.float32), 0.0)\n"
         "            rk = torch.sum(d_all * wk[:, None], dim=0)  # [K]: entry i belongs to value row tv.begin + i\n"
         "            rq = torch.sum(d_all * wq[:, None], dim=0)\n"),
        ("                d_ring = torch.where(valid[:, None], d_next.to(torch.float32), 0.0)  # [Lb, Vc]\n", ""),
        ("                S_next = hl.load(state_rows, [st_base + after_rows * st_v, slice(None)], extra_mask=more[:, None])\n"
         "                d_next = hl.load(d_rows, [dr_base + j * dr_l, after_rows], extra_mask=valid[:, None] & more[None, :])\n"
         "                spk = torch.sum(S0 * ak[None, :], dim=1) + torch.sum(d_ring * wk[:, None], dim=0)\n"
         "                spq = torch.sum(S0 * aq[None, :], dim=1) + torch.sum(d_ring * wq[:, None], dim=0)\n",
         "                S_next = hl.load(state_rows, [st_base + after_rows * st_v, kk], extra_mask=more[:, None])\n"
         "                on_row = rows[:, None] == vidx[None, :]  # one-hot: chunk row r picks rk[r]\n"
         "                spk = torch.sum(S0 * ak[None, :] + torch.where(on_row, rk[None, :], 0.0), dim=1)\n"
         "                spq = torch.sum(S0 * aq[None, :] + torch.where(on_row, rq[None, :], 0.0), dim=1)\n"),
        ("                    hl.store(state_rows, [st_base + rows * st_v, slice(None)], S_new.to(state_rows.dtype),",
         "                    hl.store(state_rows, [st_base + rows * st_v, kk], S_new.to(state_rows.dtype),"),
    ), False),
    "no_pdl": Variant("no programmatic dependent launch (the kernel of the seventh session): plain stream order", (
        ("    hl.pdl_wait()\n    hl.pdl_launch_dependents()\n", "    # VARIANT: no PDL\n"),
    ), False),
    "pdl_exit": Variant("programmatic dependent launch: wait at entry, let the next kernel launch at exit", (
        ("    hl.pdl_wait()\n    hl.pdl_launch_dependents()\n", "    hl.pdl_wait()  # VARIANT: trigger at exit\n"),
        ("            out3[row, hv, tv] = hl.zeros([tv], dtype=out3.dtype)\n",
         "            out3[row, hv, tv] = hl.zeros([tv], dtype=out3.dtype)\n    hl.pdl_launch_dependents()\n"),
    ), False),
    "dot_chunk": Variant("the chunk's products S0@[ak, aq] and D^T@[wk, wq] on tensor cores (bf16 MMA, fp32 "
                         "accumulation): the vectors as hi + lo bf16 columns, an fp32 checkpoint as hi + lo bf16 "
                         "rows (~2^-16 relative)", (
        ("            kq = torch.sum(k * q, dim=0)\n",
         "            kq = torch.sum(k * q, dim=0)\n"
         "            n = hl.arange(16)  # VARIANT: dot_chunk; columns ak_hi, ak_lo, aq_hi, aq_lo, then zeros\n"
         "            a_sel = torch.where(n[None, :] < 2, ak[:, None], aq[:, None])\n"
         "            a_hi = a_sel.to(torch.bfloat16)\n"
         "            a_lo = (a_sel - a_hi.to(torch.float32)).to(torch.bfloat16)\n"
         "            a_mat = torch.where(n[None, :] < 4, torch.where((n[None, :] % 2) == 0, a_hi, a_lo), 0.0)"
         ".to(torch.bfloat16)\n"
         "            w_sel = torch.where(n[None, :] < 2, wk[:, None], wq[:, None])  # [Lb, 16]\n"
         "            w_hi = w_sel.to(torch.bfloat16)\n"
         "            w_lo = (w_sel - w_hi.to(torch.float32)).to(torch.bfloat16)\n"
         "            w_mat = torch.where(n[None, :] < 4, torch.where((n[None, :] % 2) == 0, w_hi, w_lo), 0.0)"
         ".to(torch.bfloat16)\n"
         "            ck = n < 2\n"
         "            cq = (n >= 2) & (n < 4)\n"),
        ("                S0 = S_next.to(torch.float32)  # [Vc, K]\n"
         "                d_ring = torch.where(valid[:, None], d_next.to(torch.float32), 0.0)  # [Lb, Vc]\n",
         "                S_cur = S_next\n"
         "                S0 = S_next.to(torch.float32)  # [Vc, K]\n"
         "                d_cur = torch.where(valid[:, None], d_next, 0.0)  # [Lb, Vc]\n"),
        ("                spk = torch.sum(S0 * ak[None, :], dim=1) + torch.sum(d_ring * wk[:, None], dim=0)\n"
         "                spq = torch.sum(S0 * aq[None, :], dim=1) + torch.sum(d_ring * wq[:, None], dim=0)\n",
         "                if state_rows.dtype == torch.bfloat16:\n"
         "                    acc = hl.dot(S_cur, a_mat, out_dtype=torch.float32)  # [Vc, 16]\n"
         "                else:  # fp32 checkpoint as hi + lo bf16\n"
         "                    S_hi = S_cur.to(torch.bfloat16)\n"
         "                    S_lo = (S_cur - S_hi.to(torch.float32)).to(torch.bfloat16)\n"
         "                    acc = hl.dot(S_hi, a_mat, out_dtype=torch.float32)\n"
         "                    acc = hl.dot(S_lo, a_mat, acc=acc)\n"
         "                acc = hl.dot(d_cur.permute(1, 0), w_mat, acc=acc)\n"
         "                spk = torch.sum(torch.where(ck[None, :], acc, 0.0), dim=1)\n"
         "                spq = torch.sum(torch.where(cq[None, :], acc, 0.0), dim=1)\n"),
    ), False),
    "two_buffers": Variant("the value-chunk loop unrolled by two with two register buffers (each refilled right "
                           "after its chunk; needs an even number of chunks per tile)", _two_buffer_edits(), False),
}


def source(name: str, kernel_source: str | None = None) -> str:
    """The kernel module's source with variant ``name``'s edits applied (ValueError if one does not fit)."""
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; expected one of {sorted(VARIANTS)}")
    text = KERNEL.read_text() if kernel_source is None else kernel_source
    v = VARIANTS[name]
    for old, new in v.edits:
        if text.count(old) != 1:
            raise ValueError(f"variant {name!r}: expected the text {old.strip()[:60]!r} once in the kernel, "
                             f"found it {text.count(old)} times (the kernel changed: update the variant)")
        text = text.replace(old, new)
    kind = "TIMING ONLY, wrong results by design" if v.timing_only else "correct math"
    return f'"""Variant {name!r} of tp_replayssm/kernel.py: {v.doc} ({kind})."""\n' + text.split('"""', 2)[2]


def materialize(name: str, out_dir: str | Path | None = None) -> Path:
    """Write variant ``name`` as ``<out_dir>/variant_<name>.py`` (a temporary folder by default)."""
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="tp_replayssm_variant_"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"variant_{name}.py"
    path.write_text(source(name))
    return path


def load_kernel(spec: str) -> Any:
    """``replayssm_decode_kernel`` from ``spec``: ``variant:NAME`` (written by :func:`materialize`) or
    the path of a file that defines it. The module is registered in ``sys.modules`` (Helion resolves
    the kernel's helper functions through it)."""
    path = materialize(spec.split(":", 1)[1]) if spec.startswith("variant:") else Path(spec)
    name = "tp_replayssm_candidate_" + path.stem
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    return module.replayssm_decode_kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", nargs="?")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.name is None:
        for name, v in VARIANTS.items():
            print(f"{name:18s} {'timing only' if v.timing_only else 'correct':12s} {v.doc}")
        return
    print(materialize(args.name, args.out))


if __name__ == "__main__":
    main()
