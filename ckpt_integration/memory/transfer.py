"""Moving snapshot copies between ranks: point-to-point over a gloo group, tensors sent in place.

One exchange moves any number of snapshots at once; every rank knows (from the replication
plan or the restore plan, which all ranks compute alike) whom it sends to and receives from.
Three rounds, each posted with ``isend``/``irecv`` for all peers and then waited for (no
ordering between pairs, so no deadlock):

1. a fixed header per snapshot: ``[status, record length]`` (status 0: a record follows;
   otherwise the sender has nothing to send, e.g. its snapshot failed, and nothing follows);
2. the commit record (see :mod:`.slots`), from which the receiver learns the files and sizes;
3. the files, in chunks, straight from the sender's mapping into the receiver's buffers (the
   holder's mapped files in its own shared memory, or host buffers for a restore).

Errors (a dead peer, a timeout) raise here; callers turn them into a failed save or restore
on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..execution.dist import PrivateGroup
from ..execution.transfer import CHUNK, Transfers
from .slots import Record, decode_record
_HEADER, _RECORD, _DATA = 11, 12, 13


@dataclass
class Outgoing:
    """What a rank sends to one peer: a record and the files it names (``None``: nothing)."""

    raw: Optional[bytes]
    files: Dict[str, torch.Tensor]


def exchange(
    sends: Dict[int, Outgoing],
    sources: List[int],
    buffers_for: Callable[[int, Record], Dict[str, torch.Tensor]],
    group: Optional[PrivateGroup],
    describe: Callable[[int], str],
) -> Tuple[Dict[int, Optional[Record]], Dict[int, str]]:
    """Send ``sends[dst]`` to each ``dst`` and receive one snapshot from each of ``sources``.

    ``buffers_for(src, record)`` returns the receive buffers (file name -> uint8 tensor of the
    file's size) once the record arrived. Returns ``({src: record or None}, {src: error})``
    (``None``: the source had nothing to send). A record that does not decode or buffers that
    cannot be made are errors of that source; its data is still received (into a scratch
    buffer, then dropped) so that the sender is not left waiting. ``describe(src)`` names a
    source in errors.
    """
    headers: Dict[int, torch.Tensor] = {}
    moves = Transfers(group, _HEADER)
    for dst, out in sorted(sends.items()):
        moves.send(torch.tensor([0 if out.raw is not None else 1, len(out.raw or b"")], dtype=torch.int64), dst)
    for src in sources:
        headers[src] = torch.zeros(2, dtype=torch.int64)
        moves.recv(headers[src], src)
    moves.settle()

    raws: Dict[int, torch.Tensor] = {}
    moves = Transfers(group, _RECORD)
    for dst, out in sorted(sends.items()):
        if out.raw is not None:
            moves.send(torch.frombuffer(bytearray(out.raw), dtype=torch.uint8), dst)
    for src in sources:
        status, n = (int(x) for x in headers[src])
        if status == 0:
            raws[src] = torch.empty(n, dtype=torch.uint8)
            moves.recv(raws[src], src)
    moves.settle()

    records: Dict[int, Optional[Record]] = {src: None for src in sources}
    errors: Dict[int, str] = {}
    moves = Transfers(group, _DATA)
    for dst, out in sorted(sends.items()):
        if out.raw is None:
            continue
        for name in sorted(out.files):
            moves.send(out.files[name], dst)
    for src, raw in raws.items():
        data = raw.numpy().tobytes()
        try:
            rec = decode_record(data, describe(src))
            bufs = buffers_for(src, rec)
            records[src] = rec
            targets = [bufs[name] for name in sorted(rec.files())]
        except Exception as e:  # noqa: BLE001 - reported, the data is drained below
            errors[src] = f"{type(e).__name__}: {e}"
            sizes = _sizes_from_raw(data)
            sink = torch.empty(min(CHUNK, max(sizes, default=0)), dtype=torch.uint8)
            for n in sizes:  # the sender sends every file in chunks: receive them into the sink
                for o in range(0, n, CHUNK):
                    moves.recv(sink[:min(CHUNK, n - o)], src)
            continue
        for t in targets:
            moves.recv(t, src)
    moves.settle()
    return records, errors


def _sizes_from_raw(raw: bytes) -> List[int]:
    """File sizes named by a record that failed to decode fully (best effort, to drain the data)."""
    import json
    import struct

    try:
        _, _, hl, _ = struct.unpack_from("<8sIQQ", raw)
        files = json.loads(raw[28:28 + hl])["files"]
        return [int(files[k]) for k in sorted(files)]
    except Exception:  # noqa: BLE001 - nothing usable: the sender's sends fail on its side
        return []
