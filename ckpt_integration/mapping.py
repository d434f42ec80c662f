"""The sharded state dict data model.

A *sharded state dict* is an ordinary nested dict/list whose leaves may be:

* :class:`ShardedTensor` - this rank's piece of a global tensor, located by a
  global offset inside a global shape;
* :class:`ShardedObject` - an arbitrary picklable object, one per position in a
  (usually tiny) grid of objects, e.g. one RNG state per pipeline stage;
* :class:`ShardedTensorFactory` - a value that turns into a sub state dict of
  ShardedTensors when saved (``build_fn``) and back into one tensor when loaded
  (``merge_fn``), e.g. a fused QKV weight stored as three reshardable tensors;
* :class:`LocalNonpersistentObject` - a value kept on load but never saved;
* anything else - *common state*, identical on every rank, saved once by rank 0.

Names and signatures follow Megatron-Core's ``dist_checkpointing.mapping`` so
that code written for it works unchanged. This module does no I/O and no
collectives.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from .dict_utils import dict_list_map_inplace, extract_matching_values
from .errors import CheckpointingException
from .flat_ranges import flat_range_to_boxes, narrowed_flat_runs  # (flat_range_to_boxes: public here too, as in Megatron-Core)

_SURROGATE = re.compile("[\ud800-\udfff]")


def good_key(key: object) -> bool:
    """A non-empty str that UTF-8 can encode (keys are stored and exchanged as UTF-8: a lone surrogate is not)."""
    return isinstance(key, str) and bool(key) and (key.isascii() or not _SURROGATE.search(key))


ReplicaId = Union[int, Tuple[int, ...]]
StateDict = Dict[str, Any]
ShardedStateDict = Dict[str, Any]
CkptShardedMetadata = Dict[str, Any]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """True for the replica responsible for saving: every component of replica_id is 0."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


