"""Public save/load entry points (names and arguments follow Megatron-Core).

All functions work with ``torch.distributed`` initialized (any world size) and
without it (one process saves or loads everything).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Set, Tuple, Union

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from .checkpoints import save_base
from .errors import CheckpointingException
from .execution import dist
from .execution.async_save import AsyncCallsQueue, async_save_torch_dist
from .execution.load import last_load_stats, load_sharded, read_whole_tensors
from .execution.preprocess import check_group
from .execution.dist import Group
from .execution.state_check import check_whole_tensors, default_verify_state
from .execution.save import CONTENT_METADATA_KEY, save_sharded
from .execution.shared_metadata import SharedMetadata, open_shared, shared_of
from .mapping import CkptShardedMetadata, ShardedObject, ShardedStateDict, ShardedTensor, StateDict
from .planning.strict import StrictHandling, parse_strict_flag  # noqa: F401 (Megatron-Core's name here too)
from .storage import checkpoint_dir as ckdir, zarr_backend
from .storage.opened import embedded_common_bytes, embedded_common_key, read_metadata
from .storage.filesystem import CheckpointLocation, locate
from .storage.checksum import write_recorded
from .storage.item_table import encode_text
from .storage.opened import OpenedCheckpoint, open_checkpoint, opened  # noqa: F401  (open_checkpoint: public)
from .storage.torch_dist import DCP_METADATA_FILE, read_dcp_metadata, write_dcp_metadata
from .strategies import (
    LoadShardedStrategy, LoadStrategy, SaveShardedStrategy, StrategySpec, backend_and_version, save_strategy_options,
    strategy_option,
)

PathLike = Union[str, "os.PathLike[str]"]
logger = logging.getLogger(__name__)

LOAD_STRATEGIES = tuple(m.value for m in LoadStrategy)


def _backend_from_strategy(strategy: StrategySpec, default: str = "torch_dist") -> str:
    return backend_and_version(strategy, default)[0]


def default_thread_count() -> int:
    """I/O threads per rank: the machine's cores shared by the ranks on it (1..4)."""
    ranks = dist.local_world_size() or dist.get_world_size()
    return max(1, min(4, (os.cpu_count() or 1) // max(1, ranks)))


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: PathLike,
    sharded_strategy: StrategySpec = None,
    common_strategy: StrategySpec = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Optional[Callable[[StateDict], StateDict]] = None,
    content_metadata: Optional[dict] = None,
    *,
    thread_count: Optional[int] = None,
    balance: bool = True,
    overwrite: bool = False,
    durable: bool = True,
    process_group: Group = None,
    async_queue: Optional[AsyncCallsQueue] = None,
    step: Optional[int] = None,
    base: Optional[PathLike] = None,
    staging_budget: Optional[int] = None,
    common_state_in_data: bool = False,
) -> Any:
    """Save a sharded state dict; every rank writes only what it owns.

    Call on every rank with that rank's sharded state dict. Common (non-sharded)
    values are taken from rank 0. The checkpoint becomes visible only once every
    rank's data is durable (``metadata.json`` is written last); a failure on any
    rank raises on every rank and commits nothing.

    Args:
        sharded_state_dict: nested dict of ShardedTensor / ShardedObject /
            ShardedTensorFactory / LocalNonpersistentObject / common values.
        checkpoint_dir: target directory; created if missing. A directory left by
            an uncommitted save is cleaned and reused; a committed checkpoint is
            replaced only with ``overwrite=True`` (after the new one is complete).
        sharded_strategy: the backend: ``"torch_dist"`` (default, PyTorch DCP format)
            or ``"zarr"``, also as ``(name, version)`` or a strategy object with
            ``backend``/``version`` (:func:`get_default_save_sharded_strategy`, or
            Megatron-Core's). ``load`` detects it.
        validate_access_integrity: check that every element is saved by exactly
            one main replica (one small metadata exchange), and log on every rank whose
            common state differs from rank 0's which keys differ (only rank 0's is saved;
            a digest is compared first, details travel only when it differs).
        preprocess_common_before_consistancy_check: maps the common state to what that
            comparison sees (e.g. drops keys expected to differ); must not modify it.
        content_metadata: a dict stored with the common state; read it back with
            :func:`load_content_metadata`. A ``dp_cp_group`` entry (a process group
            Megatron-Core's sharded_state_dict metadata carries) is left out, as Megatron does.
        async_sharded_save: return at once with an ``AsyncRequest`` after the
            collective planning and a host snapshot of the tensors; the write and
            the commit run in the background (``request.wait()`` to block; errors
            surface there, at the next save or at ``close()`` of ``async_queue``,
            default: a process-wide queue with one save in flight). **Every rank must
            let the save finish**: ``wait()``, ``close()`` of the queue, or a normal
            interpreter exit (which waits for it, also after ``destroy_process_group()``,
            since the commit runs on the library's own group). A rank killed or leaving
            with ``os._exit`` first abandons it: the other ranks raise (or, at exit, log)
            ``AsyncSaveAbandonedError`` naming the path, and nothing is committed there.
        thread_count: writer threads (and files) per rank; default: the cores
            per local rank (at most 4).
        balance: spread the writing of replicated shards over all replicas
            (fully-parallel save); ``False`` lets main replicas write.
        durable: fsync data before commit (disable only for throwaway checkpoints).
        process_group: group of the ranks taking part (default: the world).
        step: the training step this checkpoint holds, recorded in its ``manifest.json``;
            :func:`list_checkpoints` and Lightning's ``ckpt_path="last"`` order checkpoints
            by it (then by the order of their commits). Default: the common state's
            top-level integer ``global_step`` (Lightning) or ``iteration`` (Megatron-LM).
        base: an earlier committed checkpoint of the same job, or ``"auto"`` (the newest committed
            checkpoint beside ``checkpoint_dir``): an incremental save. A data file whose every item
            is bit-identical to the base's is not written but hard-linked (a server-side copy on
            object stores); the checkpoint stays complete and self-contained, and deleting the base
            never breaks it. Parameters with ``requires_grad=False`` are kept in data files of their
            own, so a fine-tuning job's frozen weights are written once. torch_dist only; where a
            link or copy is impossible the bytes are written (said once). See docs/incremental.md.
        staging_budget: with ``async_sharded_save``, the most bytes of tensor data staged in host
            memory: the rest is staged in waves through one reused buffer, each written before the
            next is copied, and this call returns once only the last wave is left to write (the
            training loop waits as long as the state beyond the budget takes). Without it, an async
            save whose staging cannot fit in the host memory available fails with
            ``StagingMemoryError`` naming the bytes needed, instead of an out-of-memory kill. (A
            synchronous save stages nothing: it writes from the tensors, within any budget.)
            ``request.staging`` reports the bytes staged, the waves and the time blocked.
        common_state_in_data: store the common state as the ``common_state`` ShardedObject inside the
            data files instead of ``common.pt`` (Megatron-Core 0.19's layout, which loads of this
            library read either way; Megatron-Core before 0.19 needs ``common.pt``). torch_dist only.

    Example::

        save({"w": ShardedTensor.from_rank_offsets("w", local_w, (0, rank, world))}, "ckpt/iter_100")
        save(state, "ckpt/iter_200", base="ckpt/iter_100")  # links what did not change
    """
    check_group(process_group, "save")
    if common_strategy is not None and _backend_from_strategy(common_strategy, "torch") != "torch":
        raise CheckpointingException(f"unsupported common strategy {common_strategy!r}; only 'torch' exists")
    chosen = save_strategy_options(sharded_strategy)  # backend (checked), separation_hint
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise CheckpointingException(f"save: step must be an integer, got {step!r}")
    if isinstance(content_metadata, dict) and "dp_cp_group" in content_metadata:
        # Megatron-Core drops the process group it may carry before saving (it cannot be pickled)
        content_metadata = {k: v for k, v in content_metadata.items() if k != "dp_cp_group"}
    kwargs = dict(
        validate_access_integrity=validate_access_integrity,
        content_metadata=content_metadata,
        thread_count=thread_count if thread_count is not None else (
            strategy_option(sharded_strategy, "thread_count") or default_thread_count()),
        balance=balance,
        overwrite=overwrite,
        durable=durable,
        process_group=process_group,
        preprocess_common=preprocess_common_before_consistancy_check,
        step=step,
        **chosen,
    )
    if common_state_in_data:
        kwargs["common_state_in_data"] = True
    if base is not None:
        kwargs["base"] = save_base(base, checkpoint_dir)
    if staging_budget is not None and (isinstance(staging_budget, bool) or not isinstance(staging_budget, int)
                                       or staging_budget < 1):
        raise CheckpointingException(f"save: staging_budget must be a positive number of bytes, got {staging_budget!r}")
    if async_sharded_save:
        return async_save_torch_dist(sharded_state_dict, os.fspath(checkpoint_dir), queue=async_queue,
                                     staging_budget=staging_budget, **kwargs)
    save_sharded(sharded_state_dict, os.fspath(checkpoint_dir), **kwargs)
    return None


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: PathLike,
    sharded_strategy: StrategySpec = None,
    common_strategy: StrategySpec = None,
    validate_access_integrity: bool = True,
    strict: Union[str, StrictHandling] = StrictHandling.ASSUME_OK_UNEXPECTED,
    *,
    trusted: bool = False,
    allowed_globals: Optional[Iterable[Any]] = None,
    thread_count: Optional[int] = None,
    verify_checksums: bool = True,
    process_group: Group = None,
    load_strategy: Union[str, LoadStrategy] = "auto",
    memory_budget: int = 1 << 30,
    strict_dtype: bool = False,
    verify_state: Optional[bool] = None,
) -> Union[StateDict, Tuple[StateDict, Set[str], Set[str]]]:
    """Load a checkpoint into the layout described by ``sharded_state_dict``.

    Each ShardedTensor says which region of the global tensor this rank wants;
    the saved layout may differ in any way (resharding). Tensors given as
    ``data`` are filled in place and returned; ``None`` data is allocated. Data
    saved in another dtype is cast into the requested one (bf16 saved, fp32
    requested: fp32 values), as Megatron-Core does; ``strict_dtype=True`` refuses
    that with :class:`MismatchError` instead. Megatron-Core's own sharded classes
    are accepted in the request as well.
    The result is the checkpoint's common state merged with the loaded shards,
    ShardedObjects and LocalNonpersistentObjects at their positions, with
    factory merges applied.

    Args:
        strict: a :class:`StrictHandling` mode (or its string). With
            ``RETURN_UNEXPECTED``/``RETURN_ALL`` returns
            ``(state_dict, missing_keys, unexpected_keys)``; *unexpected* = requested
            but not in the checkpoint, *missing* = in the checkpoint but not requested.
        trusted: allow arbitrary pickled objects (runs code from the checkpoint:
            only for checkpoints you trust). By default only tensors, containers and
            primitive types load; refusals name the class and how to allow it.
        allowed_globals: extra classes to allow without ``trusted``.
        verify_checksums: check the stored CRC32 of every chunk read whole.
        load_strategy: ``"auto"`` (default: ``"read_once"`` when it reads fewer bytes
            over all ranks than ``"local"``, else ``"local"``), ``"read_once"`` (every
            stored block the load touches is read and verified by one rank of the job;
            ranks on its node copy their slices from the page cache, ranks on other nodes
            receive them over the process group), ``"local"`` (each rank reads and verifies
            the blocks it touches), ``"fully_parallel"`` or ``"two_stage"`` (Megatron-Core's
            names: ``"read_once"`` on any backend, over ``process_group``, always planned;
            see docs/strategies.md). ``memory_budget`` bounds the exchange buffers.
        process_group: the ranks taking part (default: the world).
        strict_dtype: refuse a dtype that differs from the saved one instead of casting.
        verify_state: after the load, prove that every loaded tensor region equals what was
            saved, position by position, whatever the layout change: the layout-independent
            fingerprints recorded at save are compared with those of the loaded state (see
            docs/reliability.md, "Verified resume"); a difference raises
            :class:`~ckpt_integration.errors.StateVerificationError` on every rank naming the
            key (and the rank where the parts tell). Costs about one pass over the loaded
            bytes (docs/benchmarks.md); on by default in the Lightning integration and the tools.
            ``None`` (default): off, unless the environment sets ``CKPT_INTEGRATION_VERIFY_STATE=1``
            (every load of the process checks).

    A requested key that is not in the checkpoint raises
    :class:`~ckpt_integration.errors.KeyNotInCheckpointError` (with the default ``strict``),
    which is also a ``torch.distributed.checkpoint.api.CheckpointException``, the type
    Megatron-Core raises there.
    """
    load_strategy = LoadStrategy.parse(load_strategy).value
    check_group(process_group, "load")
    if isinstance(checkpoint_dir, OpenedCheckpoint):
        # opened on every rank, or once for the job (open_shared: what the coordinator read)
        ck, shared = checkpoint_dir, checkpoint_dir.shared
    else:  # collective: the coordinator opens it, every rank gets the same opened commit
        ck, shared = open_shared(checkpoint_dir, process_group, trusted)
    try:
        with ck.reading(verified=verify_checksums):
            return _load(sharded_state_dict, ck, shared, sharded_strategy, strict, validate_access_integrity,
                         trusted, allowed_globals, thread_count, verify_checksums, process_group, load_strategy,
                         memory_budget, strict_dtype, verify_state)
    finally:
        if ck is not checkpoint_dir:
            ck.close()


