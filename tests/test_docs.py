"""The docs code check: the Python blocks of README.md and docs/**/*.md run as written.

The convention, in the Markdown source (HTML comments: invisible on the rendered site):

* Every block fenced as ```python runs. Other fences (```bash, ```text, ```json, bare ```)
  never run.
* ``<!-- docs-test: skip REASON -->`` on the line(s) before a block: the block does not run.
  For fragments that cannot run on one machine as they stand (a training loop around them,
  a cluster, remote storage, another library's checkpoint); REASON is required.
* ``<!-- docs-test: setup CODE -->`` before a block: hidden CODE runs first, in the same
  namespace, to define what a fragment takes from its context (``rank``, ``local``, ``request``).
* ``<!-- docs-test: ranks=N -->`` before a block: the block is a complete script and runs on N
  processes with the environment ``torchrun --nproc-per-node N`` gives them (``RANK``,
  ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), as ``__main__``, in the
  page's working directory (its own namespace: it shares nothing with the other blocks).
* The blocks of one page run in page order in one namespace (like a notebook), in a fresh
  working directory, so relative paths such as ``"checkpoints/iter_100"`` land there. Then the
  whole page runs a second time in the same directory: a snippet that saves to a fixed path must
  work when a reader runs it twice (``overwrite=True``, or a fresh directory).

A page whose blocks are not marked yet is listed in ``UNMARKED`` with the reason; remove it
from there once its blocks are marked.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import pytest

from .dist_utils import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "**", "*.md"),
                                                                            recursive=True))
UNMARKED = {
}

_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
_DIRECTIVE = re.compile(r"<!--\s*docs-test:(.*?)-->", re.S)


@dataclass
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    code: str
    setup: str = ""
    skip: Optional[str] = None
    ranks: int = 1
    problems: List[str] = field(default_factory=list)


def parse(page: str) -> List[Block]:
    """The ```python blocks of ``page`` with their directives."""
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
        text = f.read()
    blocks, pos = [], 0
    for m in _FENCE.finditer(text):
        gap, pos = text[pos:m.start()], m.end()
        lang = m.group(1).strip().split()[0] if m.group(1).strip() else ""
        block = Block(page, text.count("\n", 0, m.start()) + 1, m.group(2))
        for d in _DIRECTIVE.finditer(gap):
            # a directive belongs to the fence right after it: only blank lines and other directives between
            if _DIRECTIVE.sub("", gap[d.start():]).strip():
                block.problems.append(f"directive {d.group(0)[:60]!r} is not right before a code block")
                continue
            body = d.group(1).strip()
            if body.startswith("setup"):
                block.setup += body[len("setup"):].strip("\n") + "\n"
            elif body.startswith("skip ") and body[len("skip"):].strip():
                block.skip = body[len("skip"):].strip()
            elif re.fullmatch(r"ranks=\d+", body):
                block.ranks = int(body.split("=")[1])
            else:
                block.problems.append(f"unknown or incomplete directive {d.group(0)[:60]!r}")
        if lang == "python":
            blocks.append(block)
        elif block.problems or block.skip or block.setup or block.ranks != 1:
            blocks.append(block)
            block.problems.append(f"directive before a ```{lang} block, which never runs")
    return blocks


# Each rank of a ranks=N block is a long-lived worker process: a page's ranks blocks run in the
# same workers, each block in a fresh namespace as __main__ with a fresh MASTER_PORT, so that
# the interpreter and torch start once per page and not once per block (2 cores: ~3 s each).
_WORKER = r"""
import json, os, sys, traceback
real_stdout = sys.stdout
for line in sys.stdin:
    msg = json.loads(line)
    os.environ["MASTER_PORT"] = str(msg["port"])
    os.chdir(msg["cwd"])
    try:
        exec(compile(msg["code"], msg["where"], "exec"), {"__name__": "__main__"})
        result = {"ok": True}
    except BaseException:
        result = {"ok": False, "error": traceback.format_exc()}
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout = real_stdout
    print("\0RESULT " + json.dumps(result), flush=True)
"""


