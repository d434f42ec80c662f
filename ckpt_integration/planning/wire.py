"""The codes of the save exchange's messages (planning layer): record kinds, flags, and the
tables each step sends (tag -> width as a function of the records' number of dimensions; see
:func:`~.records.put_table`). Shared by the holder and chunk-owner steps (:mod:`.exchange`) and
the key owner's (:mod:`.key_owner`)."""

from __future__ import annotations

KIND_CODES = {"tensor": 0, "object": 1}
KIND_NAMES = ("tensor", "object")
CLAIM = 2  # in a general forward's kind position: an object's storage key, sent to that key's owner
MAIN, HAS_DATA = 1, 2

FULL, COMPACT, SIMPLE, GENERAL, ANSWER, SUMMARY = 1, 2, 3, 4, 5, 6
WIDTHS = {
    FULL: lambda nd: 5 + 3 * nd,  # idx, key, kind, dtype, flags, global shape, offsets, sizes
    COMPACT: lambda nd: 4,  # idx, record digest (low, high), flags
    SIMPLE: lambda nd: 7 + 3 * nd,  # key, kind, dtype, global shape, offsets, main rank, sizes, one run
    GENERAL: lambda nd: 1,  # a stream of variable-length records (count = its length)
    ANSWER: lambda nd: 5,  # idx, holder-set digest (low, high), set size (0: send in full), position
    SUMMARY: lambda nd: 6 + nd,  # key, kind, dtype, global shape, chunks, digest sum (low, high)
}