def _load(sharded_state_dict: ShardedStateDict, ck: OpenedCheckpoint, shared: Optional[SharedMetadata],
          sharded_strategy: StrategySpec, strict: Union[str, StrictHandling],
          validate_access_integrity: bool, trusted: bool, allowed_globals: Optional[Iterable[Any]],
          thread_count: Optional[int],
          verify_checksums: bool, process_group: Group, load_strategy: str, memory_budget: int, strict_dtype: bool,
          verify_state: Optional[bool] = None) -> Any:
    backend = _backend_from_strategy(sharded_strategy)
    if sharded_strategy is not None and backend != ck.config.sharded_backend:
        raise CheckpointingException(
            f"{ck.path} was saved with backend {ck.config.sharded_backend!r}, not {backend!r}"
        )
    ckdir.check_strategy_version(ck.path, ck.config, sharded_strategy)
    return load_sharded(
        sharded_state_dict,
        ck,
        strict=strict,
        validate_access_integrity=validate_access_integrity,
        trusted=trusted,
        allowed_globals=allowed_globals,
        thread_count=default_thread_count() if thread_count is None else thread_count,
        verify_checksums=verify_checksums,
        process_group=process_group,
        load_strategy=load_strategy,
        memory_budget=memory_budget,
        strict_dtype=strict_dtype,
        shared=shared if shared is not None else shared_of(ck),
        verify_state=default_verify_state() if verify_state is None else bool(verify_state),
    )


