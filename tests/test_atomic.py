"""The one atomic-replace rule (``storage/claim.py``'s ``replace``), used by ``save(overwrite=True)`` and the tools.

A failure injected at every step of :func:`replace` (each fsync, the exchange, each rename, the
removal of the old content), for every kind of replacement (file over file, directory over
directory, either over the other, nothing there yet), with and without an atomic exchange:

* a crash *at* the step (the state on disk just before it runs, what a ``SIGKILL`` there leaves)
  holds the old or the new content complete: at the target, or - only between the two renames of
  the fallback - at ``<target>.old-*`` and the staged name;
* an exception raised *by* the step leaves the target holding the old or the new content complete,
  and the staged path holding the other one (for the caller to discard).

``tests/test_crash.py`` kills real saves at the same steps; the end of this file runs the tools'
commit through ``convert`` (durability order, a second rename that fails) and a save whose second
rename fails.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

import ckpt_integration as ci
from ckpt_integration.cli import main
from ckpt_integration.storage import claim as atomic, filesystem
from ckpt_integration.storage.filesystem import storage_for

KINDS = ["file>file", "dir>dir", "dir>file", "file>dir", "dir>none", "file>none"]


def _make(path: str, kind: str, version: str) -> None:
    if kind == "dir":
        os.mkdir(path)
        for name in ("a", "b"):
            with open(os.path.join(path, name), "w") as f:
                f.write(version)
    elif kind == "file":
        with open(path, "w") as f:
            f.write(version)


def _version(path: str):
    """``"old"`` / ``"new"`` when ``path`` holds that content complete, None if nothing, else ``"damaged"``."""
    if not os.path.lexists(path):
        return None
    if os.path.isdir(path):
        names = sorted(os.listdir(path))
        if names != ["a", "b"]:
            return "damaged"
        versions = {open(os.path.join(path, n)).read() for n in names}
        return versions.pop() if len(versions) == 1 else "damaged"
    return open(path).read()


def _check_crash_state(parent: str, target: str, staged: str, had_old: bool) -> None:
    """What a crash right now would leave: the old or the new content complete, nothing damaged."""
    at_target = _version(target)
    others = {n: _version(os.path.join(parent, n)) for n in os.listdir(parent) if n != os.path.basename(target)}
    assert "damaged" not in others.values() and at_target != "damaged", (at_target, others)
    if at_target in ("old", "new"):
        return
    if not had_old:  # a first write: nothing lost while the new content is still at its staged name
        assert _version(staged) == "new"
        return
    # only between the fallback's renames: the old one aside, the new one still staged
    olds = [n for n in others if n.startswith(os.path.basename(target) + ".old-")]
    assert len(olds) == 1 and others[olds[0]] == "old" and _version(staged) == "new", (at_target, others)


class _Fault(OSError):
    pass


def _steps(monkeypatch, exchange: bool, on_step):
    """Route every step of ``replace`` through ``on_step(name)`` before it runs."""
    real = {n: getattr(filesystem.Storage, n) for n in ("rename", "exchange", "sync_dir", "rmtree", "remove")}
    real_sync_tree = atomic.sync_tree

    def wrap(name):
        def step(self, *args):
            on_step(name)
            if name == "exchange" and not exchange:
                return False
            return real[name](self, *args)
        return step

    for name in real:
        monkeypatch.setattr(filesystem.Storage, name, wrap(name))

    def sync_tree(path):
        on_step("sync_tree")
        real_sync_tree(path)

    monkeypatch.setattr(atomic, "sync_tree", sync_tree)


def _setup(tmp_path, kind):
    new_kind, old_kind = kind.split(">")
    parent = str(tmp_path / "p")
    os.mkdir(parent)
    target, staged = os.path.join(parent, "out"), os.path.join(parent, ".out.staged")
    _make(target, old_kind, "old")
    _make(staged, new_kind, "new")
    return parent, target, staged, old_kind != "none"


def _clean_run_steps(tmp_path, monkeypatch, kind, exchange):
    seen = []
    _steps(monkeypatch, exchange, seen.append)
    (tmp_path / "clean").mkdir()
    parent, target, staged, _ = _setup(tmp_path / "clean", kind)
    atomic.replace(storage_for(target)[0], staged, target)
    assert _version(target) == "new" and not os.path.lexists(staged)
    assert sorted(os.listdir(parent)) == ["out"], "old content left behind"
    monkeypatch.undo()
    return seen


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_crash_or_a_failure_at_every_step_keeps_old_or_new_complete(tmp_path, monkeypatch, kind, exchange):
    steps = _clean_run_steps(tmp_path, monkeypatch, kind, exchange)
    assert steps[0] == "sync_tree" and "sync_dir" in steps  # data durable first, the rename made durable after
    for i in range(len(steps)):
        case = tmp_path / f"fault{i}"
        case.mkdir()
        parent, target, staged, had_old = _setup(case, kind)
        count = [0]

        def on_step(name, i=i):
            _check_crash_state(parent, target, staged, had_old)  # a SIGKILL right here
            count[0] += 1
            if count[0] == i + 1:
                raise _Fault(errno.EIO, f"injected at step {i} ({name})")

        _steps(monkeypatch, exchange, on_step)
        storage = storage_for(target)[0]
        try:
            atomic.replace(storage, staged, target)
            raised = False
        except _Fault:
            raised = True
        monkeypatch.undo()
        at_target = _version(target)
        if steps[i] in ("rmtree", "remove"):
            assert not raised and at_target == "new"  # the new one is in place: debris is logged, not raised
            continue
        assert raised, steps[i]
        if at_target == "new":
            assert _version(staged) in ("old", None)  # after an exchange: the old one, for the caller to discard
        else:
            assert at_target == ("old" if had_old else None), (steps[i], at_target)
            assert _version(staged) == "new", steps[i]  # untouched: the caller may retry or discard it
            assert sorted(os.listdir(parent)) == sorted(n for n in ("out", ".out.staged") if os.path.lexists(
                os.path.join(parent, n))), "an old copy left aside after the failure"


def test_failed_move_back_names_where_the_old_content_is(tmp_path, monkeypatch):
    parent, target, staged, _ = _setup(tmp_path, "dir>dir")
    calls = []

    def rename(self, a, b):
        calls.append((a, b))
        if len(calls) >= 2:  # the new one in, and then the old one back: both fail
            raise _Fault(errno.EIO, "injected")
        os.rename(a, b)

    monkeypatch.setattr(filesystem.Storage, "exchange", lambda self, a, b: False)
    monkeypatch.setattr(filesystem.Storage, "rename", rename)
    with pytest.raises(ci.errors.CheckpointWriteError, match=r"old content could not be moved back .* complete at .*out\.old-"):
        atomic.replace(storage_for(target)[0], staged, target)
    old = calls[0][1]
    assert _version(old) == "old" and _version(staged) == "new" and not os.path.lexists(target)


def test_object_stores_refuse_a_replace():
    storage, url = storage_for("memory://bucket/out")
    with pytest.raises(ci.CheckpointingException, match="object stores have no rename"):
        atomic.replace(storage, url + ".tmp", url)


# --------------------------------------------------------------------------- through the tools
def _checkpoint(path) -> None:
    sd = {"w": ci.ShardedTensor.from_rank_offsets("w", torch.arange(12.0).reshape(3, 4)), "epoch": 1}
    ci.save(sd, str(path), durable=False)


def _fsync_log(monkeypatch, log):
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(a, b):
        log.append(("rename", os.fspath(a), os.fspath(b)))
        real_rename(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)


@pytest.mark.parametrize("to", ["safetensors", "torch"])
def test_tools_output_is_durable_before_it_is_renamed_into_place(tmp_path, monkeypatch, to):
    src, out = tmp_path / "ckpt", tmp_path / ("out" if to == "safetensors" else "out.pt")
    _checkpoint(src)
    log = []
    _fsync_log(monkeypatch, log)
    assert main(["convert", str(src), str(out), "--to", to, "--quiet"]) == 0
    monkeypatch.undo()
    renames = [i for i, e in enumerate(log) if e[0] == "rename" and e[2] == str(out)]
    assert len(renames) == 1, log
    synced = {e[1] for e in log[: renames[0]] if e[0] == "fsync"}
    staged = log[renames[0]][1]
    files = [os.path.join(r, n) for r, _, ns in os.walk(out) for n in ns] if out.is_dir() else [str(out)]
    for f in files:  # every file, fsync'ed under its staged name before the rename
        assert os.path.join(staged, os.path.relpath(f, out)) in synced if out.is_dir() else staged in synced, (f, log)
    assert ("fsync", str(tmp_path)) in log[renames[0] + 1:], "parent directory not fsync'ed after the rename"


def test_tools_failed_second_rename_keeps_the_old_output(tmp_path, monkeypatch, capsys):
    """Before the shared module, the tools' two renames had no way back: OUT was left missing and
    the new output was discarded with it."""
    src, out = tmp_path / "ckpt", tmp_path / "out"
    _checkpoint(src)
    assert main(["convert", str(src), str(out), "--to", "safetensors", "--quiet"]) == 0
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    real_rename, calls = os.rename, []

    def rename(a, b):
        calls.append(b)
        if len(calls) == 2:  # old OUT moved aside; the new one cannot be moved in
            raise OSError(errno.EIO, "Input/output error (injected)", b)
        real_rename(a, b)

    monkeypatch.setattr(filesystem, "exchange_paths", lambda a, b: False)
    monkeypatch.setattr(os, "rename", rename)
    assert main(["convert", str(src), str(out), "--to", "safetensors", "--overwrite", "--quiet"]) == 2
    monkeypatch.undo()
    assert "injected" in capsys.readouterr().err
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "out"], "debris left behind"


def test_save_overwrite_whose_second_rename_fails_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    """Before the shared module, ``save(overwrite=True)``'s fallback left the path empty (the old
    checkpoint aside at ``.old-*``) and the failed save's cleanup deleted the new one."""
    path = str(tmp_path / "ckpt")
    _checkpoint(path)
    calls = []
    real_rename = filesystem.Storage.rename

    def rename(self, a, b):
        calls.append(b)
        if len(calls) == 2:
            raise OSError(errno.EIO, "Input/output error (injected)", b)
        real_rename(self, a, b)

    monkeypatch.setattr(filesystem.Storage, "exchange", lambda self, a, b: False)
    monkeypatch.setattr(filesystem.Storage, "rename", rename)
    sd = {"w": ci.ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4)), "epoch": 2}
    with pytest.raises(OSError, match="injected"):
        ci.save(sd, path, overwrite=True, durable=False)
    monkeypatch.undo()
    out = ci.load({"w": ci.ShardedTensor.from_rank_offsets("w", torch.empty(3, 4))}, path)
    assert out["epoch"] == 1 and torch.equal(out["w"], torch.arange(12.0).reshape(3, 4))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_dead_staging_cleanup_leaves_a_users_look_alike_directories_alone(tmp_path):
    """An overwrite save removes ``<dir>.tmp-<id>`` staging directories left by killed saves. It also
    deleted every user directory whose name merely began with ``<dir>.tmp-`` (``model.tmp-backup``),
    and one with the right name holding the user's files: only staging names holding nothing but
    checkpoint files are the library's to delete."""
    path = str(tmp_path / "model")
    _checkpoint(path)
    users = ["model.tmp-backup", "model.tmp-2024-01-01", "model.tmp-", "model.tmp-0123abcd"]
    for name in users:
        os.mkdir(tmp_path / name)
        (tmp_path / name / "important.txt").write_text("user data")
    dead = tmp_path / "model.tmp-deadbeef"  # what a save killed while writing leaves (no marker yet)
    dead.mkdir()
    (dead / "__0_0.distcp").write_bytes(b"partial")
    sd = {"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(3, 4)), "epoch": 2}
    ci.save(sd, path, overwrite=True, durable=False)
    assert sorted(os.listdir(tmp_path)) == sorted(["model"] + users)
    assert all((tmp_path / n / "important.txt").read_text() == "user data" for n in users)
    out = ci.load({"w": ci.ShardedTensor.from_rank_offsets("w", torch.empty(3, 4))}, path)
    assert out["epoch"] == 2 and torch.equal(out["w"], torch.ones(3, 4))


def _locked(path: str) -> int:
    """An fd holding ``flock`` on ``path`` (created), as a running save holds its marker."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_an_overwrite_refused_by_a_running_one_leaves_its_fresh_staging_directory(tmp_path):
    """Of two saves replacing one checkpoint at once, the second removed the first one's staging
    directory (created, its marker not written yet: it looked dead) before finding the checkpoint
    locked, so both failed. The cleanup now runs only once this save holds the lock."""
    path = str(tmp_path / "ckpt")
    _checkpoint(path)
    fd = _locked(os.path.join(path, "ckpt_integration.json"))  # the running save's claim of the checkpoint
    fresh = tmp_path / "ckpt.tmp-0123abcd"
    fresh.mkdir()  # the running save's staging directory, just made
    try:
        with pytest.raises(ci.SaveConflictError, match="replacing it right now"):
            ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(3, 4))}, path, overwrite=True, durable=False)
        assert fresh.is_dir()
    finally:
        os.close(fd)
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(3, 4))}, path, overwrite=True, durable=False)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # (dead now: removed by the next save)


def test_a_new_directory_another_save_is_claiming_is_refused_as_a_conflict(tmp_path):
    """Two saves into one new directory at once: the second saw the first one's temporary marker
    file and said the directory held files this library did not write, telling the user to remove
    them. A temporary marker that is locked is a save claiming the directory (a conflict); one left
    by a save killed while writing its marker is cleaned up."""
    d = tmp_path / "ckpt"
    d.mkdir()
    temp = str(d / "ckpt_integration.json.tmp-4242-17")
    sd = {"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(3, 4))}
    fd = _locked(temp)
    try:
        with pytest.raises(ci.SaveConflictError, match="another save started writing there at the same time"):
            ci.save(sd, str(d), durable=False)
        assert os.path.exists(temp)
    finally:
        os.close(fd)
    ci.save(sd, str(d), durable=False)  # the writer is gone: its temporary marker is debris
    out = ci.load({"w": ci.ShardedTensor.from_rank_offsets("w", torch.empty(3, 4))}, str(d))
    assert torch.equal(out["w"], torch.ones(3, 4)) and not os.path.exists(temp)


@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_overwrite_through_a_file_url_replaces_the_checkpoint(tmp_path, backend):
    """``save(overwrite=True)`` to a ``file://`` URL staged and committed the new checkpoint, then
    failed to put it in place (the swap was given the URL, not the path): the new one was lost."""
    url = "file://" + str(tmp_path / "ckpt")
    for v in (1.0, 2.0):
        ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.full((3, 4), v)), "v": v}, url,
                sharded_strategy=backend, overwrite=v > 1, durable=False)
    out = ci.load({"w": ci.ShardedTensor.from_rank_offsets("w", torch.empty(3, 4))}, url)
    assert out["v"] == 2.0 and torch.equal(out["w"], torch.full((3, 4), 2.0))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_an_overwrite_through_a_symbolic_link_replaces_the_name_and_says_so(tmp_path, caplog):
    """``run/latest -> disk/iter``: an overwrite puts the new checkpoint in place of the link (as a
    rename replaces a name) and the link's target keeps the old one; that surprised users who
    expected the target replaced, so the save now says it, naming both."""
    (tmp_path / "disk").mkdir()
    (tmp_path / "run").mkdir()
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(4)), "step": 1}, str(tmp_path / "disk" / "iter"))
    os.symlink(tmp_path / "disk" / "iter", tmp_path / "run" / "latest")
    with caplog.at_level("WARNING", logger="ckpt_integration"):
        ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.full((4,), 2.0)), "step": 2},
                str(tmp_path / "run" / "latest"), overwrite=True)
    assert any("is a symbolic link to" in r.getMessage() and "keeps the old one" in r.getMessage() for r in caplog.records)
    assert not os.path.islink(tmp_path / "run" / "latest")
    assert ci.load_common_state_dict(str(tmp_path / "run" / "latest"))["step"] == 2
    assert ci.load_common_state_dict(str(tmp_path / "disk" / "iter"))["step"] == 1


def test_a_failed_save_removes_the_directory_it_made(tmp_path, monkeypatch):
    """A save that failed removed its files but not the directory it had made: an empty
    ``epoch=0-step=8.ckpt`` stayed for good, and Lightning saved the redone step as ``...-v1.ckpt``
    beside it. A directory the caller made (empty) stays."""
    import errno

    from ckpt_integration.execution import save as save_mod

    def boom(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(save_mod, "write_data_files", boom)
    (tmp_path / "mine").mkdir()
    for name in ("epoch=0-step=8.ckpt", "mine"):
        with pytest.raises(OSError, match="injected"):
            ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(4))}, str(tmp_path / name))
    assert sorted(os.listdir(tmp_path)) == ["mine"] and os.listdir(tmp_path / "mine") == []


def test_paths_a_save_cannot_use_are_refused_before_anything_is_written(tmp_path):
    """A dangling symbolic link raised a bare ``FileExistsError``; an overwrite of ``<dir>/.`` (or of a
    mount point) wrote the whole new checkpoint into a staging directory inside the old one, then
    failed at the swap. Both are refused at once, saying why; the old checkpoint stays."""
    os.symlink(tmp_path / "not_made_yet", tmp_path / "link")
    with pytest.raises(ci.CheckpointingException, match="symbolic link to .*not_made_yet, which does not exist"):
        ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(4))}, str(tmp_path / "link"))
    os.symlink("loop_b", tmp_path / "loop_a")
    os.symlink("loop_a", tmp_path / "loop_b")
    with pytest.raises(ci.CheckpointingException, match="symbolic link to loop_b, which leads back to itself"):
        ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(4))}, str(tmp_path / "loop_a"))
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(4)), "step": 1}, str(tmp_path / "ck"))
    with pytest.raises(ci.CheckpointingException, match="overwrite=True cannot replace .*mount point or a path ending in '.'"):
        ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(4)), "step": 2}, str(tmp_path / "ck") + "/.",
                overwrite=True)
    assert ci.load_common_state_dict(str(tmp_path / "ck"))["step"] == 1
    assert not [n for n in os.listdir(tmp_path / "ck") if ".tmp-" in n]  # (no staging made inside it)


def test_an_overwrite_of_a_directory_with_a_name_near_the_limit_works(tmp_path):
    """A checkpoint directory named with 243-255 bytes could be saved but never overwritten: the staging
    sibling ``<name>.tmp-xxxxxxxx`` exceeded the filesystem's 255 bytes ("file name too long"). Such a
    name's siblings are cut short and tagged with its hash; leftovers are still found and removed."""
    from ckpt_integration.storage import claim

    path = str(tmp_path / ("é" + "c" * 250))  # (252 bytes in UTF-8)
    for step in (1, 2, 3):
        ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.full((4,), float(step))), "step": step}, path,
                overwrite=step > 1)
        assert ci.load_common_state_dict(path)["step"] == step
    dead = claim.staging_name(path, "0123456789abcdef")  # a leftover of a killed overwrite
    assert len(os.path.basename(dead).encode()) <= 255
    os.mkdir(dead)
    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.full((4,), 4.0)), "step": 4}, path, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path)]


