"""benchmarks/robustness.py reuses a cached study only while the code and configs that decide it are unchanged:
an edit to a comment or docstring keeps the cache, an edit to what runs drops it."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import robustness  # noqa: E402

CONF = "# @package _global_\n# how many runs\nrechecks: 2  # measured again\nname: staged\n"


def test_a_config_comment_keeps_the_cache_and_a_value_or_package_drops_it(tmp_path):
    def key(text: str) -> bytes:
        f = tmp_path / "staged_blackbox.yaml"
        f.write_text(text)
        return robustness._code(f)

    base = key(CONF)
    assert key(CONF.replace("# measured again", "# measured again, one on a straggler's chance alone")) == base
    assert key(CONF.replace("# how many runs\n", "")) == base
    assert key(CONF.replace("rechecks: 2", "rechecks: 3")) != base
    assert key(CONF.replace("_global_", "strategy")) != base  # the package line decides where values land


def test_a_docstring_keeps_the_cache_and_code_drops_it(tmp_path):
    def key(text: str) -> bytes:
        f = tmp_path / "m.py"
        f.write_text(text)
        return robustness._code(f)

    src = 'def f(x):\n    """Twice x."""\n    return 2 * x  # doubled\n'
    assert key(src.replace("Twice x.", "x, doubled.").replace("# doubled", "")) == key(src)
    assert key(src.replace("2 * x", "3 * x")) != key(src)