def get_default_save_sharded_strategy(backend: str = "torch_dist", version: int = 1) -> SaveShardedStrategy:
    """The strategy object for ``save(..., sharded_strategy=...)`` (Megatron-Core's name).

    Example: ``save(sd, path, get_default_save_sharded_strategy("zarr"))``
    """
    return SaveShardedStrategy(backend, version)


def get_default_load_sharded_strategy(checkpoint_dir: PathLike) -> LoadShardedStrategy:
    """The strategy matching the backend ``checkpoint_dir`` was saved with (Megatron-Core's name).

    Example: ``get_default_load_sharded_strategy("ckpt").backend == "torch_dist"``
    """
    config = ckdir.read_config(locate(checkpoint_dir))  # (an opened checkpoint: what it read at open)
    return LoadShardedStrategy(config.sharded_backend, config.sharded_backend_version)


def load_common_state_dict(
    checkpoint_dir: PathLike, *, trusted: bool = False, allowed_globals: Optional[Iterable[Any]] = None
) -> StateDict:
    """The common (non-sharded) state saved by rank 0, without any tensors shards.

    Example: ``load_common_state_dict("ckpt")["iteration"]``
    """
    with opened(checkpoint_dir, trusted, verified=True) as ck:  # common.pt is checked against the manifest
        return ckdir.load_common(ck, trusted=trusted, allowed_globals=allowed_globals, manifest=ck.manifest,
                                 embedded=lambda: embedded_common_bytes(ck))


