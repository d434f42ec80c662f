"""execution.transfer.Transfers: the one way ranks hand each other bytes outside a collective (shared-read
loads, the memory tier's copies). 2 gloo ranks; messages cut in pieces, buffers bounded and reused,
receives completed in order, and a failure raised only after every posted transfer was waited for."""

import pytest
import torch

from tests.dist_utils import run_distributed


def _exchange(rank, world):
    import ckpt_integration.execution.transfer as tr
    from ckpt_integration.execution import dist

    tr.CHUNK = 1000  # (small pieces: one tensor of 4,000 bytes goes as 4 messages of 1,000)
    data = [torch.arange(i * 1000, i * 1000 + 1000, dtype=torch.int32) for i in range(6)]
    got, order, live = [], [], []
    moves = tr.Transfers(None, 7, budget=8000, seconds=lambda s: None)
    real_buffer = moves.buffer

    def buffer(n):
        b = real_buffer(n)
        live.append(moves.bytes + n)  # (bytes in flight once this buffer is in use)
        return b

    moves.buffer = buffer
    for i, d in enumerate(data):
        nbytes = d.numel() * 4
        base = moves.buffer(nbytes)
        if rank == 0:
            base[:nbytes].view(torch.int32).copy_(d)
            moves.send(base[:nbytes], 1, base)
        else:
            def done(i=i, base=base, nbytes=nbytes):
                got.append(base[:nbytes].view(torch.int32).clone())
                order.append(i)
            moves.recv(base[:nbytes], 0, done, base)
        if i == 0:
            assert len(moves.pending) == 4  # (4,000 bytes in pieces of 1,000)
    moves.settle()
    assert moves.bytes == 0 and not moves.pending
    assert max(live) <= 8000, live  # (budget: two 4,000-byte buffers at most)
    assert len({b.data_ptr() for b in moves.free}) <= 2  # (reused, not one per transfer)
    if rank == 1:
        assert order == list(range(6)) and all(torch.equal(g, d) for g, d in zip(got, data))
    # empty tensors move nothing on either side; an error in a completion is noted, the rest go on
    notes = []
    moves = tr.Transfers(None, 8, note=notes.append)
    out = torch.zeros(3000, dtype=torch.uint8)
    if rank == 0:
        moves.send(torch.empty(0), 1)
        moves.send(torch.full((3000,), 5, dtype=torch.uint8), 1)
        moves.send(torch.full((3000,), 6, dtype=torch.uint8), 1)
    else:
        moves.recv(torch.empty(0), 0, lambda: notes.append("empty"))
        moves.recv(out, 0, lambda: (_ for _ in ()).throw(ValueError("unpack failed")))
        second = torch.zeros(3000, dtype=torch.uint8)
        moves.recv(second, 0)
    moves.settle()
    if rank == 1:
        assert notes[0] == "empty" and isinstance(notes[1], ValueError), notes
        assert bool((out == 5).all()) and bool((second == 6).all())
    dist.barrier()


def test_transfers_cut_bound_reuse_and_complete_in_order():
    run_distributed(_exchange, 2, timeout=120)


def test_a_failed_wait_is_raised_after_the_others_were_waited_for():
    from ckpt_integration.execution.transfer import Transfers

    waited = []

    class Work:
        def __init__(self, i, fails=False):
            self.i, self.fails = i, fails

        def wait(self):
            waited.append(self.i)
            if self.fails:
                raise RuntimeError(f"peer lost at {self.i}")

    moves = Transfers(None, 1)
    done = []
    for i in range(4):
        moves._post([Work(i, fails=i == 1)], torch.zeros(2), lambda i=i: done.append(i), torch.zeros(2))
    with pytest.raises(RuntimeError, match="peer lost at 1"):
        moves.settle()
    assert waited == [0, 1, 2, 3] and done == [0] and not moves.pending and moves.bytes == 0