class RankWorkers:
    """N worker processes started like torchrun's ranks; :meth:`run` executes one block on all."""

    def __init__(self, n: int):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", WORLD_SIZE=str(n), OMP_NUM_THREADS="1",
                   PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.procs = [subprocess.Popen([sys.executable, "-u", "-c", _WORKER], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
                      for r in range(n)]

    def run(self, block: Block, cwd: str) -> None:
        msg = json.dumps({"code": block.setup + block.code, "where": f"{block.page}:{block.line}",
                          "cwd": cwd, "port": free_port()})
        for p in self.procs:
            p.stdin.write(msg + "\n")
            p.stdin.flush()
        failures = []
        for rank, p in enumerate(self.procs):
            output = []
            for line in p.stdout:  # a hang is caught by the suite's per-test timeout
                if line.startswith("\0RESULT "):
                    result = json.loads(line[len("\0RESULT "):])
                    if not result["ok"]:
                        failures.append(f"--- rank {rank} ---\n{''.join(output)[-2000:]}{result['error']}")
                    break
                output.append(line)
            else:
                failures.append(f"--- rank {rank} exited ({p.wait()}) ---\n{''.join(output)[-3000:]}")
        assert not failures, f"{block.page}:{block.line} failed on {len(self.procs)} ranks:\n" + "\n".join(failures)

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def run_page(page: str, cwd: str, workers: Dict[int, RankWorkers]) -> None:
    namespace = {"__name__": "__docs__"}
    for block in parse(page):
        assert not block.problems, f"{page}:{block.line}: " + "; ".join(block.problems)
        if block.skip:
            continue
        if block.ranks > 1:
            if block.ranks not in workers:
                workers[block.ranks] = RankWorkers(block.ranks)
            workers[block.ranks].run(block, cwd)
            continue
        where = f"{page}:{block.line}"
        try:
            if block.setup:
                exec(compile(block.setup, f"{where} (setup)", "exec"), namespace)
            exec(compile(block.code, where, "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"the block at {where} fails: {type(e).__name__}: {e}") from e


def _runs_code(page: str) -> bool:
    return any(not b.skip for b in parse(page))


# a page that runs no code is not a test item (it would pass without checking anything)
RUN_PAGES = [p for p in PAGES if _runs_code(p)]


@pytest.mark.parametrize("page", RUN_PAGES)
def test_doc_code_blocks_run(page, monkeypatch):
    if page in UNMARKED:
        pytest.skip(UNMARKED[page])
    workers: Dict[int, RankWorkers] = {}
    with tempfile.TemporaryDirectory() as cwd:
        monkeypatch.chdir(cwd)
        try:
            for _ in range(2):  # the second time in the same directory: snippets must survive a rerun
                run_page(page, cwd, workers)
        finally:
            for w in workers.values():
                w.close()


def test_pages_that_run_code_check_their_results():
    """A page whose blocks compute values shows they are right (``assert``), not only that nothing raised."""
    silent = [p for p in RUN_PAGES if not any("assert" in b.code for b in parse(p) if not b.skip)]
    assert not silent, f"pages running code without a single assert: {silent}"


def test_directives_are_well_formed():
    """Typos in a directive, or a directive that is not right before a ```python block, fail loudly."""
    problems = [f"{b.page}:{b.line}: {p}" for page in PAGES for b in parse(page) for p in b.problems]
    assert not problems, "\n".join(problems)


def test_the_convention_is_checked(tmp_path, monkeypatch):
    """The parser reads the directives as documented above (a self-check of this file)."""
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n<!-- docs-test: skip needs a GPU -->\n```python\nraise SystemExit\n```\n"
        "<!-- docs-test: setup\nx = 41\n-->\n```python\nx += 1\n```\n"
        "```bash\nexit 1\n```\n<!-- docs-test: ranks=2 -->\n```python\nimport os\n```\n"
        "<!-- docs-test: skip -->\n```python\npass\n```\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO", str(tmp_path))
    blocks = parse("page.md")
    assert [(b.skip, b.setup, b.ranks) for b in blocks] == [
        ("needs a GPU", "", 1), (None, "x = 41\n", 1), (None, "", 2), (None, "", 1)]
    assert blocks[3].problems  # skip without a reason
    namespace = {}
    exec(blocks[1].setup + blocks[1].code, namespace)
    assert namespace["x"] == 42


def test_ci_runs_the_readme_test_command():
    """README's second command and .ci/run stay the same command (install with the test extra, pytest)."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        first_block = _FENCE.search(f.read()).group(2).splitlines()
    assert len(first_block) == 2, first_block
    install, run = (part.strip() for part in first_block[1].split("&&"))
    with open(os.path.join(REPO, ".ci", "run"), encoding="utf-8") as f:
        ci = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert install == 'pip install -e ".[test]" -c constraints.txt' and run == "python -m pytest -q"
    assert 'python -m pip install -q -e ".[test]" -c constraints.txt' in ci and run in ci
    assert ci.index(run) > ci.index('python -m pip install -q -e ".[test]" -c constraints.txt')


def test_ci_fails_when_tests_were_deselected(tmp_path):
    """.ci/run counts the suite's tests with no options from the environment and fails when fewer
    ran (a PYTEST_ADDOPTS with -m "not slow" or --deselect cannot make CI green)."""
    import subprocess
    import sys

    xml = tmp_path / "junit.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.test_a" name="test_x"/>'
                   '<testcase classname="tests.test_a" name="test_y"/></testsuite></testsuites>')
    check = [sys.executable, os.path.join(REPO, ".ci", "check_skips.py"), str(xml)]
    assert subprocess.run(check + ["--expect", "2"], capture_output=True).returncode == 0
    bad = subprocess.run(check + ["--expect", "3"], capture_output=True, text=True)
    assert bad.returncode == 1 and "only 2 test(s) ran, but the suite holds 3" in bad.stderr
    with open(os.path.join(REPO, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    assert 'env -u PYTEST_ADDOPTS python -m pytest --collect-only' in ci and '--expect "$COLLECTED"' in ci
