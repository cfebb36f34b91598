"""Refuse answers that cannot make a working project, before any file is written.

Cookiecutter deletes the project folder when this hook exits non-zero.
"""

import json
import keyword
import sys

# The answers arrive as one JSON document inside a Python string literal: quotes,
# backslashes and newlines in user text cannot break out of it.
ANSWERS = json.loads({{ cookiecutter | tojson | tojson }})
CHOICES = {
    "nodes": ("single", "multi"),
    "launcher": ("torchrun", "spawn"),
    "save_strategy": ("last", "best", "every_epoch", "final_only"),
    "scheduler": ("none", "slurm"),
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


def main():
    messages = list(problems(ANSWERS))
    for message in messages:
        print(f"error: {message}", file=sys.stderr)
    return 1 if messages else 0


if __name__ == "__main__":
    sys.exit(main())
