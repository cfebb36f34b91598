"""Refuse answers that cannot make a working project, before anything is written.

Cookiecutter creates the project folder, and any parent folder a slug such as `a/b`
names, before its pre-generation hook runs; a failing hook removes the project folder
but not those parents. So the answers are checked earlier, while cookiecutter renders
them: `cookiecutter.json` loads this module as a Jinja extension (`_extensions`) and
renders its last private variable through the `check_answers` filter, after every
prompt has been answered and before any folder exists.
"""

import keyword
import sys

from cookiecutter.exceptions import FailedHookException
from jinja2.ext import Extension

CHOICES = {
    "nodes": ("single", "multi"),
    "launcher": ("torchrun", "spawn"),
    "save_strategy": ("last", "best", "every_epoch", "final_only"),
    "scheduler": ("none", "slurm"),
    "parallelism": ("ddp", "fsdp2"),
}
BOOLEANS = ("use_batch_sampler", "sync_bn")


def problems(answers):
    """Yield one message per refused answer, naming the value and why."""
    name = answers["project_name"]
    if not name.strip():
        yield "project_name is empty"
    elif not name.isprintable():
        yield f"project_name {name!r} must be one line of printable text"
    slug = answers["project_slug"]
    if not slug.isidentifier():
        yield (
            f"project_slug {slug!r} is not a valid Python identifier "
            "(letters, digits and underscores, not starting with a digit; "
            "no spaces, dots or path separators)"
        )
    elif keyword.iskeyword(slug) or keyword.issoftkeyword(slug):
        yield f"project_slug {slug!r} is a Python keyword"
    for key, allowed in CHOICES.items():
        if answers[key] not in allowed:
            yield f"{key} {answers[key]!r} is not one of {', '.join(allowed)}"
    for key in BOOLEANS:
        if not isinstance(answers[key], bool):
            yield f"{key} {answers[key]!r} is not a boolean (true or false)"
    yield from refused_combinations(answers)


def refused_combinations(answers):
    """Answers that each work, but not together."""
    if answers.get("sync_bn") is True and answers.get("parallelism") == "fsdp2":
        yield (
            "sync_bn true does not go with parallelism 'fsdp2': SyncBatchNorm under "
            "FSDP2 is not supported here; choose sync_bn=false (each rank keeps its "
            "own BatchNorm statistics) or parallelism=ddp"
        )


def check_answers(answers):
    """The filter: "passed", or one `error:` line per problem on stderr and a stop."""
    messages = list(problems(answers))
    for message in messages:
        print(f"error: {message}", file=sys.stderr)
    if messages:
        raise FailedHookException("Stopping generation: nothing was written.")
    return "passed"


class CheckAnswers(Extension):
    def __init__(self, environment):
        super().__init__(environment)
        environment.filters["check_answers"] = check_answers
