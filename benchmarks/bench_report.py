"""Tables of benchmarks/bench.py: the main table per target, per-load details, small tensors, sweep summary."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

STAT_TIMES = ("plan_s", "map_s", "read_s", "crc_s", "exchange_s", "copy_s")


def format_small(small: Dict[str, Any]) -> str:
    lines = [f"many small tensors: {small['tensors_per_rank']} x {small['bytes_per_tensor']} B per rank"]
    for target, res in small["targets"].items():
        r = res["results"]
        lines.append(f"  {target}: " + ", ".join(
            f"{name} {r[key]['us_per_tensor']:.0f} us/tensor ({r[key]['seconds']:.2f} s)"
            for name, key in (("ours save", "ours_save"), ("DCP save", "dcp_save"),
                              ("ours first load (request checked)", "ours_load_first"), ("ours load", "ours_load"),
                              ("ours load + state check", "ours_load_verify_state"),
                              ("DCP load", "dcp_load"),
                              ("replicas: auto", "ours_load_replicas_auto"),
                              ("fully_parallel", "ours_load_replicas_fully_parallel"),
                              ("two_stage", "ours_load_replicas_two_stage")) if key in r))
    return "\n".join(lines)


def _fmt(v, spec="{:.2f}", none="-"):
    return none if v is None else spec.format(v)


LOAD_ROWS = (("ours load", "ours_load"), ("ours load + state check", "ours_load_verify_state"),
             ("ours load (no CRC check)", "ours_load_noverify"),
             ("uneven", "ours_load_resharded"), ("row->col", "ours_load_row_to_col"),
             ("col->row", "ours_load_col_to_row"), ("ws change", "ours_load_ws_change"))
VARIANT_LABELS = {"": "", "_local": " [local]", "_nodes": " [nodes]"}


def format_table(results: Dict[str, Any]) -> str:
    lines = []
    for target, res in results["targets"].items():
        lines.append(f"target: {target}")
        hdr = f"{'method':<28}{'time s':>9}{'GiB/s':>9}{'x DCP':>8}{'% plain':>9}{'mem':>7}"
        lines.append(hdr)
        lines.append("-" * len(hdr))
        rows = [
            ("plain write (limit)", "plain_write", None, "plain_write"),
            ("plain read (limit)", "plain_read", None, "plain_read"),
            ("torch.save", "torch_save", "dcp_save", "plain_write"),
            ("torch.load", "torch_load", "dcp_load", "plain_read"),
            ("DCP save", "dcp_save", "dcp_save", "plain_write"),
            ("DCP load", "dcp_load", "dcp_load", "plain_read"),
            ("DCP async_save (total)", "dcp_async_save", "dcp_save", "plain_write"),
            ("ours save", "ours_save", "dcp_save", "plain_write"),
        ]
        for label, key in LOAD_ROWS:
            for suffix, vlabel in VARIANT_LABELS.items():
                name = ("ours load " + label if not label.startswith("ours") else label) + vlabel
                rows.append((name, key + suffix, "dcp_load", "plain_read"))
        rows.append(("ours async (total)", "ours_async_save", "dcp_save", "plain_write"))
        for label, key, dcp_key, plain_key in rows:
            r = res.get(key)
            if r is None:
                continue
            d = res.get(dcp_key) if dcp_key else None
            p = res.get(plain_key)
            xd = r["gib_s"] / d["gib_s"] if d else None
            pp = 100 * r["gib_s"] / p["gib_s"] if p else None
            lines.append(
                f"{label:<28}{r['seconds']:>9.3f}{r['gib_s']:>9.2f}{_fmt(xd, '{:.2f}x'):>8}"
                f"{_fmt(pp, '{:.0f}%'):>9}{_fmt(r.get('mem_ratio'), '{:.2f}'):>7}"
            )
        sync = res.get("ours_save", {}).get("seconds")
        for label, key in (("ours async", "ours_async_save"), ("DCP async", "dcp_async_save")):
            r = res.get(key)
            if r is None:
                continue
            frac = f" = {100 * r['blocking_s'] / sync:.1f}% of ours sync save" if sync else ""
            extra = ""
            if "stage_s" in r:
                extra = (f" (prepare {r['prepare_s']:.3f}s + staging {r['stage_s']:.3f}s;"
                         f" 1st save {r['blocking_first_s']:.3f}s; staging buffers allocated: {r['staging_allocations']})")
            lines.append(f"{label} blocking (2nd save on): {r['blocking_s']:.3f}s{frac}{extra}")
        lines.append("")
        lines.append(format_load_details(res, results.get("state_bytes_per_rank", 0) * results["config"]["ranks"]
                                         if "config" in results else None))
        lines.append("")
    for target, res in results["targets"].items():
        same = res.get("ours_load", {}).get("gib_s")
        parts = [f"{label}{VARIANT_LABELS[suffix]} {res[key + suffix]['gib_s'] / same:.2f}x"
                 for label, key in LOAD_ROWS[2:] for suffix in VARIANT_LABELS if key + suffix in res and same]
        if parts:
            lines.append(f"resharded / same-layout load ({os.path.basename(target.rstrip('/')) or target}): " + ", ".join(parts))
    lines.append("mem = (rank state + peak extra RSS during the phase) / rank state; "
                 "x DCP vs DCP save/load; % plain vs plain write/read; [local]: load_strategy='local' forced; "
                 "[nodes]: read_once with LOCAL_WORLD_SIZE=1 (every rank its own node: slices over the process group)")
    return "\n".join(lines)


def format_load_details(res: Dict[str, Any], stored: Optional[int]) -> str:
    """Per load: strategy used, bytes read from storage over all ranks (and / stored bytes),
    bytes exchanged, seconds per phase (max over ranks; read and CRC summed over threads)."""
    hdr = (f"{'load':<28}{'strategy':>10}{'read MiB':>10}{'/stored':>8}{'sent MiB':>10}{'copied MiB':>11}"
           f"{'plan s':>8}{'map s':>8}{'read s':>8}{'crc s':>8}{'exch s':>8}{'copy s':>8}")
    lines = [hdr, "-" * len(hdr)]
    for label, key in LOAD_ROWS:
        for suffix, vlabel in VARIANT_LABELS.items():
            r = res.get(key + suffix)
            st = r.get("load") if r else None
            if not st:
                continue
            ratio = st["bytes_read"] / stored if stored else None
            lines.append(
                f"{(label + vlabel):<28}{st['strategy']:>10}{st['bytes_read'] / 2**20:>10.1f}{_fmt(ratio, '{:.2f}'):>8}"
                f"{st['bytes_sent'] / 2**20:>10.1f}{st['bytes_copied'] / 2**20:>11.1f}"
                + "".join(f"{st[k]:>8.3f}" for k in STAT_TIMES)
            )
    return "\n".join(lines)


def summary_rows(runs: List[Dict[str, Any]]) -> str:
    """One line per configuration and target: the ratios the performance targets are stated in."""
    hdr = (f"{'ranks':>5}{'tensors':>8}  {'target':<22}{'save xDCP':>10}{'save %plain':>12}{'load xDCP':>10}"
           f"{'reshard/same':>13}{'async block %':>14}{'save mem':>9}"
           f"{'load %plain':>12}{'r->c/same':>10}{'c->r/same':>10}{'ws/same':>8}")
    lines = [hdr, "-" * len(hdr)]
    for run in runs:
        c = run["config"]
        for target, res in run["targets"].items():
            def ratio(a, b):
                return res[a]["gib_s"] / res[b]["gib_s"] if a in res and b in res else None

            block = res.get("ours_async_save", {}).get("blocking_s")
            sync = res.get("ours_save", {}).get("seconds")
            lines.append(
                f"{c['ranks']:>5}{c['tensors']:>8}  {os.path.basename(target.rstrip('/')) or target:<22}"
                f"{_fmt(ratio('ours_save', 'dcp_save'), '{:.2f}x'):>10}"
                f"{_fmt(ratio('ours_save', 'plain_write'), '{:.0%}'):>12}"
                f"{_fmt(ratio('ours_load', 'dcp_load'), '{:.2f}x'):>10}"
                f"{_fmt(ratio('ours_load_resharded', 'ours_load'), '{:.2f}x'):>13}"
                f"{_fmt(100 * block / sync if block is not None and sync else None, '{:.1f}%'):>14}"
                f"{_fmt(res.get('ours_save', {}).get('mem_ratio'), '{:.2f}'):>9}"
                f"{_fmt(ratio('ours_load', 'plain_read'), '{:.0%}'):>12}"
                f"{_fmt(ratio('ours_load_row_to_col', 'ours_load'), '{:.2f}x'):>10}"
                f"{_fmt(ratio('ours_load_col_to_row', 'ours_load'), '{:.2f}x'):>10}"
                f"{_fmt(ratio('ours_load_ws_change', 'ours_load'), '{:.2f}x'):>8}"
            )
    return "\n".join(lines)