def load_tensors_metadata(checkpoint_dir: PathLike, sharded_strategy: StrategySpec = None, *, trusted: bool = False) -> CkptShardedMetadata:
    """``{key: ShardedTensor without data}`` with the global shape and dtype of every saved tensor.

    Keys are ShardedTensor keys (not state-dict paths). Example::

        meta = load_tensors_metadata("ckpt"); meta["decoder.weight"].global_shape
    """
    with opened(checkpoint_dir, trusted, verified=True) as ck:  # .metadata is checked against the manifest
        return _tensors_metadata(read_metadata(ck, trusted=trusted))


def _tensors_metadata(md: Metadata) -> CkptShardedMetadata:
    out: Dict[str, Any] = {}
    for key, tmeta in md.state_dict_metadata.items():
        if isinstance(tmeta, TensorStorageMetadata):
            shape = tuple(tmeta.size)
            out[key] = ShardedTensor(
                key, None, tmeta.properties.dtype, shape, shape, (0,) * len(shape), (1,) * len(shape)
            )
    return out


def load_sharded_metadata(checkpoint_dir: PathLike, sharded_strategy: StrategySpec = None,
                          common_strategy: StrategySpec = None, *, trusted: bool = False) -> CkptShardedMetadata:
    """Like :func:`load_tensors_metadata` plus every ShardedObject (keyed by unique key)."""
    with opened(checkpoint_dir, trusted, verified=True) as ck:
        return _sharded_metadata(read_metadata(ck, trusted=trusted))


