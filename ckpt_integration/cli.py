"""``ckpt-integration``: inspect, verify, convert, export and diff checkpoints from the shell.

Runs on one process without a GPU or ``torch.distributed``; see ``docs/cli.md``.

Exit codes: 0 success (``verify``: undamaged, ``diff``: identical), 1 damage found
(``verify``: damaged, incomplete or refused files) or differences found (``diff``), 2 usage
error, unreadable input or not a checkpoint (``verify`` of a missing path, an empty directory
or a directory of checkpoints),
141 (128 + SIGPIPE, as a shell reports a process killed by it) when stdout was closed
early, e.g. ``ckpt-integration inspect --json DIR | head -1`` (nothing is printed then).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import traceback
from typing import Any, Dict, Iterable, List, Optional, TextIO

from . import tools
from .errors import CheckpointingException
from .tools import format_size
from .version import __version__

EXIT_OK, EXIT_FAIL, EXIT_ERROR = 0, 1, 2
EXIT_BROKEN_PIPE = 128 + 13  # 128 + SIGPIPE (signal.SIGPIPE does not exist on Windows)


def _progress_factory(quiet: bool):
    """A tqdm factory writing to stderr, disabled with --quiet or when stderr is not a TTY."""
    if quiet or not sys.stderr.isatty():
        return tools.no_progress
    try:
        import tqdm  # noqa: F401
    except ImportError:  # pragma: no cover - tqdm is a dependency of the CLI but optional for the library
        return tools.no_progress
    return _bar_factory(sys.stderr)


# tqdm's own scaling (unit_scale) prints decimal kB/MB, or "MB" for 2**20 with unit_divisor=1024;
# byte bars use tools.format_size instead, the binary units (KiB, MiB, GiB) of every summary.
_BYTES_BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


def _bar_factory(file: TextIO):
    """A progress-bar factory (``tools.ProgressFactory``) drawing tqdm bars on ``file``."""
    from tqdm import tqdm

    class BinaryBytesBar(tqdm):
        @property
        def format_dict(self):
            d = super().format_dict
            rate = d["rate"] or (d["n"] / d["elapsed"] if d["elapsed"] else None)
            # extra keys of format_dict override tqdm's own strings in the bar format
            d.update(n_fmt=format_size(d["n"]), total_fmt=format_size(d["total"]) if d["total"] else "?",
                     rate_fmt=f"{format_size(rate)}/s" if rate else "? B/s")
            return d

    def factory(iterable: Optional[Iterable[Any]] = None, **kwargs: object) -> Any:
        if kwargs.get("unit") == "B":
            kwargs.update(unit_scale=False, bar_format=_BYTES_BAR_FORMAT)
            return BinaryBytesBar(iterable, file=file, dynamic_ncols=True, leave=False, **kwargs)
        return tqdm(iterable, file=file, dynamic_ncols=True, leave=False, **kwargs)

    return factory


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``ckpt-integration`` (subcommands inspect, verify, convert, diff)."""
    p = argparse.ArgumentParser(
        prog="ckpt-integration",
        description="Inspect, verify, convert and compare distributed checkpoints (no GPU needed): checkpoint "
                    "directories of either backend, torch_dist (also Megatron-Core's and PyTorch DCP's) or zarr, "
                    "torch.save files and safetensors files or folders.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def common(sp: argparse.ArgumentParser, json_flag: bool = True) -> None:
        sp.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
        sp.add_argument("--trusted", action="store_true",
                        help="allow arbitrary pickled objects (runs code from the checkpoint; only for files you trust)")
        if json_flag:
            sp.add_argument("--json", action="store_true", help="machine-readable JSON on stdout")

    sp = sub.add_parser("inspect", help="tensor tree, shapes, dtypes, shard layout, objects, common state")
    sp.add_argument("path", metavar="DIR",
                    help="checkpoint directory (torch_dist or zarr), or a torch.save / safetensors file")
    sp.add_argument("--shards", action="store_true", help="list every saved shard with its file and byte range")
    sp.add_argument("--all", action="store_true", dest="show_all",
                    help="list every common-state key and sharded object (large groups are folded by default)")
    common(sp)

    sp = sub.add_parser("verify", help="completeness and checksums; exit 1 when damaged")
    sp.add_argument("path", metavar="DIR", help="checkpoint directory (torch_dist or zarr)")
    sp.add_argument("--state", action="store_true",
                    help="also read every tensor back across its saved chunks and compare its fingerprint with the "
                         "one recorded at save (the state, position by position)")
    sp.add_argument("--memory-budget", default="256MiB", help="largest block of tensor data held by --state (default 256MiB)")
    common(sp)

    sp = sub.add_parser("convert", help="streaming conversion to torch / safetensors / torch_dist / zarr")
    sp.add_argument("src", metavar="SRC", help="checkpoint directory, torch.save file, safetensors file or folder")
    sp.add_argument("out", metavar="OUT", help="output file (torch) or directory (safetensors, torch_dist, zarr)")
    sp.add_argument("--to", required=True, choices=["torch", "safetensors", "torch_dist", "zarr"], help="output format")
    sp.add_argument("--max-shard-size", default="5GB",
                    help="safetensors: largest file (e.g. 5GB, 500MB, 64MiB; default 5GB)")
    sp.add_argument("--memory-budget", default="256MiB",
                    help="largest block of tensor data held in memory (default 256MiB)")
    sp.add_argument("--nested", action="store_true", help="torch: nest keys on '.' instead of a flat dict")
    sp.add_argument("--module", metavar="PKG.MOD:CLASS",
                    help="stock Lightning import: the LightningModule class (imported: runs its code), to carry a "
                         ".ckpt's optimizer state and store tensors as its sharded_state_dict does")
    sp.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    common(sp)

    sp = sub.add_parser("export", help="model weights for stock tools: HF safetensors or a Lightning .ckpt")
    sp.add_argument("src", metavar="DIR", help="checkpoint directory")
    sp.add_argument("out", metavar="OUT", help="output directory (hf) or file (lightning)")
    sp.add_argument("--to", required=True, choices=["hf", "lightning"], help="output format")
    sp.add_argument("--strip-prefix", metavar="PREFIX", help="export the tensors under PREFIX (e.g. model.) without it")
    parts = sp.add_mutually_exclusive_group()
    parts.add_argument("--merge-parts", dest="merge_parts", action="store_const", const=True, default=None,
                       help="without an export recipe: merge X.part0..N groups along axis 0 (fused parameters)")
    parts.add_argument("--keep-parts", dest="merge_parts", action="store_const", const=False,
                       help="export X.partN tensors as stored (no merging, recipe ignored)")
    sp.add_argument("--config", metavar="PATH", help="hf: config.json (or a folder holding one) to copy next to the weights")
    sp.add_argument("--max-shard-size", default="5GB", help="hf: largest file (default 5GB)")
    sp.add_argument("--memory-budget", default="256MiB", help="largest block of tensor data held in memory (default 256MiB)")
    sp.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    common(sp)

    sp = sub.add_parser("diff", help="compare tensors (and, for two checkpoint directories, ShardedObjects and common state) "
                                     "of two checkpoints; exit 1 when different")
    sp.add_argument("a", metavar="A", help="first: checkpoint directory, torch.save file, safetensors file or folder")
    sp.add_argument("b", metavar="B", help="second, any kind A may be (e.g. a conversion of A)")
    sp.add_argument("--memory-budget", default="256MiB", help="largest block compared at once (default 256MiB)")
    common(sp)
    return p


def _import_class(spec: str) -> Any:
    """``pkg.mod:Class`` (or ``pkg.mod.Class``) imported."""
    import importlib

    mod, sep, name = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not mod or not name:
        raise ValueError(f"--module {spec!r}: expected pkg.module:Class")
    try:
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--module {spec!r}: {e}") from None


class _StdoutClosed(Exception):
    """The reader of stdout went away (``| head``); raised instead of a BrokenPipeError from
    writing stdout, so that a broken pipe elsewhere (e.g. remote storage) is still an error."""


_OUT_PIECE = 64 * 1024


def _out(text: str) -> None:
    """Print a line to stdout (every result goes through here).

    Written in pieces: when the reader closes the pipe during one huge write, Python's
    buffered stdout returns a short count without raising, and the rest would vanish
    silently; the next piece raises BrokenPipeError instead.
    """
    text += "\n"
    try:
        for start in range(0, len(text), _OUT_PIECE):
            sys.stdout.write(text[start:start + _OUT_PIECE])
    except BrokenPipeError:
        raise _StdoutClosed() from None


def _flush_stdout() -> None:
    """Flush what is still buffered: a closed pipe often shows up only now."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        raise _StdoutClosed() from None


def _print_json(obj: object) -> None:
    _out(json.dumps(obj, indent=2, default=str))


def _silence_stdout() -> None:
    """After a broken pipe: point stdout's descriptor at devnull, so that the interpreter's
    final flush of the buffered rest does not fail again ("Exception ignored ... BrokenPipeError")."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (e.g. captured in tests)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _first_few(items: List[str], n: int = 3) -> str:
    """``a, b, c and 7 more (--json lists all)``: one short line however many items there are."""
    shown = ", ".join(items[:n])
    return shown if len(items) <= n else f"{shown} and {len(items) - n} more (--json lists all)"


def _by_reason(skipped: List[str]) -> Dict[str, List[str]]:
    """Group ``"'key' (reason)"`` entries by reason: ``{" (reason)": ["'key'", ...]}``."""
    groups: Dict[str, List[str]] = {}
    for entry in skipped:
        m = re.fullmatch(r"(.*?) (\(.*\))", entry, re.S)
        what, reason = (m.group(1), f" {m.group(2)}") if m else (entry, "")
        groups.setdefault(reason, []).append(what)
    return groups


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``ckpt-integration`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    try:
        code = _run(argv)
        _flush_stdout()
        return code
    except _StdoutClosed:  # the standard handling: not an error of ours, say nothing
        _silence_stdout()
        return EXIT_BROKEN_PIPE


def _run(argv: Optional[List[str]]) -> int:
    """:func:`main` without the handling of a closed stdout."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help / --version (0) and usage errors (2)
        return int(e.code or 0)
    progress = _progress_factory(args.quiet)
    try:
        if args.command == "inspect":
            info = tools.inspect_checkpoint(args.path, trusted=args.trusted)
            if args.json:
                _print_json(info)
            else:
                _out(tools.format_inspect(info, show_shards=args.shards, show_all=args.show_all))
            return EXIT_OK
        if args.command == "verify":
            report = tools.verify_checkpoint(args.path, progress=progress, trusted=args.trusted, state=args.state,
                                             memory_budget=args.memory_budget)
            if args.json:
                _print_json(report.to_dict())
            else:
                _out(report.format())
            return EXIT_OK if report.ok else EXIT_ERROR if report.unreadable else EXIT_FAIL
        if args.command == "convert":
            result = tools.convert_checkpoint(
                args.src, args.to, args.out,
                max_shard_size=args.max_shard_size, memory_budget=args.memory_budget,
                overwrite=args.overwrite, trusted=args.trusted, nested=args.nested, progress=progress,
                module=_import_class(args.module) if args.module else None,
            )
            if getattr(result, "source_kind", "") and not args.json:  # a stock Lightning import
                _out(f"imported a stock Lightning checkpoint ({result.source_kind}): resume with a DistCkpt strategy")
                for what in result.not_carried:
                    _out(f"not carried: {what}")
            if args.json:
                _print_json(result.__dict__)
            else:
                _out(f"wrote {result.tensors} tensors ({tools.format_size(result.bytes)}) as {result.to} to "
                     f"{result.output}: {result.file_count} file(s), {tools.format_size(result.file_bytes)}")
                if result.skipped:
                    _out(f"skipped {len(result.skipped)} ShardedObject(s) ({args.to} holds tensors only): "
                         + _first_few(result.skipped))
                for reason, entries in _by_reason(result.skipped_common).items():
                    _out(f"skipped common state{reason}: " + _first_few(entries))
            return EXIT_OK
        if args.command == "export":
            result = tools.export_checkpoint(
                args.src, args.out, args.to, strip_prefix=args.strip_prefix, merge_parts=args.merge_parts,
                config=args.config, max_shard_size=args.max_shard_size, memory_budget=args.memory_budget,
                overwrite=args.overwrite, trusted=args.trusted, progress=progress,
            )
            if args.json:
                _print_json(result.__dict__)
            else:
                _out(f"exported {result.tensors} tensors ({tools.format_size(result.bytes)}) as {result.to} "
                     f"to {result.output}: {', '.join(result.files)}")
                if result.merged:
                    _out(f"merged from parts ({len(result.merged)}): " + ", ".join(result.merged))
                for what in result.skipped:
                    _out(f"not exported: {what}")
            return EXIT_OK
        if args.command == "diff":
            report = tools.diff_checkpoints(args.a, args.b, memory_budget=args.memory_budget,
                                            trusted=args.trusted, progress=progress)
            if args.json:
                _print_json(report.to_dict())
            else:
                _out(report.format())
            return EXIT_OK if report.identical else EXIT_FAIL
    except (CheckpointingException, OSError, ValueError) as e:
        print(f"ckpt-integration {args.command}: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except _StdoutClosed:
        raise  # (main's: a closed stdout is no error of ours)
    except Exception:  # noqa: BLE001 - a bug of ours: exit 1 would read as "damaged" (verify) or "different" (diff)
        traceback.print_exc()
        print(f"ckpt-integration {args.command}: internal error (the traceback above): please report it",
              file=sys.stderr)
        return EXIT_ERROR
    parser.error(f"unknown command {args.command}")  # pragma: no cover
    return EXIT_ERROR  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
