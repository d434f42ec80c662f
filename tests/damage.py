"""Helpers of the fault-injection tests: damage a file, fail instead of hanging."""

from __future__ import annotations

import contextlib
import signal


def flip_byte(path, offset: int) -> None:
    """Flip one bit of the byte at ``offset`` of ``path`` in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


@contextlib.contextmanager
def deadline(seconds: int = 20):
    """Fail instead of hanging (opening a FIFO for reading blocks until a writer appears)."""
    def expired(*_):
        raise TimeoutError(f"blocked for more than {seconds}s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def reindex(d) -> None:
    """Rewrite a format-6 checkpoint's ``index.bin`` to describe its ``.metadata`` as it is now, and
    record the new bytes in the manifest: what loads read then says what an edited ``.metadata``
    says (a consistently crafted checkpoint). Each item keeps the digests, block record and
    fingerprint the save recorded for its key and offsets. Nothing to do for older formats, whose
    loads read ``.metadata`` once ``chunk_index.bin`` no longer describes it."""
    import json
    import os
    import pickle
    import zlib

    from ckpt_integration.planning.written import encode_finalize, gather_finalize, WrittenTable
    from ckpt_integration.storage.checkpoint_index import INDEX_FILE, CheckpointIndex, encode_index, layout_of_metadata
    from ckpt_integration.storage.checksum import block_hash

    d = str(d)
    man_path = os.path.join(d, "manifest.json")
    man = json.loads(open(man_path).read())
    if not isinstance(man.get("version"), int) or man["version"] < 6 or INDEX_FILE not in man["files"]:
        return  # (formats 4-5 and zarr: no index.bin)
    h = block_hash(man["block_hash"])
    old = CheckpointIndex(open(os.path.join(d, INDEX_FILE), "rb").read(), h, INDEX_FILE).layout.written
    recorded = {}
    for i, b in enumerate(old.items()):
        recorded[(b.storage_key, b.offsets)] = b
    raw_md = open(os.path.join(d, ".metadata"), "rb").read()
    md = pickle.loads(raw_md)
    table = WrittenTable()
    for index, info in md.storage_data.items():
        offsets = None if index.offset is None else tuple(int(x) for x in index.offset)
        was = recorded.get((index.fqn, offsets)) or next(b for (k, _), b in recorded.items() if k == index.fqn)
        sizes = None
        if offsets is not None:
            chunks = md.state_dict_metadata[index.fqn].chunks
            sizes = next(tuple(int(x) for x in c.sizes) for c in chunks if tuple(int(x) for x in c.offsets) == offsets)
        table.append(index.fqn, offsets, sizes, str(info.relative_path), int(info.offset), int(info.length),
                     was.checksum, was.blocks, was.fingerprint)
    cols = gather_finalize([encode_finalize(None, table, [])])[1]
    data = encode_index(layout_of_metadata(md, cols), h, {"size": len(raw_md), "crc32": zlib.crc32(raw_md)})
    with open(os.path.join(d, INDEX_FILE), "wb") as f:
        f.write(data)
    man["files"][INDEX_FILE] = {"size": len(data), "crc32": zlib.crc32(data)}
    man["files"][".metadata"] = {"size": len(raw_md), "crc32": zlib.crc32(raw_md)}
    write_manifest(man_path, man)


def write_manifest(path, man) -> None:
    """Write an edited manifest (a dict) as the library writes one: from format 7 sealed with its own
    CRC32s (``checksum.sealed_json``), so a load reads what the test changed instead of refusing the
    manifest itself as damaged. Unsealed for older formats, as their writers wrote them."""
    import json

    from ckpt_integration.storage.checksum import sealed_json

    if isinstance(man, dict) and isinstance(man.get("version"), int) and man["version"] >= 7:
        text = sealed_json([(k, json.dumps(v)) for k, v in man.items() if k not in ("head_crc32", "manifest_crc32")],
                           head=6)
    else:
        text = json.dumps(man)
    with open(path, "w") as f:
        f.write(text)


def write_zarr_index(d, index, recorded: bool = True) -> None:
    """Write a zarr checkpoint's ``zarr_index.json`` (a dict, or text) as a crafted checkpoint would:
    the manifest's entry says what the file now holds, so loads meet what the index says rather than
    a CRC32 mismatch. ``recorded=False`` drops the entry instead, as in zarr checkpoints saved
    before the manifest recorded the index (a format-1 or -2 index is simulated with it)."""
    import json
    import os
    import zlib

    d = str(d)
    data = (index if isinstance(index, str) else json.dumps(index)).encode()
    with open(os.path.join(d, "zarr_index.json"), "wb") as f:
        f.write(data)
    man_path = os.path.join(d, "manifest.json")
    man = json.loads(open(man_path).read())
    if recorded:
        man["files"]["zarr_index.json"] = {"size": len(data), "crc32": zlib.crc32(data)}
    else:
        man["files"].pop("zarr_index.json", None)
    write_manifest(man_path, man)
