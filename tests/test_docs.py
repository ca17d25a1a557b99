"""Every Python example of README.md and docs/*.md runs, so none drifts from the API.

Each ```python block runs as it is, in a temp directory (its working
directory), in a fresh namespace with ``__name__ == "__main__"``. An HTML
comment on the line before a block says how it runs (docs/contributing.md):

    <!-- docs-test: OPTION [OPTION ...] -->

    continues     after the block before it in the file: the same directory, and the
                  same namespace when both run in this process
    s3            a loopback S3 server (moto) with a bucket named ``bucket``; the AWS_*
                  variables point at it, as a job's environment points at its cloud
    world=N       a script on N processes of a gloo world (MASTER_ADDR, MASTER_PORT, RANK,
                  WORLD_SIZE, LOCAL_RANK set, as torchrun sets them: tests/docs_world.py)
    runs=N        run it N times in the same directory (an example that resumes)
    needs=a,b     skip unless these modules import (optional extras)

A chain (a block and the ``continues`` blocks after it) is one test, named by
its file and line; a failure names the block's file and line. A chain must leave
no writer sidecar running, and (without ``s3``) no /dev/shm entry or fd. Every
``snapsvc ...`` command of a ``sh`` block must parse with the CLI's own parser.
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from conftest import sidecar_children

pytest_plugins = ["remote_fixtures"]

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^\s*<!--\s*docs-test:(.*?)-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
OPTIONS = {"continues", "s3", "world", "runs", "needs"}
RUN_S = 240          # one chain, every block and run of it together


@dataclass
class Block:
    """One fenced code block: where it is, its language, its source and options."""

    file: Path
    line: int           # of the first line of code (1-based)
    lang: str
    code: str
    options: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.file.relative_to(ROOT)}:{self.line}"


def parse(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, each with the marker on the line before it."""
    lines = path.read_text().splitlines()
    blocks, i, marker = [], 0, None
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            mk = MARKER.match(lines[i])
            if mk or (marker and lines[i].strip()):
                _no_block_after(path, marker)
            if mk:
                marker = (i + 1, mk.group(1))
            i += 1
            continue
        indent, fence, lang = m.groups()
        if marker and lang != "python":
            _no_block_after(path, marker)
        end = i + 1
        while end < len(lines) and not (lines[end].strip().startswith(fence[0] * len(fence))
                                        and set(lines[end].strip()) == {fence[0]}):
            end += 1
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:end]]
        options = _options(path, *marker) if marker else {}
        blocks.append(Block(path, i + 2, lang, "\n".join(body) + "\n", options))
        marker, i = None, end + 1
    if marker:
        _no_block_after(path, marker)
    return blocks


def _no_block_after(path: Path, marker: tuple[int, str] | None) -> None:
    if marker:
        raise ValueError(f"{path.relative_to(ROOT)}:{marker[0]}: a docs-test marker must be on "
                         "the line right before a ```python block")


def _options(path: Path, line: int, text: str) -> dict[str, str]:
    out = {}
    for word in text.split():
        key, _, value = word.partition("=")
        if key not in OPTIONS:
            raise ValueError(f"{path.relative_to(ROOT)}:{line}: unknown docs-test option {key!r} "
                             f"(known: {sorted(OPTIONS)})")
        out[key] = value
    return out


def chains() -> list[list[Block]]:
    """Python blocks grouped: each block, with the ``continues`` blocks right after it."""
    out: list[list[Block]] = []
    for path in FILES:
        for b in (b for b in parse(path) if b.lang == "python"):
            if "continues" in b.options:
                assert out and out[-1][0].file == path, f"{b.where}: continues no block"
                out[-1].append(b)
            else:
                out.append([b])
    return out


CHAINS = chains()


