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
    """Appends small tensor items to an open data file (call :meth:`flush` before other writes).

    Items are assembled in one reused staging buffer (template header, the tensor's bytes, template
    trailer, by ``memmove``) and checksummed there, so the bytes hashed are the bytes written even
    if the tensor changes meanwhile; the buffer goes to the file in one write when full. No
    per-item ``bytes`` object: allocating and filling one (``ctypes.string_at``) cost ~5 us of the
    ~14 us an item took, the join before the write another copy.
    """

    def __init__(self, f: BinaryIO, block_size: int, block_hash: Optional[BlockHash] = None):
        self.f = f
        self.block_size = block_size
        self.hash = block_hash or save_block_hash()
        self._digest, self._item_digest = self.hash.digest, self.hash.item_digest  # (once per item)
        self.limit = min(block_size, TEMPLATE_MAX_BYTES)
        self.pending = 0  # bytes staged in ``buf``, not yet written
        self.pos = f.tell()  # the file offset of ``buf[0]``
        # (dtype, shape) -> (template: header + room for the data + trailer, header length, its
        # digest, trailer digest), or None when that dtype and shape cannot be templated
        self.templates: Dict[Tuple[Any, ...], Optional[Tuple[bytes, int, int, int]]] = {}
        self.enabled = not member_crcs_on()  # templates only without the archive members' CRC32s
        self.buf: Optional[torch.Tensor] = None  # allocated on the first item
        self.view: Optional[memoryview] = None
        self.addr = 0

    def add(self, t: torch.Tensor) -> Optional[Tuple[int, int, int, Tuple[int, int, int, List[int]]]]:
        """Append ``t`` as one item if it is a small plain tensor: ``(start, length, item digest,
        block record)``; None (nothing written) otherwise."""
        if not self.enabled or type(t) is not torch.Tensor or not t.is_cpu or t.layout != torch.strided:
            return None
        nbytes = t.nbytes
        if not 0 < nbytes <= self.limit or t.is_quantized or not t.is_contiguous():
            return None
        key = (t.dtype, t.shape)
        tpl = self.templates.get(key, False)
        if tpl is False:
            tpl = self.templates[key] = self._make_template(t)
        if tpl is None:
            return None
        frame, d, head_digest, tail_digest = tpl
        length = len(frame)
        if self.pending + length > FLUSH_BYTES:
            if length > FLUSH_BYTES:  # (not with the default sizes: an item is at most 1 MiB + _FRAME_MAX)
                return None
            self.flush()
        if self.buf is None:
            self.buf = torch.empty(FLUSH_BYTES, dtype=torch.uint8)
            self.view = memoryview(self.buf.numpy())
            self.addr = self.buf.data_ptr()
        s = self.pending
        view = self.view
        # the template by a memoryview assignment (a C copy: ~0.4 us, ctypes.memmove ~1 us), then
        # the tensor's bytes over its data part
        view[s : s + length] = frame
        ctypes.memmove(self.addr + s + d, t.data_ptr(), nbytes)
        digests = [head_digest, self._digest(view[s + d : s + d + nbytes]), tail_digest]
        whole = self._item_digest(digests, (d, nbytes, length - d - nbytes))
        self.pending = s + length
        return self.pos + s, length, whole, (d, nbytes, self.block_size, digests)

    def _make_template(self, t: torch.Tensor) -> Optional[Tuple[bytes, int, int, int]]:
        parts = archive_template(t.detach())
        if parts is None or not parts[0] or not parts[1] or len(parts[0]) + len(parts[1]) > _FRAME_MAX:
            return None  # (an archive always has a header and a trailer around the data)
        head, tail = parts
        frame = head + bytes(t.nbytes) + tail  # (ctypes.memmove copies from a bytes object's buffer)
        return frame, len(head), self.hash.digest(head), self.hash.digest(tail)

    def flush(self) -> None:
        if self.pending:
            assert self.view is not None
            # the file copies the bytes before write returns (a local file, or fsspec's buffer)
            self.f.write(self.view[: self.pending])
            self.pos += self.pending
            self.pending = 0


# room for a template's header and trailer (a few hundred bytes each; longer keeps the generic path)
_FRAME_MAX = 64 << 10


__all__ = ["SmallItemWriter", "FLUSH_BYTES"]
