"""Small tensor items written in bulk: the archive template around each tensor's bytes, checksums
from cached parts, one large write per few MiB (storage layer).

A tensor item of a ``.distcp`` file is a ``torch.save`` archive. For a plain contiguous CPU
tensor of at most one checksum block, the archive is a per-(dtype, shape) template around the
tensor's bytes (see :func:`~.tensor_record.save_tensor`), so its block checksums are the
template header's (computed once per template), the data's, and the template trailer's (once
per template), and the item digest is derived from those three (``BlockHash.item_digest``, as
:class:`~.tensor_record.BlockDigestWriter` derives it). Writing such items
through the generic stream (``torch.save``-style writes, a checksum per write, a file write per
part) cost ~25 us each; here it is one copy of the tensor's bytes, one checksum of them, and a
share of one large write: a few microseconds per item, which is what decides the checkpoint
time of models with tens of thousands of small tensors.
"""

from __future__ import annotations

import ctypes
from typing import Any, BinaryIO, Dict, List, Optional, Tuple

import torch

from .checksum import BlockHash, save_block_hash
from .tensor_record import TEMPLATE_MAX_BYTES, archive_template, member_crcs_on

# pending bytes written at once
FLUSH_BYTES = 4 << 20


class SmallItemWriter:
    """Appends small tensor items to an open data file (call :meth:`flush` before other writes)."""

    def __init__(self, f: BinaryIO, block_size: int, block_hash: Optional[BlockHash] = None):
        self.f = f
        self.block_size = block_size
        self.hash = block_hash or save_block_hash()
        self.limit = min(block_size, TEMPLATE_MAX_BYTES)
        self.parts: List[bytes] = []
        self.pending = 0
        self.pos = f.tell()
        self.templates: Dict[Tuple[Any, ...], Optional[Tuple[bytes, bytes, int, int]]] = {}
        self.enabled = not member_crcs_on()  # templates only without the archive members' CRC32s

    def add(self, t: torch.Tensor) -> Optional[Tuple[int, int, int, Tuple[int, int, int, List[int]]]]:
        """Append ``t`` as one item if it is a small plain tensor: ``(start, length, item digest,
        block record)``; None (nothing written) otherwise."""
        if not self.enabled or t.device.type != "cpu" or type(t) is not torch.Tensor or t.layout != torch.strided:
            return None
        nbytes = t.numel() * t.element_size()
        if not 0 < nbytes <= self.limit or t.is_quantized or not t.is_contiguous():
            return None
        key = (t.dtype, t.shape)
        tpl = self.templates.get(key, False)
        if tpl is False:
            tpl = self.templates[key] = self._make_template(t)
        if tpl is None:
            return None
        head, tail, head_digest, tail_digest = tpl
        data = ctypes.string_at(t.data_ptr(), nbytes)
        digests = [head_digest, self.hash.digest(data), tail_digest]
        d, n, m = len(head), nbytes, len(tail)
        whole = self.hash.item_digest(digests, (d, n, m))
        start = self.pos + self.pending
        self.parts += (head, data, tail)
        self.pending += d + n + m
        if self.pending >= FLUSH_BYTES:
            self.flush()
        return start, d + n + m, whole, (d, n, self.block_size, digests)

    def _make_template(self, t: torch.Tensor) -> Optional[Tuple[bytes, bytes, int, int]]:
        parts = archive_template(t.detach())
        if parts is None or not parts[0] or not parts[1]:
            return None  # (an archive always has a header and a trailer around the data)
        return parts[0], parts[1], self.hash.digest(parts[0]), self.hash.digest(parts[1])

    def flush(self) -> None:
        if self.parts:
            self.f.write(b"".join(self.parts))
            self.pos += self.pending
            self.parts, self.pending = [], 0


__all__ = ["SmallItemWriter", "FLUSH_BYTES"]