def _sharded_metadata(md: Metadata) -> CkptShardedMetadata:
    out = _tensors_metadata(md)
    for key, meta in md.state_dict_metadata.items():
        if isinstance(meta, BytesStorageMetadata):
            try:
                obj = ShardedObject.empty_from_unique_key(key)
            except CheckpointingException:
                continue  # a bytes item not written as a ShardedObject
            out[obj.unique_key] = obj
    return out


def load_plain_tensors(checkpoint_dir: PathLike, *, trusted: bool = False, verify_state: Optional[bool] = None) -> StateDict:
    """Every saved tensor, whole, as ``{key: torch.Tensor}`` (needs memory for all of them).

    Reads only tensors: the common state is not unpickled, so checkpoints whose
    common state holds arbitrary objects load without ``trusted``. ``verify_state``: compare
    every tensor's fingerprint with the one recorded at save (as :func:`load`'s).

    Example: ``load_plain_tensors("ckpt")["embedding.weight"].shape``
    """
    with opened(checkpoint_dir, trusted, verified=True) as ck:  # every chunk read is checked
        out = read_whole_tensors(ck, read_metadata(ck, trusted=trusted))
        if default_verify_state() if verify_state is None else verify_state:
            check_whole_tensors(out, ck.manifest, str(ck.path), last_load_stats)
        return out


def load_content_metadata(
    checkpoint_dir: Optional[PathLike] = None,
    *,
    preloaded_state_dict: Optional[StateDict] = None,
    trusted: bool = False,
    allowed_globals: Optional[Iterable[Any]] = None,
) -> Optional[dict]:
    """The ``content_metadata`` dict given to :func:`save` (``{}`` stays ``{}``), or ``None`` if
    there was none.

    ``trusted`` / ``allowed_globals`` as for :func:`load_common_state_dict` (the content
    metadata lives in the common state).
    """
    if preloaded_state_dict is None:
        if checkpoint_dir is None:
            raise ValueError("pass checkpoint_dir or preloaded_state_dict")
        preloaded_state_dict = load_common_state_dict(checkpoint_dir, trusted=trusted, allowed_globals=allowed_globals)
    return preloaded_state_dict.get(CONTENT_METADATA_KEY)


@contextlib.contextmanager
def _put_back_on_failure(ck: CheckpointLocation, names: Iterable[str]) -> Iterator[None]:
    """Rewrites of the small files ``names`` that fail part-way are undone: each one rewritten already
    gets its old bytes back, so the manifest (written last) still describes every file and the
    checkpoint keeps loading with its old content. (A process killed between the rewrites still
    leaves the new files beside the old manifest: ``verify`` names them.)"""
    old = {n: ck.storage.read_bytes(ck.file(n)) for n in names if ck.exists(n)}
    try:
        yield
    except BaseException:
        for name, data in old.items():
            try:
                ck.storage.write_atomic(ck.file(name), data)
            except Exception as e:  # noqa: BLE001 - the original error is the one raised
                logger.error("could not put %s back after the failed rewrite: %s", ck.file(name), e)
        raise