@pytest.mark.timeout(RUN_S + 60)
@pytest.mark.parametrize("chain", CHAINS, ids=[c[0].where for c in CHAINS])
def test_example_runs(chain: list[Block], tmp_path: Path, request: pytest.FixtureRequest,
                      monkeypatch: pytest.MonkeyPatch) -> None:
    for b in chain:
        for module in filter(None, b.options.get("needs", "").split(",")):
            pytest.importorskip(module, reason=f"{b.where} needs {module}")
    server = request.getfixturevalue("world_server") if any("world" in b.options for b in chain) \
        else None   # before no_leaks: its pipes live for the session
    if any("s3" in b.options for b in chain):
        s3 = request.getfixturevalue("s3")   # sets AWS_* for this process and its children
        s3.client.create_bucket(Bucket="bucket")
        request.addfinalizer(lambda: _empty(s3.client, "bucket"))
    else:   # obstore's runtime, started by a read from a URL, keeps its fds for the process
        request.getfixturevalue("no_leaks")   # no /dev/shm entry or fd left behind
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__main__"}
    children = set(sidecar_children())
    for b in chain:
        runs = int(b.options.get("runs", 1))
        if "world" in b.options:
            _run_world(b, int(b.options["world"]), runs, tmp_path, server)
        else:
            for _ in range(runs):
                _run_here(b, namespace)
    leaked = set(sidecar_children()) - children
    assert not leaked, f"{chain[0].where}: the example left writer sidecars running: {leaked}"


def _run_here(b: Block, namespace: dict) -> None:
    """Run ``b`` in this process; its line numbers are the Markdown file's."""
    code = compile("\n" * (b.line - 1) + b.code, str(b.file), "exec")
    try:
        exec(code, namespace)
    except BaseException as e:
        raise AssertionError(f"{b.where}: the example raised {type(e).__name__}: {e}") from e


@pytest.fixture(scope="session")
def world_server() -> Iterator[subprocess.Popen]:
    """tests/docs_world.py, serving this session's multi-rank examples."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("docs_world.py"))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    yield server
    server.stdin.close()   # it exits at the end of its input
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    server.stdout.close()


def _run_world(b: Block, world: int, runs: int, tmp: Path, server: subprocess.Popen) -> None:
    """Run ``b`` as a script on ``world`` processes, ``runs`` times, as torchrun would start
    them (tests/docs_world.py); its line numbers are the Markdown file's."""
    script = tmp / f"{b.file.name}-{b.line}.py"
    script.write_text("\n" * (b.line - 1) + b.code)
    server.stdin.write(json.dumps({"script": str(script), "world": world, "runs": runs,
                                   "deadline_s": RUN_S, "cwd": str(tmp), "env": dict(os.environ)}) + "\n")
    server.stdin.flush()
    ready, _, _ = select.select([server.stdout], [], [], RUN_S + 30)
    assert ready, f"{b.where}: tests/docs_world.py did not answer in {RUN_S + 30} s"
    answer = json.loads(server.stdout.readline() or '{"code": "no answer: the server died"}')
    if answer["code"] != 0:
        logs = "".join(f"--- {log.name}:\n{log.read_text()[-4000:]}\n"
                       for log in sorted(tmp.glob(f"{script.name}.*.log")))
        raise AssertionError(f"{b.where}: the example failed on a world of {world}:\n{logs}")


def _empty(client, bucket: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", []):
            client.delete_object(Bucket=bucket, Key=o["Key"])


def test_shell_commands_parse() -> None:
    """Every ``snapsvc`` command line of a ``sh`` block names real commands and options."""
    from snapsvc.cli.core import build_parser

    parser = build_parser()
    for path in FILES:
        for b in parse(path):
            if b.lang not in ("sh", "bash", "console"):
                continue
            for n, line in enumerate(b.code.replace("\\\n", " ").splitlines()):
                for command in line.split("#", 1)[0].split("&&"):
                    words = shlex.split(command)
                    if words[:1] and os.path.basename(words[0]) == "snapsvc":
                        try:
                            parser.parse_args(words[1:])
                        except SystemExit as e:   # --help and --version exit 0
                            if e.code != 0:
                                pytest.fail(f"{path.relative_to(ROOT)}:{b.line + n}: "
                                            f"`{command.strip()}` is not a valid snapsvc command")
