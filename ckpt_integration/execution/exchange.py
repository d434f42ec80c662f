"""Collective side of the metadata exchange: moves the bytes of :mod:`..planning.exchange`.

Protocol of a save's phase 1 (every message is compact records, never pickled
dataclasses; "W" is the group size):

1. ``all_reduce(max)`` of 4 integers: did any rank fail locally; is every rank's
   input (its shard records, its rank, W, the options) the same as at the last
   save whose plan it cached, under the same global token. If so the cached plan
   is reused and steps 2-4 are skipped ("plan once, reuse").
2. ``all_to_all``: each shard record to its chunk's owner - main replicas in full
   (key, dtype, shapes, offsets), other copies as a 16-byte digest of the same.
3. ``all_to_all``: chunk owners send each key owner the holdings (signature + holder
   ranks as arithmetic runs) and main records of its chunks, and each holder its
   position in the chunk's holder set (or a request for a copy's full record when
   its digest matches no main replica there).
4. ``all_reduce(sum)`` of 6 integers: problems found, local failures, full records
   requested, and the parts of the global token (sum of the ranks' input digests).
   Only if records were requested (copies that differ from their main, chunks
   without one): two more ``all_to_all`` (those records in full to the chunk owners,
   their holdings to the key owners) and a 2-integer ``all_reduce``. Only when
   something is wrong: the messages are gathered on the coordinator and broadcast,
   and every rank raises.

zarr saves add one ``all_gather`` of each rank's write assignment (the coordinator
creates the arrays, and border chunks need every chunk's writer).

A failure inside a step is recorded and the rank keeps taking part with empty
messages, so no rank waits forever; step 4 then raises on every rank.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from ..errors import MismatchError, ShardingIntegrityError
from ..planning.exchange import (
    KeySummary,
    Routed,
    SummaryTable,
    assign_writes,
    chunk_owner_step,
    decode_shards,
    detail_requests,
    encode_shards,
    key_owner_step,
    route_shards,
)
from ..planning.records import digest64
from ..planning.request_check import request_problems, route_requests
from ..planning.shards import ShardMeta
from . import dist
from .dist import Group
from .failure import Failure
from .preprocess import shard_meta

MAX_PROBLEMS_SHOWN = 50


@dataclass
class ExchangeResult:
    """One rank's outcome of phase 1 (cached for reuse when the structure repeats)."""

    to_write: List[int] = field(default_factory=list)  # indices into the rank's shard records
    summaries: Union[SummaryTable, List[KeySummary]] = field(default_factory=list)  # of the keys this rank owns
    layout: Optional[List[ShardMeta]] = None  # zarr: every chunk with its writer as ``rank``
    digest: int = 0
    token: int = 0
    identity: object = None  # the input (a save's shards, a load's request) as compared values (see known_digest)


_last: Dict[str, ExchangeResult] = {}  # purpose ("save", "load") -> the last plan (one structure each)


def _frame(a: bytes, b: bytes) -> bytes:
    return struct.pack("<I", len(a)) + a + b


def _unframe(m: bytes) -> Tuple[bytes, bytes]:
    (n,) = struct.unpack_from("<I", m, 0)
    return m[4 : 4 + n], m[4 + n :]


def _raise_errors(failure: Failure, group: Group, context: str) -> None:
    """Every rank raises (a failure is known to have happened somewhere)."""
    errors = dist.rank_errors(enumerate(dist.all_gather_object(failure.message, group)), group)
    dist.raise_if_any_failed(failure.exc, errors, context)


def known_digest(purpose: str, identity: object) -> Optional[int]:
    """The digest of the records of the last checked input for ``purpose`` when ``identity`` (the
    caller's input as values compared with ``==``, e.g. every requested shard's key, dtype, shapes,
    offsets and replica id) equals that input's; None otherwise. A save that repeats the structure
    of the last one planned, or a load that repeats its request, then needs neither its shard
    records nor their routing to agree, in :func:`start`, that nothing changed: it builds them
    only if some rank's input did change."""
    cached = _last.get(purpose)
    if identity is None or cached is None or cached.identity is None or cached.identity != identity:
        return None
    return cached.digest