def remove_sharded_tensors(checkpoint_dir: PathLike, key_prefix: str) -> None:
    """Drop every tensor/object whose key starts with ``key_prefix`` from a checkpoint.

    Rewrites ``.metadata`` and the index, then the manifest that records them (each atomically;
    a rewrite that fails part-way puts the files rewritten already back, so the checkpoint keeps
    loading with its old content), then deletes data files that held only removed items (files
    shared with kept items keep their bytes). Run it on one process.

    Example: ``remove_sharded_tensors("ckpt", "optimizer.")``
    """
    checkpoint_dir = os.fspath(checkpoint_dir)
    ck = locate(checkpoint_dir)
    if ckdir.read_config(ck).sharded_backend == "zarr":
        _remove_from_zarr(ck, key_prefix)
        return
    md = read_dcp_metadata(ck)
    # (the common state a save with common_state_in_data=True keeps as an item, where there is no common.pt, is not
    # a sharded tensor: a prefix such as "common" removed it, and the checkpoint no longer loaded)
    embedded = embedded_common_key(md) if not ck.exists(ckdir.COMMON_FILE) else None
    removed = {k for k in md.state_dict_metadata if k.startswith(key_prefix) and k != embedded}
    if not removed:
        return
    files_kept, files_all = set(), set()
    new_storage = {}
    for index, info in md.storage_data.items():
        files_all.add(info.relative_path)
        if index.fqn in removed:
            continue
        files_kept.add(info.relative_path)
        new_storage[index] = info
    md.state_dict_metadata = {k: v for k, v in md.state_dict_metadata.items() if k not in removed}
    md.storage_data = new_storage
    if isinstance(md.planner_data, dict):
        md.planner_data = {k: v for k, v in md.planner_data.items() if k not in removed}
    manifest = ckdir.read_manifest(ck)
    index = manifest.index() if manifest is not None else None  # (format 6: read before .metadata changes)
    with _put_back_on_failure(ck, (DCP_METADATA_FILE, ckdir.INDEX_FILE) if manifest is not None else ()):
        gone = _rewrite_tables(ck, md, manifest, index, removed, files_all - files_kept)
    for name in gone:
        try:
            ck.remove(name)
        except FileNotFoundError:
            pass


def _rewrite_tables(ck: CheckpointLocation, md: Metadata, manifest: Any, index: Any, removed: Set[str],
                    unused: Set[str]) -> Set[str]:
    """``.metadata``, the index and the manifest without the ``removed`` keys; returns the files to delete."""
    md_entry = write_dcp_metadata(ck, md)
    # the chunk index describes the old .metadata: dropped (loads would not use it anyway)
    gone = unused | {ckdir.CHUNK_INDEX_FILE}
    if index is not None:  # format 6: the index without the removed keys' rows, for the new .metadata
        manifest.files[DCP_METADATA_FILE] = md_entry
        manifest.files[ckdir.INDEX_FILE] = write_recorded(ck, ckdir.INDEX_FILE, index.without_keys(removed, md_entry))
        manifest.files = {k: v for k, v in manifest.files.items() if k not in gone}
        ckdir.write_manifest(ck, manifest)
    elif manifest is not None:
        manifest.files[DCP_METADATA_FILE] = md_entry
        manifest.tables = encode_text(manifest.item_table().without_files(gone))
        manifest.files = {k: v for k, v in manifest.files.items() if k not in gone}
        ckdir.write_manifest(ck, manifest)
    return gone


def _remove_from_zarr(ck: CheckpointLocation, key_prefix: str) -> None:
    checkpoint_dir = ck.path
    manifest = ckdir.read_manifest(ck)
    index = zarr_backend.read_index(ck, manifest)
    zarr_backend.check_index_paths(checkpoint_dir, index)  # never delete outside the checkpoint
    tensors = [k for k in index.get("tensors", {}) if k.startswith(key_prefix)]
    objects = [k for k in index.get("objects", []) if k.startswith(key_prefix)]
    if not tensors and not objects:
        return
    for k in tensors:
        del index["tensors"][k]
    index["objects"] = [k for k in index.get("objects", []) if k not in objects]
    with _put_back_on_failure(ck, (zarr_backend.INDEX_FILE,)):
        entry = zarr_backend.write_index(ck, index)  # the index no longer names them: then delete
        if manifest is not None and zarr_backend.INDEX_FILE in manifest.files:  # (recorded since 2026-11-29)
            manifest.files[zarr_backend.INDEX_FILE] = entry
            ckdir.write_manifest(ck, manifest)
    storage = ck.storage
    arrays, files = [ck.file(k) for k in tensors], [zarr_backend.object_path(ck, k) for k in objects]
    for path in arrays:
        storage.rmtree(path)
    for path in files:
        if storage.exists(path):
            storage.remove(path)
    if not storage.remote:  # directories the removed keys alone used ("opt/state/m": opt/state, opt): else
        root = os.path.abspath(ck.path)  # a later overwrite refused them as files this library did not write
        for path in arrays + files:
            parent = os.path.dirname(os.path.abspath(path))
            while parent.startswith(root + os.sep) and os.path.isdir(parent) and not os.listdir(parent):
                os.rmdir(parent)
                parent = os.path.dirname(parent)