class ShardedBase:
    """Common base of ShardedTensor and ShardedObject."""

    key: str
    data: Any
    replica_id: ReplicaId

    def validate_metadata_integrity(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def without_data(self) -> "ShardedBase":  # pragma: no cover - overridden
        raise NotImplementedError

    def __str__(self) -> str:
        return f"{type(self).__name__}(key={self.key!r})"


@dataclass
class ShardedTensor(ShardedBase):
    """A local shard of a global tensor.

    Attributes:
        key: unique name of the global tensor in the checkpoint.
        data: the local tensor (``None`` for metadata-only descriptions).
        dtype: dtype of the global tensor.
        local_shape: shape of ``data`` (without prepended axes).
        global_shape: shape of the global tensor (with prepended axes).
        global_offset: position of ``data`` inside the global tensor (with prepended axes).
        axis_fragmentations: number of equal fragments per axis (``None`` for uneven shards).
        replica_id: 0 (or all zeros) for the copy that is saved; other replicas of
            the same shard (e.g. data-parallel copies) use non-zero ids.
        prepend_axis_num: number of leading global axes of size 1 locally, used to
            stack per-layer tensors into one global tensor (e.g. layers along a
            pipeline-parallel axis).
        allow_shape_mismatch: on load, the checkpoint's global shape may differ;
            the overlap is loaded and the rest of the local tensor is zero-filled.
        flattened_range: for a flattened shard (see :meth:`from_rank_offsets_flat`), the
            ``slice(start, stop)`` of the row-major flattened local shard that ``data``
            (1-D) holds; ``None`` otherwise.

    Example::

        # rank r of a 2-way tensor-parallel column split of a [1024, 512] weight
        ShardedTensor.from_rank_offsets("layer.weight", local_weight, (0, r, 2))
    """

    key: str
    data: Optional[torch.Tensor]
    dtype: torch.dtype
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Optional[Tuple[int, ...]]
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: Optional[slice] = None

    def __post_init__(self) -> None:
        # (map: a shard is built per tensor, tens of thousands per rank for some models)
        self.local_shape = tuple(map(int, self.local_shape))
        self.global_shape = tuple(map(int, self.global_shape))
        self.global_offset = tuple(map(int, self.global_offset))
        if self.axis_fragmentations is not None:
            self.axis_fragmentations = tuple(map(int, self.axis_fragmentations))
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        """Check that shapes, offsets and data agree; raise naming the key otherwise."""
        if not good_key(self.key):
            raise CheckpointingException(f"ShardedTensor key must be a non-empty str of encodable characters, got {self.key!r}")
        ndim = len(self.local_shape) + self.prepend_axis_num
        if len(self.global_shape) != ndim or len(self.global_offset) != ndim:
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: global_shape {self.global_shape} and global_offset "
                f"{self.global_offset} must have {ndim} dims (local {self.local_shape} + "
                f"{self.prepend_axis_num} prepended axes)"
            )
        if self.flattened_range is not None:
            self._validate_flattened_range()
        if self.data is not None:
            expected = (self.flat_numel(),) if self.flattened_range is not None else self.local_shape
            if self.data.shape != expected:
                what = "flattened_range length" if self.flattened_range is not None else "local_shape"
                raise CheckpointingException(
                    f"ShardedTensor {self.key!r}: data shape {tuple(self.data.shape)} != {what} {expected}"
                )
            if self.data.dtype != self.dtype:
                raise CheckpointingException(
                    f"ShardedTensor {self.key!r}: data dtype {self.data.dtype} != dtype {self.dtype}"
                )
        for ax, (off, gsz) in enumerate(zip(self.global_offset, self.global_shape)):
            lsz = 1 if ax < self.prepend_axis_num else self.local_shape[ax - self.prepend_axis_num]
            if off < 0 or gsz < 0 or (off + lsz > gsz and not self.allow_shape_mismatch):
                raise CheckpointingException(
                    f"ShardedTensor {self.key!r}: local shard [{off}, {off + lsz}) on axis {ax} "
                    f"lies outside the global shape {self.global_shape}"
                )

    def _validate_flattened_range(self) -> None:
        fr = self.flattened_range
        ok = (
            isinstance(fr, slice)
            and isinstance(fr.start, int)
            and isinstance(fr.stop, int)
            and fr.step in (None, 1)
            and 0 <= fr.start <= fr.stop <= math.prod(self.local_shape)
        )
        if not ok:
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: flattened_range {fr} must be a slice(start, stop) with "
                f"0 <= start <= stop <= {math.prod(self.local_shape)} (the local shard {self.local_shape}, flattened)"
            )

    # -- constructors -------------------------------------------------------------------
    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: Tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        flattened_range: None = None,
        **init_kwargs: object,
    ) -> "ShardedTensor":
        """Build a shard from its position in an even grid of fragments.

        Each ``(axis, rank_offset, num_fragments)`` says: along global ``axis`` the
        tensor is cut into ``num_fragments`` equal pieces and ``data`` is piece
        number ``rank_offset``. Axes not mentioned are not split. Axes below
        ``prepend_axis_num`` are the prepended (stacking) axes, of local size 1.
        """
        if flattened_range is not None:
            raise CheckpointingException(
                f"{key!r}: from_rank_offsets builds non-flat shards; use from_rank_offsets_flat for a flattened one"
            )
        if data.is_nested:  # (it has no shape: torch raises an internal error at the next line)
            raise CheckpointingException(f"{key!r}: a nested tensor has no shape to shard; store its components")
        shape = tuple(data.shape)
        ndim = len(shape) + prepend_axis_num
        global_offset = [0] * ndim
        global_shape = [1] * prepend_axis_num + list(shape)
        fragments = [1] * ndim
        seen = set()
        for entry in rank_offsets:
            if len(entry) != 3:
                raise CheckpointingException(
                    f"{key!r}: rank offsets must be (axis, rank_offset, num_fragments), got {entry}"
                )
            axis, rank_offset, num_fragments = map(int, entry)
            if not 0 <= axis < ndim or num_fragments < 1 or not 0 <= rank_offset < num_fragments:
                raise CheckpointingException(f"Invalid rank offsets {rank_offsets} for key {key!r}")
            if axis in seen:
                raise CheckpointingException(f"{key!r}: axis {axis} given twice in {rank_offsets}")
            seen.add(axis)
            local = 1 if axis < prepend_axis_num else shape[axis - prepend_axis_num]
            global_shape[axis] = local * num_fragments
            global_offset[axis] = local * rank_offset
            fragments[axis] = num_fragments
        if cls is ShardedTensor and not init_kwargs:
            return cls._of_ints(key, data, shape, tuple(global_shape), tuple(global_offset), tuple(fragments),
                                replica_id, prepend_axis_num)
        return cls(
            key,
            data,
            data.dtype,
            shape,
            tuple(global_shape),
            tuple(global_offset),
            tuple(fragments),
            replica_id,
            prepend_axis_num,
            **init_kwargs,
        )

    @classmethod
    def _of_ints(cls, key: str, data: torch.Tensor, local_shape: Tuple[int, ...], global_shape: Tuple[int, ...],
                 global_offset: Tuple[int, ...], fragments: Tuple[int, ...], replica_id: ReplicaId,
                 prepend_axis_num: int) -> "ShardedTensor":
        # shapes that are int tuples already: the fields set as __init__ would, not converted again
        # by __post_init__ (a shard is built per tensor at every save and load: 8.3 -> 5.7 -> 2.9 us).
        # Only the key is checked: what validate_metadata_integrity checks besides holds by
        # construction here (shape and dtype are the data's, global shape and offset have
        # len(shape) + prepend_axis_num dims, and 0 <= rank_offset < num_fragments puts the
        # shard inside the global shape), as a test checks on random grids.
        if not good_key(key):
            raise CheckpointingException(f"ShardedTensor key must be a non-empty str of encodable characters, got {key!r}")
        self = object.__new__(cls)
        self.__dict__.update(
            key=key, data=data, dtype=data.dtype, local_shape=local_shape, global_shape=global_shape,
            global_offset=global_offset, axis_fragmentations=fragments, replica_id=replica_id,
            prepend_axis_num=prepend_axis_num, allow_shape_mismatch=False, flattened_range=None,
        )
        return self

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: torch.Tensor,
        non_flat_local_shape: Tuple[int, ...],
        *rank_offsets: Tuple[int, int, int],
        flattened_range: Optional[slice] = None,
        **init_kwargs: object,
    ) -> "ShardedTensor":
        """A *flattened* shard: ``data`` (1-D) is ``flattened_range`` of the local shard of shape
        ``non_flat_local_shape``, flattened row-major; the local shard is placed by
        ``rank_offsets`` as in :meth:`from_rank_offsets`.

        This is how a distributed optimizer describes the slice of a parameter that one
        data-parallel rank owns. It is saved as the rectangles it covers (see
        :meth:`unflattened`), so the checkpoint is an ordinary one that loads into any
        layout, flattened or not, and that DCP and Megatron-Core read.

        Example (DP rank r of 2 owns half of the 12 elements of a [3, 4] shard)::

            ShardedTensor.from_rank_offsets_flat("w", flat[6*r:6*r+6], (3, 4), (0, tp_rank, tp),
                                                 flattened_range=slice(6*r, 6*r+6), replica_id=0)
        """
        if flattened_range is None:
            raise CheckpointingException(
                f"{key!r}: from_rank_offsets_flat needs flattened_range; use from_rank_offsets for a non-flat shard"
            )
        if data.ndim != 1:
            raise CheckpointingException(f"{key!r}: a flattened shard needs 1-D data, got shape {tuple(data.shape)}")
        placed = cls.from_rank_offsets(
            key, torch.empty(tuple(non_flat_local_shape), dtype=data.dtype, device="meta"), *rank_offsets, **init_kwargs
        )
        return replace(placed, data=data, flattened_range=flattened_range)

    @classmethod
    def from_global_offsets(cls, key: str, data: torch.Tensor, global_shape: Tuple[int, ...],
                            global_offset: Tuple[int, ...], replica_id: ReplicaId = 0, prepend_axis_num: int = 0,
                            allow_shape_mismatch: bool = False) -> "ShardedTensor":
        """Build a shard at an explicit global offset; use this for uneven shards.

        Example: rows 0..4 of a 10-row tensor split 4/3/3 across 3 ranks::

            ShardedTensor.from_global_offsets("emb", t[0:4], (10, 16), (0, 0))
        """
        return cls(key, data, data.dtype, tuple(data.shape), tuple(global_shape), tuple(global_offset), None,
                   replica_id, prepend_axis_num, allow_shape_mismatch)

    # -- derived properties ---------------------------------------------------------------
    @property
    def has_regular_grid(self) -> bool:
        return self.axis_fragmentations is not None

    def local_chunk_offset_in_global(self) -> Tuple[int, ...]:
        """This shard's place in the grid of chunks (prepended axes: their offsets), as Megatron-Core's."""
        p = self.prepend_axis_num
        if any(s == 0 or o % s for o, s in zip(self.global_offset[p:], self.local_shape)):
            raise CheckpointingException(f"{self.key!r} at {self.global_offset}: an offset is not a multiple of the "
                                         f"local shape {tuple(self.local_shape)} (no regular grid of chunks)")
        return tuple(self.global_offset[:p]) + tuple(o // s for o, s in zip(self.global_offset[p:], self.local_shape))

    def saved_shape(self) -> Tuple[int, ...]:
        """Shape of the saved chunk: local shape with the prepended axes as 1."""
        # (once per tensor at every save and load: ``local_shape`` is a tuple already, no copy)
        local = self.local_shape if type(self.local_shape) is tuple else tuple(self.local_shape)
        return (1,) * self.prepend_axis_num + local if self.prepend_axis_num else local

    def max_allowed_chunks(self) -> Tuple[int, ...]:
        """The chunk size per axis of the grid ``axis_fragmentations`` describes, as Megatron-Core's."""
        frag = self.axis_fragmentations
        if frag is None or (not self.allow_shape_mismatch and any(n % f for n, f in zip(self.global_shape, frag))):
            raise CheckpointingException(f"{self.key!r}: shape {self.global_shape} has no regular grid {frag}")
        return tuple(n // f for n, f in zip(self.global_shape, frag))

    def global_slice(self) -> Tuple[Union[int, slice], ...]:
        """Where this shard is in the global tensor (prepended axes as integers, so ``full[sh.global_slice()]`` has
        the local shape), as Megatron-Core's."""
        p = self.prepend_axis_num
        return tuple(self.global_offset[:p]) + tuple(slice(o, o + s) for o, s in zip(self.global_offset[p:], self.local_shape))

    def local_numel(self) -> int:
        """Elements of the local shard (of the non-flat local shape)."""
        return math.prod(self.local_shape)

    def flat_numel(self) -> int:
        """Elements in ``data``: the flattened range's length, or the local shard's size."""
        fr = self.flattened_range
        return self.local_numel() if fr is None else fr.stop - fr.start

    def unflattened(self) -> List["ShardedTensor"]:
        """The rectangular shards covered by a flattened shard (``[self]`` for a non-flat one).

        ``flattened_range`` of the row-major flattened local shard is cut into at most a
        few boxes per axis (:func:`flat_range_to_boxes`); each box's ``data`` is a view into
        ``data``, so reading into the boxes fills the flat tensor in place. This is how
        flattened shards are saved and loaded: the checkpoint holds ordinary chunks.
        """
        fr = self.flattened_range
        if fr is None:
            return [self]
        p = self.prepend_axis_num
        flat = self.data.detach() if self.data is not None else None
        out: List[ShardedTensor] = []
        pos = 0
        for off, size in flat_range_to_boxes(self.local_shape, fr.start, fr.stop):
            n = math.prod(size)
            data = flat[pos:pos + n].view(size) if flat is not None else None
            pos += n
            goff = self.global_offset[:p] + tuple(g + o for g, o in zip(self.global_offset[p:], off))
            out.append(replace(
                self, data=data, local_shape=size, global_offset=goff, axis_fragmentations=None, flattened_range=None,
            ))
        return out

    def narrow(self, dim: int, start: int, length: int) -> List["ShardedTensor"]:
        """Like ``torch.narrow`` on the local shard of every rank (e.g. one half of a fused
        SwiGLU weight): local shape, global shape and offset shrink by ``length / local size``.

        Needs a regular grid along ``dim`` (the global size and offset are multiples of the
        local size). A non-flat shard gives one ShardedTensor (``data`` a view); a flattened
        one gives one per contiguous run of its data inside the narrowed region (none if it
        does not overlap it; one for ``dim=0``), each with its own ``flattened_range``.
        """
        ndim = len(self.local_shape)
        if not 0 <= dim < ndim:
            raise CheckpointingException(f"ShardedTensor {self.key!r}: cannot narrow dim {dim} of a {ndim}-D shard")
        local_len = self.local_shape[dim]
        if start < 0 or length < 0 or start + length > local_len:
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: narrow({dim}, {start}, {length}) is outside the local size {local_len}"
            )
        pdim = dim + self.prepend_axis_num
        gsz, goff = self.global_shape[pdim], self.global_offset[pdim]
        if local_len == 0 or gsz % local_len or goff % local_len:
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: narrow needs a regular grid of local shards along dim {dim} "
                f"(global size {gsz} and offset {goff} multiples of the local size {local_len})"
            )
        fields = dict(
            local_shape=tuple(length if a == dim else s for a, s in enumerate(self.local_shape)),
            global_shape=tuple(gsz // local_len * length if a == pdim else s for a, s in enumerate(self.global_shape)),
            global_offset=tuple(goff // local_len * length if a == pdim else s for a, s in enumerate(self.global_offset)),
        )
        fr = self.flattened_range
        if fr is None:
            data = self.data.narrow(dim, start, length) if self.data is not None else None
            return [replace(self, data=data, **fields)]
        return [replace(self, data=self.data[lo - fr.start:hi - fr.start] if self.data is not None else None,
                        flattened_range=slice(new_lo, new_lo + hi - lo), **fields)
                for lo, hi, new_lo in narrowed_flat_runs(fr.start, fr.stop, local_len, math.prod(self.local_shape[dim + 1:]),
                                                         start, length)]

    def without_data(self) -> "ShardedTensor":
        return replace(self, data=None)

    def init_data(self, device: Union[str, torch.device] = "cpu", init_fn: Callable = torch.empty) -> None:
        """Allocate ``data`` (if missing) with the local shape (the range's length for a flattened
        shard) and the dtype."""
        if self.data is None:
            shape = (self.flat_numel(),) if self.flattened_range is not None else self.local_shape
            self.data = init_fn(shape, dtype=self.dtype, device=device)


@dataclass
class ShardedObject(ShardedBase):
    """A picklable object placed at one position of a global grid of objects.

    ``global_shape``/``global_offset`` describe the grid (e.g. ``(pp_size,)`` and
    ``(pp_rank,)``); each distinct offset is saved once (by its main replica).

    Example::

        ShardedObject("rng_state", torch.get_rng_state(), (pp_size,), (pp_rank,), replica_id=dp_rank)
    """

    key: str
    data: Any
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.global_offset = tuple(int(s) for s in self.global_offset)
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        if not good_key(self.key):
            raise CheckpointingException(f"ShardedObject key must be a non-empty str of encodable characters, got {self.key!r}")
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(
                f"ShardedObject {self.key!r}: global_shape {self.global_shape} and global_offset "
                f"{self.global_offset} differ in length"
            )
        if any(not 0 <= o < s for o, s in zip(self.global_offset, self.global_shape)):
            raise CheckpointingException(f"ShardedObject {self.key!r}: offset {self.global_offset} outside grid {self.global_shape}")

    @property
    def unique_key(self) -> str:
        """Storage name: ``{key}/shard_{offsets}_{shape}`` (the Megatron-Core convention)."""
        return f"{self.key}/shard_{'.'.join(map(str, self.global_offset))}_{'.'.join(map(str, self.global_shape))}"

    def without_data(self) -> "ShardedObject":
        return replace(self, data=None)

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> "ShardedObject":
        """Inverse of :attr:`unique_key` (data is ``None``)."""
        m = _OBJECT_NAME.fullmatch(unique_key)
        if m is None:
            raise CheckpointingException(f"{unique_key!r} is not a ShardedObject storage key")
        as_tuple = lambda s: tuple(int(v) for v in s.split(".")) if s else ()
        return cls(m.group(1), None, as_tuple(m.group(3)), as_tuple(m.group(2)), replica_id)


_OBJECT_NAME = re.compile(r"(.+)/shard_((?:\d+(?:\.\d+)*)?)_((?:\d+(?:\.\d+)*)?)", re.S)


def object_key_of(unique_key: str) -> Optional[str]:
    """The key of the :class:`ShardedObject` stored as ``unique_key``, or None when that is not such a
    storage name (a byte item of plain PyTorch DCP under a key of its own, ``"a/shard_info"``)."""
    m = _OBJECT_NAME.fullmatch(unique_key)
    return m.group(1) if m else None


@dataclass
class ShardedTensorFactory(ShardedBase):
    """Stores ``data`` as the sub state dict built by ``build_fn`` and merges it back on load.

    ``build_fn(key, data, replica_id, flattened_range)`` returns a sharded state
    dict (ShardedTensors, possibly nested); ``merge_fn(loaded_sub_state_dict)``
    returns the value to put in place of the factory after loading. Both are
    applied identically on save and load, so the stored tensors reshard like any
    other ShardedTensor.

    Example (fused QKV stored as separate q/k/v tensors)::

        def build(key, t, replica_id, _):
            q, k, v = t.chunk(3)
            return {n: ShardedTensor.from_rank_offsets(f"{key}.{n}", x, (0, tp_rank, tp), replica_id=replica_id)
                    for n, x in zip("qkv", (q, k, v))}
        merge = lambda sd: torch.cat([sd["q"], sd["k"], sd["v"]])
        ShardedTensorFactory("attn.qkv", fused, build, merge)
    """

    key: str
    data: Any
    build_fn: Callable[..., ShardedStateDict]
    merge_fn: Callable[[Any], Any]
    replica_id: ReplicaId = 0
    flattened_range: Optional[slice] = None

    def build(self) -> ShardedStateDict:
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self) -> None:
        return None

    def without_data(self) -> "ShardedTensorFactory":
        return replace(self, data=None)


@dataclass
class LocalNonpersistentObject:
    """A value that is never saved; ``load`` returns it unchanged in its place.

    Example: ``{"params": LocalNonpersistentObject(group["params"])}`` keeps an
    optimizer's local parameter ids out of the checkpoint.
    """

    obj: Any

    def unwrap(self) -> Any:
        return self.obj


def is_sharded(x: object) -> bool:
    return isinstance(x, (ShardedTensor, ShardedObject))


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replace every ShardedTensorFactory by the sub state dict it builds (in place)."""
    dict_list_map_inplace(_built, sharded_state_dict)


def _built(x: object) -> Any:  # (not a closure calling itself: that is a reference cycle)
    if isinstance(x, ShardedTensorFactory):
        built = note_built_factories(x, x.build())
        return dict_list_map_inplace(_built, built) if isinstance(built, (dict, list)) else _built(built)
    return x


def note_built_factories(factory: "ShardedTensorFactory", built: Any) -> Any:
    """Keep on ``factory`` (``built_factories``) the factories its ``build_fn`` returned, at their
    positions, before they are built in turn: :func:`apply_factory_merges` merges them first, so a
    factory nested in another gets its own ``merge_fn`` called. Returns ``built``."""
    nested = isinstance(built, (dict, list)) and extract_factories(built)[0]
    factory.built_factories = built if isinstance(built, ShardedTensorFactory) else (nested or None)
    return built


def extract_factories(sharded_state_dict: ShardedStateDict) -> Tuple[Any, Any]:
    """Return ``(factories, rest)`` where ``factories`` keeps the factories' positions."""
    return extract_matching_values(
        sharded_state_dict, lambda v: isinstance(v, ShardedTensorFactory), return_lists_as_dicts=True
    )


def apply_factory_merges(loaded: object, factories: Union[ShardedTensorFactory, Dict[Any, Any]], path: Tuple[Any, ...] = ()) -> Any:
    """Call each factory's ``merge_fn`` on the loaded sub state dict at its position (the factories its
    ``build_fn`` returned first, see :func:`note_built_factories`)."""
    if isinstance(factories, ShardedTensorFactory):
        inner = getattr(factories, "built_factories", None)
        if inner is not None:
            loaded = apply_factory_merges(loaded, inner, path)
        try:
            return factories.merge_fn(loaded)
        except Exception as e:  # name the factory; the merge_fn is user code
            raise CheckpointingException(
                f"merge_fn of ShardedTensorFactory {factories.key!r} failed: {e}"
            ) from e
    if isinstance(factories, dict):
        for k, f in factories.items():
            if isinstance(loaded, list):
                loaded[k] = apply_factory_merges(loaded[k], f, path + (k,))
            elif k in loaded:
                loaded[k] = apply_factory_merges(loaded[k], f, path + (k,))
            else:
                raise CheckpointingException(
                    f"nothing was loaded for ShardedTensorFactory at {path + (k,)}"
                )
        return loaded
    raise CheckpointingException(f"unexpected factory container {type(factories).__name__} at {path}")


__all__ = [
    "ShardedBase",
    "ShardedTensor",
    "ShardedObject",
    "ShardedTensorFactory",
    "LocalNonpersistentObject",
    "ReplicaId",
    "StateDict",
    "ShardedStateDict",
    "CkptShardedMetadata",
    "is_main_replica",
    "is_sharded",
    "apply_factories",
    "extract_factories",
    "apply_factory_merges",
]
