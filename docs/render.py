"""Regenerate the command-output blocks of README.md and docs/*.md: `python docs/render.py`.

A generated block is a fenced block right after an HTML comment naming its command:

    <!-- render: zenithtune analyze runs/llama8b/study.db -->
    ```console
    $ zenithtune analyze runs/llama8b/study.db
    ...what it prints...
    ```

Options follow the command after ` ;; `, space-separated:
    keep=1-12,-3   output lines to show: 1 to 12 and the last 3; "..." marks each gap
    prompt=no      no "$ command" line (the block shows output only)
    check=no       about wall time (timeouts, Ctrl-C): regenerated here with the measured durations,
                   not compared by tests/test_docs.py
    interrupt=TEXT press Ctrl-C three seconds after an output line containing TEXT (e.g. "[1/6]"), as
                   a terminal does (SIGINT to the command's process group); the block shows "^C"

Each document's commands run in order, as argv lists (never a shell), in one fresh temporary
folder, so a later block sees the study an earlier one made. `zenithtune` and `python` are this
interpreter's; `$SIM` is the built-in simulator's Llama-3-8B command (the default of conf/config.yaml).
Output is stdout and stderr together, with an "[exit code N]" line when N is not 0.

Volatile parts are normalised so that a block only changes when what a user sees changes:
    the temporary folder                    -> /tmp/demo
    this interpreter (sys.executable)       -> python
    study_/run_ folder stamps (date, time, microseconds, pid) -> study_20261129_101500_123456_4242 (same shape)
    "made YYYY-MM-DD HH:MM" (tuned configs) -> made 2026-11-29 10:15
    a trial's wall time "(0.4 s, 0:00:03)"  -> (0.2 s, 0:00:01); other H:MM:SS clocks -> 0:00:01
    analyze's "s" column, "time in trials"  -> 0.2 per trial
The simulator's own timestamps ([2025-01-01 08:00:41]) are simulated, hence stable, and kept.

`python docs/render.py --check` rewrites nothing and exits 1 listing the blocks that differ.
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SIM = ("python -m zenithtune.sim --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 "
       "--num-attention-heads 32 --group-query-attention --num-query-groups 8 --seq-length 8192 "
       "--max-position-embeddings 8192 --vocab-size 128256 --swiglu --disable-bias-linear "
       "--untie-embeddings-and-output-weights --micro-batch-size 1 --global-batch-size 64 --bf16 "
       "--use-distributed-optimizer --log-throughput --sim-gpu h100 --sim-world-size 8 --train-iters 10").split()
_MARK = re.compile(r"^<!-- render: (?P<body>.*?) -->\s*$")
_WRAP = 100  # a "$ command" line longer than this is wrapped with " \" like a shell would take it


@dataclass
class Block:
    """One generated block: where it sits in the document and how to make it."""

    start: int                 # index of the opening fence line
    end: int                   # index of the closing fence line
    command: str               # as written in the comment (and shown after "$ ")
    keep: str = ""             # keep= ranges, "" = everything
    prompt: bool = True        # show the "$ command" line
    check: bool = True         # compared by the test
    interrupt: str | None = None  # Ctrl-C one second after a line containing this
    fence: str = "```console"  # the opening fence as written
    lines: list[str] = field(default_factory=list)  # the block's current content


def parse(text: str, where: str = "") -> list[Block]:
    lines = text.split("\n")
    blocks = []
    for i, line in enumerate(lines):
        m = _MARK.match(line)
        if not m:
            continue
        command, _, opts = m["body"].partition(" ;; ")
        if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
            raise SystemExit(f"{where}:{i + 1}: a render comment must be followed by a fenced block")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise SystemExit(f"{where}:{i + 2}: the fenced block after the render comment is not closed")
        block = Block(start=i + 1, end=end, command=command.strip(), fence=lines[i + 1], lines=lines[i + 2:end])
        for opt in opts.split():
            key, _, value = opt.partition("=")
            if key == "keep":
                block.keep = value
            elif key == "prompt":
                block.prompt = value != "no"
            elif key == "check":
                block.check = value != "no"
            elif key == "interrupt":
                block.interrupt = value
            else:
                raise SystemExit(f"{where}:{i + 1}: unknown render option {opt!r} (keep=, prompt=no, check=no, interrupt=TEXT)")
        blocks.append(block)
    return blocks


def argv(command: str) -> list[str]:
    out: list[str] = []
    for word in shlex.split(command):
        if word == "$SIM":
            out += argv(" ".join(SIM))
        elif word in ("python", "python3") and not out:
            out.append(sys.executable)
        elif word == "zenithtune" and not out:
            out += [sys.executable, "-c", "import sys; from zenithtune.cli import main; sys.exit(main())"]
        else:
            out.append(word)
    return out


def run(command: str, cwd: Path, interrupt: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZENITHTUNE_")}
    env.update(TTY_INTERACTIVE="0", COLUMNS="200", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(argv(command), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    chunks: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            chunks.append(line)
            if interrupt is not None and interrupt in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if interrupt is not None:
        while proc.poll() is None and not seen.wait(timeout=0.2):
            pass
        if proc.poll() is None:
            time.sleep(3.0)  # past the next launch (Hydra composes its config first): Ctrl-C stops that trial
            chunks.append("^C\n")  # where a terminal would echo it
            os.killpg(proc.pid, signal.SIGINT)
    rc = proc.wait(timeout=600)
    reader.join(timeout=10)
    out = "".join(chunks).rstrip("\n")
    return out + (f"\n[exit code {rc}]" if rc else "")


def _s_column(lines: list[str]) -> list[str]:
    """analyze's table: the "s" (seconds) column holds wall times; each becomes 0.2."""
    col = None
    out = []
    for line in lines:
        if line.startswith("┃"):
            heads = [h.strip() for h in line.split("┃")]
            col = heads.index("s") if "s" in heads else None
        elif line.startswith("│") and col is not None:
            cells = line.split("│")
            if col < len(cells) and cells[col].strip():
                width = len(cells[col])
                cells[col] = "0.2".rjust(width - 1) + " "
                line = "│".join(cells)
        elif not line.startswith(("┏", "┡", "└")):
            col = None
        out.append(line)
    return out


