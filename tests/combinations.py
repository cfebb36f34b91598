"""The prompt combinations the suite generates, derived from cookiecutter.json.

The first five choice prompts (the contract's core) are combined in full; every later
choice prompt is added all-pairs: each of its values meets every value of every other
prompt at least once. A prompt added to cookiecutter.json is tested the day it lands.
"""

import importlib.util
import itertools
import json
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent.parent
CONFIG = json.loads((TEMPLATE / "cookiecutter.json").read_text())
CORE = ("nodes", "launcher", "use_batch_sampler", "sync_bn", "save_strategy")


def _answers_module():
    spec = importlib.util.spec_from_file_location(
        "answers", TEMPLATE / "hooks/answers.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refused(answers):
    """Whether the template refuses these answers together (hooks/answers.py)."""
    return any(True for _ in _answers_module().refused_combinations(answers))


def choices(config=CONFIG):
    """{prompt: [values]} for every choice and boolean prompt, in file order (keys
    starting with "_" are cookiecutter's settings, not prompts)."""
    result = {}
    for key, value in config.items():
        if key.startswith("_"):
            continue
        if isinstance(value, bool):
            result[key] = [value, not value]
        elif isinstance(value, list):
            result[key] = list(value)
    return result


def uncovered_pairs(rows, options, allowed=lambda row: True):
    """Pairs ((key, value), (key, value)) that no row contains, of those that some
    allowed row can contain."""
    wanted = {
        ((a, va), (b, vb))
        for a, b in itertools.combinations(options, 2)
        for va in options[a]
        for vb in options[b]
        if pair_allowed(options, {a: va, b: vb}, allowed)
    }
    for row in rows:
        wanted -= set(itertools.combinations([(k, row[k]) for k in options], 2))
    return wanted


def pair_allowed(options, pair, allowed):
    """Whether some allowed row, with the first values elsewhere, holds this pair."""
    first = {key: values[0] for key, values in options.items()}
    return allowed(first | pair)


def combinations(options=None, core=CORE, allowed=None):
    """Full product of the core prompts; each later prompt is then assigned row by row,
    greedily, to the value that meets the most not-yet-met values (among those the
    template allows with the row), and a row is appended for any allowed pair still
    missing."""
    options = choices() if options is None else options
    allowed = allowed or (lambda row: not refused(row | defaults(options, row)))
    product = itertools.product(*(options[k] for k in core))
    rows = [dict(zip(core, values, strict=True)) for values in product]
    for key in [k for k in options if k not in core]:
        earlier = list(rows[0])
        met = set()
        for row in rows:
            fits = [v for v in options[key] if allowed({**row, key: v})]
            row[key] = max(
                fits,
                key=lambda v, row=row: sum(
                    ((k, row[k]), v) not in met for k in earlier
                ),
            )
            met |= {((k, row[k]), row[key]) for k in earlier}
        for k in earlier:
            for value, new in itertools.product(options[k], options[key]):
                extra = {**rows[0], k: value, key: new}
                if ((k, value), new) not in met and allowed(extra):
                    rows.append(extra)
                    met.add(((k, value), new))
    return rows


def defaults(options, row):
    """The first value of every prompt the row does not answer."""
    return {key: values[0] for key, values in options.items() if key not in row}


def case_id(row):
    """Readable pytest id, e.g. nodes:single-launcher:spawn-sync_bn:true-..."""
    return "-".join(f"{k}:{str(v).lower()}" for k, v in row.items())


COMBINATIONS = combinations()
IDS = [case_id(row) for row in COMBINATIONS]