def test_the_swap_makes_the_directory_the_kernel_renamed_in_durable(tmp_path, monkeypatch):
    """``<link>/../ck`` names ``ck`` beside the link's target, as the kernel reads it; the swap's
    parent-directory fsync took ``abspath``'s textual reading (beside the link itself): after a crash the
    rename could be lost although the save had returned."""
    from ckpt_integration.storage import claim

    (tmp_path / "real" / "sub").mkdir(parents=True)
    os.symlink(tmp_path / "real" / "sub", tmp_path / "link")
    path = f"{tmp_path}/link/../ck"
    synced = []
    real_sync = claim._sync_parent
    monkeypatch.setattr(claim, "_sync_parent", lambda storage, parent, durable: (synced.append(parent),
                                                                                real_sync(storage, parent, durable)))
    for step in (1, 2):
        ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(4)), "step": step}, path, overwrite=step > 1)
    assert (tmp_path / "real" / "ck" / "metadata.json").exists() and not (tmp_path / "ck").exists()
    assert synced and {os.path.realpath(p) for p in synced} == {os.path.realpath(tmp_path / "real")}, synced


def test_the_cleanup_of_a_failed_save_removes_its_commit_marker_first(tmp_path, monkeypatch):
    """A save that fails after its ``metadata.json`` is in place (its commit reported as failed) is cleaned up
    file by file; the marker went last (sorted names), so a cleanup cut short (a failing delete, a kill) left a
    "complete" checkpoint without its data, which listings and ``ckpt_path="last"`` then took."""
    from ckpt_integration.execution.save import cleanup_failed
    from ckpt_integration.storage.filesystem import Storage, locate

    ci.save({"w": ci.ShardedTensor.from_rank_offsets("w", torch.ones(4))}, str(tmp_path / "ck"))
    removed = []
    real = Storage.remove_any

    def remove_any(self, path):
        removed.append(os.path.basename(path))
        if len(removed) > 1:
            raise OSError(5, "I/O error")  # (the cleanup is cut short after its first delete)
        return real(self, path)

    monkeypatch.setattr(Storage, "remove_any", remove_any)
    cleanup_failed(locate(str(tmp_path / "ck")), staging=False)
    assert removed[0] == "metadata.json", removed
    assert ci.list_checkpoints(str(tmp_path)) == []
