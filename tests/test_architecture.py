"""What docs/architecture.md promises and a grep can check: trial facts read through their keys in one
place, imports flowing one way, strategies asking the judge, no function too long to read."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "zenithtune").rglob("*.py"), *(ROOT / "hydra_plugins").rglob("*.py")])
# a user_attrs read by a literal key: .user_attrs["x"], .user_attrs.get("x"), "x" in ....user_attrs
LITERAL_READ = re.compile(r"""user_attrs(\.get)?\s*[\[(]\s*f?["']|["'][^"']*["']\s+(not\s+)?in\s+[\w.]*user_attrs""")
STUDY_LAYER = ("job", "loop", "settings", "study", "app", "progress", "tuned", "preflight", "hydra_main", "cli")
MAX_LINES = 80


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_trial_facts_are_read_by_literal_keys_only_in_record_and_analyze():
    offenders = [f"{_rel(path)}:{n}: {line.strip()}" for path in SOURCES
                 if path.name not in ("record.py", "analyze.py")
                 for n, line in enumerate(path.read_text().splitlines(), 1) if LITERAL_READ.search(line)]
    assert not offenders, "read trial facts through record.Attr (or record.outcome_of):\n" + "\n".join(offenders)


def test_the_domain_never_imports_the_study_layer():
    domain = [p for p in SOURCES if p.parent.name in ("strategies", "sim")
              or p.name in ("space.py", "memory.py", "shape.py", "assessment.py", "validate.py", "traits.py",
                            "options.py", "modelinfo.py", "command.py")]
    below = re.compile(r"^\s*(from zenithtune(\.| import )|import zenithtune\.)(" + "|".join(STUDY_LAYER) + r")\b")
    offenders = [f"{_rel(path)}:{n}: {line.strip()}" for path in domain
                 for n, line in enumerate(path.read_text().splitlines(), 1) if below.search(line)]
    assert not offenders, "the domain imports the study layer:\n" + "\n".join(offenders)


def test_strategies_ask_the_judge_and_keep_no_memory_model_of_their_own():
    strategies = sorted((ROOT / "zenithtune" / "strategies").glob("*.py"))
    banned = re.compile(r"space\.ctx|self\.memory\b|memory_args|from zenithtune\.memory import|MemoryModel")
    offenders = [f"{_rel(path)}:{n}: {line.strip()}" for path in strategies
                 for n, line in enumerate(path.read_text().splitlines(), 1) if banned.search(line)]
    assert not offenders, "a strategy reads memory and the job through self.judge / self.ctx:\n" + "\n".join(offenders)


def test_no_tuner_function_is_longer_than_80_lines():
    # the simulator (a model of a trainer, long on purpose) and the files other work is splitting are exempt
    exempt = ("zenithtune/sim/", "zenithtune/run.py", "zenithtune/analyze.py", "zenithtune/inject.py")
    long = []
    for path in SOURCES:
        if _rel(path).startswith(exempt):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_LINES:
                    long.append(f"{_rel(path)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, f"split where a name helps the reader (max {MAX_LINES} lines):\n" + "\n".join(long)
