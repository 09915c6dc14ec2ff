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
import importlib.util
import sys
import tempfile
from pathlib import Path
from typing import Any

KERNEL = Path(__file__).resolve().parents[2] / "tp_replayssm" / "kernel.py"

_FORWARD_SCAN = "        after = torch.sum(g_ring, dim=0, keepdim=True) - hl.cumsum(g_ring, 0)"
_REVERSE_SCAN = "        after = hl.cumsum(g_ring, 0, reverse=True) - g_ring  # sum of the valid entries after j"
_KEYS = "                kdec, tot = _decayed_keys(g_ring, k_ring, valid, tiny_batch)  # tiny batches: reverse scan"
_SETTINGS = "_SETTINGS = dict(static_shapes=True, index_dtype=torch.int64)"

@dataclasses.dataclass(frozen=True)
class Variant:
    """``edits`` applied in order; ``timing_only``: the results are wrong by design (a stage left out)."""

    doc: str
    edits: tuple[tuple[str, str], ...]
    timing_only: bool


VARIANTS: dict[str, Variant] = {
    "no_scan": Variant("the ring gates' suffix sums left out (both scan forms replaced by the gates)", (
        (_FORWARD_SCAN, "        after = g_ring  # VARIANT: no scan"),
        (_REVERSE_SCAN, "        after = g_ring  # VARIANT: no scan"),
    ), True),
    "no_ring_prologue": Variant("the decayed keys set to zero: no ring loads or decays in the prologue", (
        (_KEYS, "                kdec = g_ring * 0.0  # VARIANT: no ring prologue\n                tot = g * 0.0"),
    ), True),
    "no_chunk_ring": Variant("the per-chunk ring term dropped (the ring prologue still feeds the flush)", (
        ("    spk = _row_dots(S0, ak) + torch.sum(d_ring * wk, dim=0)\n"
         "    spq = _row_dots(S0, aq) + torch.sum(d_ring * wq, dim=0)",
         "    spk = _row_dots(S0, ak)  # VARIANT: no ring term per chunk\n"
         "    spq = _row_dots(S0, aq)"),
    ), True),
    "predecayed_keys_bound": Variant("the ring prologue of a ring that stores keys pre-decayed to the checkpoint "
                                     "(k_j * exp(-G_j)) and cumulative gates G_j: no scan and no exp per entry, only "
                                     "the masked keys and one gate row; the bound a pool-side ring layout could reach "
                                     "(timed in the fourteenth session: 6.93 -> 5.10 us at HV16 B8 bf16; the layout is "
                                     "now the library's, ops.replayssm_decode_predecayed)", (
        (_KEYS, "                kdec = torch.where(valid[:, None], k_ring.to(torch.float32), 0.0)  # VARIANT: pre-decayed keys\n"
                "                tot = torch.sum(torch.where(valid[:, None], g_ring, 0.0), dim=0)  # (stands for the row G[c-1])"),
    ), True),
    "reverse_scan": Variant("the batch path's suffix sums as a reverse hl.cumsum (the kernel of 28b41a1)", (
        (_KEYS, "                kdec, tot = _decayed_keys(g_ring, k_ring, valid, True)  # VARIANT: reverse scan always"),
    ), False),
    "forward_scan": Variant("the ring's suffix sums as the forward scan on every path (with --tiny-batch on: whole-ring "
                            "loads without the reverse scan)", (
        (_KEYS, "                kdec, tot = _decayed_keys(g_ring, k_ring, valid, False)  # VARIANT: forward scan always"),
    ), False),
    "dot_suffix_sum": Variant("the batch path's suffix sums as a 3xTF32 tensor-core product with a 0/1 "
                              "upper-triangular matrix", (
        (_FORWARD_SCAN,
         "        jr = hl.arange(g_ring.size(0))  # VARIANT: suffix sums on tensor cores\n"
         "        upper = (jr[None, :] > jr[:, None]).to(torch.float32)  # upper[j, i] = 1 for i > j\n"
         "        after = hl.dot(upper, g_ring)"),
        (_SETTINGS, _SETTINGS[:-1] + ', dot_precision="tf32x3")'),
    ), False),
    "replay_flush": Variant("flush rows replay the ring as rank-1 updates on every ring dtype (the flush of "
                            "26863bf, in this kernel's two loops): no tensor-core product", (
        ("    ring_on_tensor_cores = d_rows.dtype == torch.bfloat16 and value_chunk >= 16 and state_rows.size(1) >= 16\n",
         "    ring_on_tensor_cores = False  # VARIANT: replay flush\n"),
    ), False),
    "no_pdl": Variant("no programmatic dependent launch (the kernel of the seventh session): plain stream order", (
        ("    hl.pdl_wait()\n    hl.pdl_launch_dependents()\n", "    # VARIANT: no PDL\n"),
    ), False),
    "l2_prefetch": Variant("prefetch.global.L2 of the program's whole checkpoint tile right after the slot load "
                           "(inline PTX): 19-23% slower from B = 128 (twelfth session)", (
        ("            dr_base = s64 * dr_s + hv * dr_h\n",
         "            dr_base = s64 * dr_s + hv * dr_h\n"
         "            pf_rows = torch.where(tv.index < tv.end, tv.index, tv.begin)  # VARIANT: L2 prefetch\n"
         "            pf_lines = 2 if state_rows.dtype == torch.bfloat16 else 4  # 128-byte lines of a K = 128 row\n"
         "            pf_off = st_base + pf_rows[:, None] * st_v + hl.arange(pf_lines)[None, :] * "
         "(64 if state_rows.dtype == torch.bfloat16 else 32)\n"
         "            hl.inline_triton(\"tl.inline_asm_elementwise('prefetch.global.L2 [$1];\\\\n\\\\tmov.u32 $0, 0;', "
         "'=r,l', [{0} + {1}], dtype=tl.int32, is_pure=False, pack=1)\", args=[state_rows, pf_off], "
         "output_like=None)\n"),
    ), False),
    "whole_ring": Variant("every path loads the whole ring (all L entries) without waiting for the cursor, as the "
                          "tiny-batch path does, and masks the dead entries after the load; the scan form stays the "
                          "path's own (forward off the tiny path)", (
        ("            if tiny_batch:  # load the whole ring without waiting for the cursor; `valid` masks it below\n",
         "            if True:  # VARIANT: whole-ring loads on every path\n"),
    ), False),
    "fixed_g_row": Variant("the pre-decayed layout's G_{c-1} read from a fixed ring row (row 0) instead of the "
                           "cursor's: the timing of a layout that keeps the running cumulative gate at a fixed "
                           "place (with --tiny-batch on, no prologue load then waits for the cursor)", (
        ("                g_last = g_rows[s64 * gr_s + hv * gr_h + torch.where(cur > 0, cur - 1, 0) * gr_l, :]\n",
         "                g_last = g_rows[s64 * gr_s + hv * gr_h, :]  # VARIANT: fixed row\n"),
    ), True),
    "ring_vectors8": Variant("the append loop's d-ring loads without the alignment hint (16-byte vectors along the "
                             "value rows, the ring entries across the lanes), the checkpoint's vector tiles kept", (
        ('        return hl.inline_triton("tl.multiple_of({0}, 4)", [rows], rows)\n',
         '        return rows  # VARIANT: no hint\n'),
    ), False),
    "pdl_exit": Variant("programmatic dependent launch: wait at entry, let the next kernel launch at exit", (
        ("    hl.pdl_wait()\n    hl.pdl_launch_dependents()\n", "    hl.pdl_wait()  # VARIANT: trigger at exit\n"),
        ("            out3[row, hv, tv] = hl.zeros([tv], dtype=out3.dtype)\n",
         "            out3[row, hv, tv] = hl.zeros([tv], dtype=out3.dtype)\n    hl.pdl_launch_dependents()\n"),
    ), False),
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