def build_routes(shards: Sequence[Any], rank: int, world: int, options: str) -> Tuple[List[ShardMeta], Routed]:
    """This rank's shard records (from its local shards) and what it sends to their chunk owners."""
    metas = [shard_meta(s, rank) for s in shards]
    return metas, route_shards(metas, rank, world, options=options)


def routes_for(purpose: str, identity: object, shards: Sequence[Any], rank: int, world: int,
               options: str) -> Tuple[List[ShardMeta], Routed]:
    """:func:`build_routes`, unless ``identity`` repeats the last checked input of ``purpose``:
    then no records (``[]``) and the known digest, which :func:`start` agrees on; if another
    rank's input changed, :func:`routes_after_change` builds them."""
    known = known_routes(purpose, identity)
    return ([], known) if known is not None else build_routes(shards, rank, world, options)


def known_routes(purpose: str, identity: object) -> Optional[Routed]:
    """What :func:`routes_for` gives when ``identity`` repeats the last checked input of
    ``purpose`` (no records, the known digest); None otherwise, building nothing:
    :func:`routes_after_change` builds them if a check needs them."""
    known = known_digest(purpose, identity)
    return None if known is None else Routed({}, known)


def routes_after_change(metas: List[ShardMeta], routed: Optional[Routed], shards: Sequence[Any], rank: int, world: int,
                        options: str) -> Tuple[List[ShardMeta], Routed, Failure]:
    """After :func:`start` found that some rank's input changed: this rank's records and routes
    if :func:`routes_for` skipped them, and the failure of building them, if any (passed to
    :func:`run`, which then makes every rank raise: this rank still takes part, with empty
    messages, so that no rank waits for it)."""
    failure = Failure()
    if metas or (not shards and routed is not None):
        return metas, routed, failure
    with failure.capture():
        metas, routed = build_routes(shards, rank, world, options)
    return metas, routed, failure


def start(
    routed: Optional[Routed], failure: Failure, group: Group, context: str, purpose: str = "save",
    arguments: str = "",
) -> Optional[ExchangeResult]:
    """Step 1: raise on every rank if any failed, or if the ranks passed different ``arguments`` (the
    options that decide which collectives follow); the cached plan when every rank's input is unchanged."""
    return _start(routed, failure, group, context, purpose, (), arguments)[0]


def start_load(
    routed: Optional[Routed], whole_chunks: Optional[int], failure: Failure, group: Group, context: str,
    arguments: str = "",
) -> Tuple[Optional[ExchangeResult], bool]:
    """:func:`start` for a load's request check, which also agrees whether every rank's request is
    whole saved chunks numbered by one index (``whole_chunks``: this rank's index identity, None
    when its request is not): ``(the cached check or None, whether :func:`check_whole_chunks`
    can check it)``. The same one collective."""
    ident = -1 if whole_chunks is None else whole_chunks
    cached, (other, imax, ineg) = _start(routed, failure, group, context, "load",
                                         (0 if whole_chunks is not None else 1, ident, -ident), arguments)
    return cached, not other and imax == -ineg


def _start(routed: Optional[Routed], failure: Failure, group: Group, context: str, purpose: str,
           extra: Sequence[int], arguments: str = "") -> Tuple[Optional[ExchangeResult], List[int]]:
    cached = _last.get(purpose)
    if routed is None or cached is None or cached.digest != routed.digest:
        cached = None
    tok = cached.token if cached else 0
    args = digest64(arguments.encode())  # (63 bits: its negation fits the int64 all-reduce)
    got = dist.all_reduce_ints([int(failure.failed), 0 if cached else 1, tok, -tok, args, -args, *extra], "max", group)
    failed, miss, tmax, tneg, amax, aneg = got[:6]
    if amax != -aneg:  # (first: what the ranks did apart, e.g. read other files, is not the cause)
        # ranks that go on with other options would wait in different collectives: a hang, not an error
        raise MismatchError(f"{context}: the ranks of this {purpose} passed different arguments (this rank: "
                            f"{arguments}); every rank of the group must pass the same")
    if failed:
        _raise_errors(failure, group, context)
    return (cached if not miss and tmax == -tneg else None), got[6:]


