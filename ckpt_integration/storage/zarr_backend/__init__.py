"""The ``zarr`` backend: one zarr array per tensor key (zarr-python, format 3).

Layout of a checkpoint directory::

    <key>/zarr.json, <key>/c/...     one array per ShardedTensor key (global shape)
    <object key>/shard_<o>_<s>.pt    ShardedObjects, torch.save([obj]) (Megatron's layout)
    zarr_index.json                  keys -> dtype, shape, chunking; object keys;
                                     size + CRC32 of every chunk, object and zarr.json file
    common.pt, manifest.json         as for torch_dist
    metadata.json                    commit marker: {"sharded_backend": "zarr", ...}

Keys are paths inside the checkpoint, so :func:`check_layout_paths` refuses keys
that would leave it (``..``, absolute paths, backslashes, empty segments),
overwrite its own files, or land inside another array's directory; the reader
refuses an index whose keys resolve outside the checkpoint directory.

Chunking (:func:`chunk_shape_for`): an array is chunked on the grid of all shard
boundaries (the gcd of offsets and sizes per axis) when those chunks are large
enough; then each chunk lies inside one saved shard and ranks write disjoint
chunk files without coordination. Uneven shards (a 50257-row vocabulary over
TP=3) make that gcd 1, i.e. one file per row; such arrays get coarser chunks
(about ``min(1 MiB, tensor / 64)``), and a chunk that straddles shards of
different writers is assembled by one owner rank (:func:`plan_chunk_writes`;
the save exchanges the pieces). Resharded reads are plain slices of the array
and do not depend on the chunk shape, so older checkpoints read unchanged.
zarr has no bfloat16 (and no float8): such tensors are stored as same-width
integers and the real dtype is kept in the index.

Integrity: zarr itself reads a missing chunk file as fill value (zeros) and
checks nothing. So every chunk is written (also all-zero ones), each rank
records size and CRC32 of the exact bytes it hands to zarr's store (a store
wrapper sees them, no re-read), and the coordinator commits these records (and
those of every array's ``zarr.json``) into ``zarr_index.json`` before
``metadata.json``. Reads go through a checking store wrapper: zarr fetches only
the chunks a region needs, and each fetched chunk is checked (present, size,
CRC32) before it is decoded; a partial (byte-range) fetch is served from the
whole chunk, checked, so every byte read is verified. Opening an array checks its
``zarr.json`` (CRC32, and shape, dtype, chunk shape and encoding against the index),
so an edited ``zarr.json`` cannot make a load decode garbage. Indexes without records
(written before format 2) are read unchecked, as before, except for that
comparison. Containment: every file the store wrapper reads is checked like every
other reader's open (no path leading outside the checkpoint, no link leading
outside it, only regular files), records or not.

The load side exposes the same interface as :class:`TorchDistReader` (a DCP
``Metadata`` view, ``chunks``, ``read_region``, ``read_bytes``), so every load
strategy works on both backends.

One module per job: :mod:`.index` (layout, names, chunk shapes, the index file), :mod:`.checks`
(the recording and checking store wrappers), :mod:`.writer` (save) and :mod:`.reader` (load,
verify). The names other modules use are re-exported here.
"""

from .checks import file_problem
from .index import (ARRAY_METADATA_FILE, INDEX_FILE, INDEX_FORMAT, MAX_SMALL_TENSOR_CHUNKS, MIN_CHUNK_BYTES, FileRecord,
                    aligned_chunk_shape, array_chunks, check_index_paths, check_layout_paths, chunk_box, chunk_coords,
                    chunk_file_names, chunk_shape_for, expected_files, key_path_problem, metadata_file_name,
                    object_file_name, object_path, read_index, write_index)
from .reader import ZarrReader
from .writer import (ArrayPlan, BorderChunk, Piece, assemble_border_chunks, border_chunks, commit_file_records,
                     create_arrays, interior_box, plan_array_writes, plan_chunk_writes, split_for_chunks,
                     write_zarr_requests)

__all__ = [
    "INDEX_FILE", "INDEX_FORMAT", "ARRAY_METADATA_FILE", "MIN_CHUNK_BYTES", "MAX_SMALL_TENSOR_CHUNKS", "FileRecord",
    "aligned_chunk_shape", "chunk_shape_for", "array_chunks", "chunk_box", "chunk_coords", "chunk_file_names",
    "expected_files", "metadata_file_name", "object_file_name", "object_path", "key_path_problem",
    "check_layout_paths", "check_index_paths", "read_index", "write_index", "file_problem",
    "ZarrReader",
    "ArrayPlan", "BorderChunk", "Piece", "interior_box", "border_chunks", "plan_chunk_writes", "plan_array_writes",
    "split_for_chunks", "assemble_border_chunks", "create_arrays", "write_zarr_requests", "commit_file_records",
]