def normalise(text: str, workdir: Path, times: bool = True) -> str:
    for path in sorted({str(workdir.resolve()), str(workdir)}, key=len, reverse=True):
        text = text.replace(path, "/tmp/demo")
    for exe in sorted({sys.executable, os.path.realpath(sys.executable)}, key=len, reverse=True):
        text = text.replace(exe, "python")
    text = re.sub(r"\b(study|run)_\d{8}_\d{6}(_\d+_\d+)?\b", lambda m: f"{m[1]}_20261129_101500"
                  + ("_123456_4242" if m[2] else ""), text)
    text = re.sub(r"\bmade \d{4}-\d\d-\d\d \d\d:\d\d\b", "made 2026-11-29 10:15", text)
    if not times:  # a check=no block is about wall time (timeouts, Ctrl-C): keep the measured ones
        return "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\(\d+(\.\d+)? s, \d+:\d\d:\d\d\)", "(0.2 s, 0:00:01)", text)
    text = re.sub(r"(?<![\d:-])(?<!\d{4}-\d\d-\d\d )\b\d+:\d\d:\d\d\b", "0:00:01", text)
    launched = re.search(r"^launched (\d+):", text, re.M)
    if launched:
        text = re.sub(r"^time in trials: [\d.]+ s$", f"time in trials: {0.2 * int(launched[1]):.1f} s", text, flags=re.M)
    return "\n".join(line.rstrip() for line in _s_column(text.split("\n")))  # editors strip trailing blanks


def keep(lines: list[str], spec: str) -> list[str]:
    """keep=1-12,-3: lines 1 to 12 and the last 3, with "..." for every gap."""
    if not spec:
        return lines
    n = len(lines)
    wanted: set[int] = set()
    for part in spec.split(","):
        if part.startswith("-"):
            wanted.update(range(max(n - int(part[1:]) + 1, 1), n + 1))
        else:
            lo, _, hi = part.partition("-")
            wanted.update(range(int(lo), min(int(hi or lo), n) + 1))
    out, last = [], 0
    for i in sorted(wanted):
        if i != last + 1:
            out.append("...")
        out.append(lines[i - 1])
        last = i
    if last != n:
        out.append("...")
    return out


def shown_command(command: str) -> list[str]:
    """The "$ command" line(s), wrapped at word boundaries like the hand-written blocks were."""
    words, lines, line = command.split(" "), [], "$"
    for w in words:
        if len(line) + 1 + len(w) > _WRAP and line not in ("$", "     "):
            lines.append(line + " \\")
            line = "     "
        line += " " + w
    return lines + [line]


def make(block: Block, workdir: Path) -> list[str]:
    out = normalise(run(block.command, workdir, block.interrupt), workdir, times=block.check).split("\n")
    return (shown_command(block.command) if block.prompt else []) + keep(out, block.keep)


def render(path: Path, check: bool = False, workdir: Path | None = None) -> list[str]:
    """Regenerate one document's blocks (or, with check, compare them); returns the differences."""
    text = path.read_text()
    blocks = parse(text, str(path))
    if not blocks:
        return []
    lines = text.split("\n")
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="zt-render-") as tmp:
        wd = workdir or Path(tmp)
        for b in blocks:
            if check and not b.check:
                continue
            new = make(b, wd)
            if check:
                if new != b.lines:
                    diff = "\n".join(difflib.unified_diff(b.lines, new, "in the document", "printed now", lineterm="", n=1))
                    problems.append(f"{path.relative_to(ROOT)}:{b.start}: `{b.command}` prints something else now "
                                    f"(run python docs/render.py):\n{diff}")
            else:
                b.lines = new
    if not check:
        for b in reversed(blocks):
            lines[b.start + 1:b.end] = b.lines
        path.write_text("\n".join(lines))
    return problems


def main(argv_: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", type=Path, help="documents (default: README.md and docs/*.md)")
    ap.add_argument("--check", action="store_true", help="compare only, rewrite nothing")
    args = ap.parse_args(argv_)
    files = [p.resolve() for p in args.files] or DOCS
    problems = []
    for path in files:
        found = render(path, check=args.check)
        problems += found
        print(f"{'checked' if args.check else 'rendered'} {path.relative_to(ROOT)}: "
              f"{len(parse(path.read_text(), str(path)))} blocks" + (f", {len(found)} differ" if found else ""))
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