def check_whole_chunks(rows: Sequence[Tuple[int, int, int, int]], group: Group, context: str,
                       identity: object) -> Optional[List[str]]:
    """The request check of a load whose every rank requests whole saved chunks of one index (see
    :mod:`..planning.request_check`): one all-to-all of four integers per request to the keys'
    owners, one all-reduce. Collective. None on every rank when the request is valid (cached for
    reuse under ``identity``, as :func:`run` does); when some rank found a problem, every rank
    gets the list of those it found (maybe empty: the caller runs the general check to name
    them, and :func:`raise_problems` collects them)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    failure = Failure()  # kept while taking part: the all-reduce makes every rank raise
    messages: Dict[int, bytes] = {}
    with failure.capture():
        messages = route_requests(rows, world)
    inbox = dist.all_to_all_bytes(messages, group)
    problems: List[str] = []
    if not failure.failed:
        with failure.capture():
            problems = request_problems(inbox.values())
    d = digest64(f"{rank}/{world}/whole".encode(), *(k.to_bytes(8, "little") + m for k, m in sorted(messages.items())))
    sums = dist.all_reduce_ints(
        [len(problems), int(failure.failed), d & 0xFFFFF, (d >> 20) & 0xFFFFF, (d >> 40) & 0xFFFFF], "sum", group
    )
    if sums[1]:
        _raise_errors(failure, group, context)
    if sums[0]:
        return problems
    token = digest64(f"whole/{world}/{sums[2]}/{sums[3]}/{sums[4]}".encode()) or 1
    _last["load"] = ExchangeResult(digest=d, token=token, identity=identity)
    return None


def run(
    metas: Sequence[ShardMeta],
    routed: Routed,
    group: Group,
    *,
    balance: bool = True,
    validate: bool = True,
    replies: bool = True,
    want_layout: bool = False,
    context: str,
    problems_header: str,
    on_problems: Optional[Callable[[], None]] = None,
    purpose: Optional[str] = "save",
    failure: Optional[Failure] = None,
    identity: object = None,
) -> ExchangeResult:
    """Steps 2-4 (collective). Raises ShardingIntegrityError on every rank for invalid sharding.

    ``replies=False`` (a load's request check) skips the write assignment;
    ``purpose=None`` does not cache the result. ``failure``: this rank
    failed before the exchange (``routed`` may then be None); it takes part with empty
    messages and step 4 raises on every rank, as an agreement on errors beforehand would
    (one collective round fewer when nothing failed). ``identity``: kept with the cached result
    (see :func:`known_digest`).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    failure = failure if failure is not None else Failure()
    if not failure.failed and routed is None:
        raise ValueError("exchange.run: no routed records and no local error")
    inbox = dist.all_to_all_bytes(routed.messages if not failure.failed else {}, group)
    outgoing: Dict[int, bytes] = {}
    if not failure.failed:
        with failure.capture():  # keep taking part: step 4 makes every rank raise
            forwards, answers = chunk_owner_step(inbox.values(), world, balance=balance, replies=replies)
            for d in set(forwards) | set(answers):
                outgoing[d] = _frame(forwards.get(d, b""), answers.get(d, b""))
    del inbox
    inbox = dist.all_to_all_bytes(outgoing, group)
    result = ExchangeResult(digest=routed.digest if routed is not None else 0)
    problems: List[str] = []
    forwards_in: List[bytes] = []
    detail: List[int] = []
    if not failure.failed:
        with failure.capture():
            parts = [_unframe(m) for m in inbox.values()]
            forwards_in = [f for f, _ in parts if f]
            answers_in = [a for _, a in parts if a]
            problems, result.summaries = key_owner_step(forwards_in, validate=validate, whole_grids=replies)
            detail = detail_requests(answers_in)
            if replies:
                result.to_write = assign_writes(metas, answers_in)
    d = result.digest
    sums = dist.all_reduce_ints(
        [len(problems), int(failure.failed), len(detail), d & 0xFFFFF, (d >> 20) & 0xFFFFF, (d >> 40) & 0xFFFFF],
        "sum", group,
    )
    if sums[1]:
        _raise_errors(failure, group, context)
    if sums[2]:
        # detail round (only when some copy differs from its main replica, or a chunk has no
        # main): those records in full to their chunk owners, holdings on to the key owners
        # every rank learns the global count (a rank with no problems of its own must still
        # take part in collecting them, or the ranks would enter different collectives)
        problems, sums[0] = _detail_round(metas, detail, forwards_in, rank, world, group, validate, result, context,
                                          replies)
    if sums[0]:
        raise_problems(problems, group, problems_header, on_problems)
    result.token = digest64(f"{world}/{sums[3]}/{sums[4]}/{sums[5]}".encode()) or 1
    if want_layout:
        mine = encode_shards([metas[i] for i in result.to_write], rank)
        result.layout = [m for msg in dist.all_gather_bytes(mine, group) for m in decode_shards(msg)]
    if purpose is not None:  # the latest structure per purpose (a load's request check: its identity only)
        result.identity = identity
        _last[purpose] = result if replies else ExchangeResult(digest=result.digest, token=result.token, identity=identity)
    return result


def _detail_round(
    metas: Sequence[ShardMeta], detail: List[int], forwards_in: List[bytes], rank: int, world: int, group: Group,
    validate: bool, result: ExchangeResult, context: str, whole_grids: bool = True,
) -> Tuple[List[str], int]:
    """The detail round: this rank's problems and the number of problems on all ranks."""
    failure = Failure()
    outgoing: Dict[int, bytes] = {}
    with failure.capture():
        outgoing = route_shards(metas, rank, world, only=detail).messages
    inbox = dist.all_to_all_bytes(outgoing, group)
    forwards: Dict[int, bytes] = {}
    if not failure.failed:
        with failure.capture():
            forwards, _ = chunk_owner_step(inbox.values(), world, replies=False)
    inbox = dist.all_to_all_bytes(forwards, group)
    problems: List[str] = []
    if not failure.failed:
        with failure.capture():
            problems, result.summaries = key_owner_step(forwards_in + list(inbox.values()), validate=validate,
                                                        whole_grids=whole_grids)
    count, failed = dist.all_reduce_ints([len(problems), int(failure.failed)], "sum", group)
    if failed:
        _raise_errors(failure, group, context)
    return problems, count


def raise_problems(problems: List[str], group: Group, header: str, on_problems: Optional[Callable[[], None]] = None) -> None:
    """Collect every owner's problems on the coordinator, which broadcasts one message; all raise it. Collective."""
    coord = dist.coordinator_rank(group)
    gathered = dist.gather_object(problems, dst=coord, group=group)
    text = None
    if gathered is not None:
        flat = sorted(p for ps in gathered for p in ps)
        more = len(flat) - MAX_PROBLEMS_SHOWN
        shown = flat[:MAX_PROBLEMS_SHOWN] + ([f"... and {more} more problems"] if more > 0 else [])
        text = header + ":\n  " + "\n  ".join(shown)
        if on_problems is not None:
            on_problems()
    text = dist.broadcast_object(text, src=coord, group=group)
    raise ShardingIntegrityError(text)


def forget_plans(purpose: Optional[str] = None) -> None:
    """Drop the cached plans (the next save exchanges metadata again, the next load checks its
    request again); only that of ``purpose`` ("save", "load") when given."""
    if purpose is None:
        _last.clear()
    else:
        _last.pop(purpose, None)
