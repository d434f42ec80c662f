"""A save killed with SIGKILL at every step of the commit protocol never damages an earlier checkpoint.

Each case runs a real save in a child process that kills itself (``SIGKILL``, no cleanup, no
``finally``) at one precise point: while writing data, before the commit marker, right before and
right after the directory swap of ``overwrite=True``, and between the two renames of the fallback
swap. The parent then checks what a user would find at the path.
"""

import os
import signal
import sys
import textwrap

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration.errors import CheckpointNotFoundError, IncompleteCheckpointError
from tests import forked
from tests.dist_utils import scaled_timeout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(version):
    g = torch.Generator().manual_seed(version)
    return {
        **{f"w{i}": ci.ShardedTensor.from_rank_offsets(f"w{i}", torch.randn(64, 64, generator=g)) for i in range(6)},
        "iteration": version,
    }


def _request():
    return {f"w{i}": ci.ShardedTensor.from_rank_offsets(f"w{i}", torch.empty(64, 64)) for i in range(6)}


def _assert_is_version(path, version):
    out = ci.load(_request(), path)
    want = _state(version)
    assert out["iteration"] == version
    for i in range(6):
        assert torch.equal(out[f"w{i}"], want[f"w{i}"].data), f"w{i} differs from version {version}"


# The child: save version 2 to ``path`` and SIGKILL itself at ``point``.
CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {root!r})
    import ckpt_integration.storage.checkpoint_dir as ckdir
    from ckpt_integration.storage import filesystem
    from tests.test_crash import _state
    import ckpt_integration as ci

    path, point, overwrite = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    backend = sys.argv[4] if len(sys.argv) > 4 else "torch_dist"

    def die(*_a, **_k):
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "mid_data":  # the second fsync: one data file is durable, the rest is not
        real_fsync, calls = os.fsync, []
        def fsync(fd):
            calls.append(fd)
            if len(calls) == 2:
                die()
            real_fsync(fd)
        os.fsync = fsync
    elif point == "before_commit_marker":
        ckdir.write_config = die
    elif point == "before_swap":
        filesystem.Storage.exchange = die
    elif point == "after_swap":
        filesystem.Storage.rmtree = die
    elif point == "in_zarr_arrays":  # the first array made, the second not yet
        import zarr
        real_create, made = zarr.create_array, []
        def create_array(*a, **k):
            made.append(1)
            if len(made) == 2:
                die()
            return real_create(*a, **k)
        zarr.create_array = create_array
    elif point == "between_renames":  # the fallback for filesystems without an atomic exchange
        filesystem.Storage.exchange = lambda self, a, b: False
        real_rename, calls = filesystem.Storage.rename, []
        def rename(self, a, b):
            calls.append(a)
            if len(calls) == 2:
                die()
            real_rename(self, a, b)
        filesystem.Storage.rename = rename
    ci.save(_state(2), path, overwrite=overwrite, sharded_strategy=backend)
    print("finished without being killed")
    """
)


def _save_and_kill(tmp_path, path, point, overwrite, backend="torch_dist"):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=ROOT))
    # forked with ckpt_integration imported (tests/forked.py): a process of its own, killed as before
    proc = forked.run([sys.executable, str(script), path, point, "1" if overwrite else "0", backend],
                      timeout=scaled_timeout(120), cwd=ROOT)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)


@pytest.mark.parametrize("point", ["mid_data", "before_commit_marker", "before_swap"])
def test_killed_overwrite_keeps_the_old_checkpoint(tmp_path, point):
    path = str(tmp_path / "ckpt")
    ci.save(_state(1), path)
    _save_and_kill(tmp_path, path, point, overwrite=True)
    _assert_is_version(path, 1)
    # the next save over it works and leaves no debris from the killed one
    ci.save(_state(3), path, overwrite=True)
    _assert_is_version(path, 3)
    # (a staging directory killed before its swap is committed: it was left for good, a full checkpoint's size)
    assert [n for n in os.listdir(tmp_path) if n.startswith("ckpt.")] == []


def test_killed_right_after_the_swap_has_the_new_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    ci.save(_state(1), path)
    _save_and_kill(tmp_path, path, "after_swap", overwrite=True)
    _assert_is_version(path, 2)
    # the old checkpoint the swap moved to the staging name is removed by the next save over the path
    assert [n for n in os.listdir(tmp_path) if n.startswith("ckpt.tmp-")]
    ci.save(_state(3), path, overwrite=True)
    _assert_is_version(path, 3)
    assert [n for n in os.listdir(tmp_path) if n.startswith("ckpt.")] == []


def test_killed_between_fallback_renames_names_both_checkpoints(tmp_path):
    path = str(tmp_path / "ckpt")
    ci.save(_state(1), path)
    _save_and_kill(tmp_path, path, "between_renames", overwrite=True)
    with pytest.raises(CheckpointNotFoundError, match=r"overwrite=True was interrupted.*ckpt\.old-.*ckpt\.tmp-") as ei:
        ci.load(_request(), path)
    msg = str(ei.value)
    old = next(p for p in msg.split(": ", 2)[-1].split(" (")[0].split(", ") if ".old-" in p)
    new = next(p for p in msg.split(": ", 2)[-1].split(" (")[0].split(", ") if ".tmp-" in p)
    _assert_is_version(old, 1)  # nothing lost: both are complete
    _assert_is_version(new, 2)


@pytest.mark.parametrize("point", ["mid_data", "before_commit_marker"])
def test_killed_first_save_is_incomplete_and_can_be_redone(tmp_path, point):
    path = str(tmp_path / "ckpt")
    _save_and_kill(tmp_path, path, point, overwrite=False)
    with pytest.raises(IncompleteCheckpointError, match="incomplete checkpoint"):
        ci.load(_request(), path)
    ci.save(_state(2), path)  # the debris of the killed save is cleaned up and replaced
    _assert_is_version(path, 2)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_zarr_save_killed_while_it_creates_its_arrays_is_cleaned_up_by_the_next(tmp_path, overwrite):
    """The arrays' folders were made before the index that names them: a zarr save killed in between left
    folders the next save took for foreign files, refusing every save into the path (or, for an
    overwrite, keeping the staging directory for good)."""
    path = str(tmp_path / "ckpt")
    if overwrite:
        ci.save(_state(1), path, sharded_strategy="zarr")
    _save_and_kill(tmp_path, path, "in_zarr_arrays", overwrite=overwrite, backend="zarr")
    ci.save(_state(3), path, overwrite=overwrite, sharded_strategy="zarr")
    _assert_is_version(path, 3)
    assert [n for n in os.listdir(tmp_path) if n.startswith("ckpt.")] == []

