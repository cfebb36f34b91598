"""Every combination of prompts generates a clean project."""

import ast
import py_compile
import re
import subprocess

import pytest

from combinations import (
    COMBINATIONS,
    IDS,
    TEMPLATE,
    choices,
    combinations,
    refused,
    uncovered_pairs,
)
from conftest import USER_FUNCTIONS, bake

pytestmark = pytest.mark.xdist_group("generation")  # one test worker: baked once

COMMON_FILES = {"main_multi_gpu.py", "run_single.sh", "README.md", "requirements.txt"}


def expected_files(answers):
    files = set(COMMON_FILES)
    if answers["nodes"] == "multi":
        files.add("run_multi.sh")
    if answers["scheduler"] == "slurm":
        files.add("run_slurm.sbatch")
    return files


def test_combinations_cover_the_contract():
    assert choices() == {
        "nodes": ["single", "multi"],
        "launcher": ["torchrun", "spawn"],
        "use_batch_sampler": [True, False],
        "sync_bn": [False, True],
        "save_strategy": ["last", "best", "every_epoch", "final_only"],
        "scheduler": ["none", "slurm"],
        "parallelism": ["ddp", "fsdp2"],
    }
    assert len(COMBINATIONS) == 2 * 2 * 2 * 2 * 4
    # Every pair of answers the template takes is met, and none it refuses.
    assert (
        uncovered_pairs(COMBINATIONS, choices(), lambda row: not refused(row)) == set()
    )
    assert not any(refused(row) for row in COMBINATIONS)
    assert refused({"sync_bn": True, "parallelism": "fsdp2"})
    assert len(set(IDS)) == len(IDS)
    assert "nodes:single-launcher:torchrun" in IDS[0]


def test_later_prompts_are_combined_all_pairs():
    options = {
        "a": [1, 2],
        "b": ["x", "y", "z"],
        "later": ["p", "q", "r", "s"],
        "flag": [True, False],
    }
    rows = combinations(options, core=("a", "b"))
    assert uncovered_pairs(rows, options) == set()
    assert {(row["a"], row["b"]) for row in rows} == {
        (a, b) for a in options["a"] for b in options["b"]
    }


@pytest.fixture(scope="module")
def baked(tmp_path_factory):
    """All combinations, generated once into one folder (linters then run once)."""
    root = tmp_path_factory.mktemp("baked")
    projects = {}
    for case, answers in zip(IDS, COMBINATIONS, strict=True):
        projects[case] = bake(root, project_slug=f"p{len(projects)}", **answers)
    return root, projects


@pytest.mark.parametrize("answers", COMBINATIONS, ids=IDS)
def test_generated_files(baked, answers):
    project = baked[1][IDS[COMBINATIONS.index(answers)]]
    files = {p.name for p in project.iterdir()}
    assert files == expected_files(answers)
    for path in project.iterdir():
        text = path.read_text()
        assert not re.search(r"\{\{|\{%|\{#|%\}|cookiecutter", text), path.name
        assert text.endswith("\n") and not text.endswith("\n\n"), path.name
        assert "\n\n\n\n" not in text, f"blank-line debris in {path.name}"
        assert not re.search(r"[ \t]+$", text, re.MULTILINE), path.name
    py_compile.compile(str(project / "main_multi_gpu.py"), doraise=True)
    for script in [*project.glob("*.sh"), *project.glob("*.sbatch")]:
        assert script.stat().st_mode & 0o111 == 0o111, script.name
        assert script.read_text().startswith("#!/usr/bin/env bash\n")


def test_only_the_chosen_variant_is_in_the_script(baked):
    for case, answers in zip(IDS, COMBINATIONS, strict=True):
        code = (baked[1][case] / "main_multi_gpu.py").read_text()
        assert ("mp.start_processes(" in code) == (answers["launcher"] == "spawn"), case
        assert ("BatchSampler(" in code) == answers["use_batch_sampler"], case
        assert ("convert_sync_batchnorm" in code) == answers["sync_bn"], case
        assert ("checkpoint_best" in code) == (answers["save_strategy"] == "best")
        assert ("checkpoint_epoch" in code) == (
            answers["save_strategy"] == "every_epoch"
        )
        resumable = answers["save_strategy"] != "final_only"
        # At every pass's end, or only on a stop or --save-every (final_only).
        every_pass = "\n    if stop or saving or end:\n"
        on_stop = "\n    if stop or saving:  # final_only keeps none at a pass's end\n"
        assert (every_pass in code, on_stop in code) == (resumable, not resumable)
        assert ("--nnodes" in code) == (
            answers["launcher"] == "spawn" and answers["nodes"] == "multi"
        )
        for change in (1, 2, 3, 4):
            assert f"DDP change {change}" in code, (case, change)
        fsdp = answers["parallelism"] == "fsdp2"
        assert ("fully_shard(" in code) == fsdp, case
        assert ("torch.distributed.checkpoint" in code) == fsdp, case
        assert ("DistributedDataParallel" in code) == (not fsdp), case
        assert ("ddp_model" in code) == (not fsdp), case
        sbatch = baked[1][case] / "run_slurm.sbatch"
        if sbatch.exists():
            text = sbatch.read_text()
            assert ("torchrun" in text) == (answers["launcher"] == "torchrun"), case
            assert ("--node-rank" in text) == (answers["nodes"] == "multi"), case


def test_no_function_is_longer_than_a_screen(baked):
    """The step and the epoch loop read on one screen: no function (the five user
    functions and the machinery alike) over 80 lines, in any variant."""
    for case in IDS:
        code = (baked[1][case] / "main_multi_gpu.py").read_text()
        lengths = {
            node.name: node.end_lineno - node.lineno + 1
            for node in ast.walk(ast.parse(code))
            if isinstance(node, ast.FunctionDef)
        }
        assert len(lengths) > 40, case
        longest = max(lengths, key=lengths.get)
        assert lengths[longest] <= 80, (case, longest, lengths[longest])


def test_the_five_functions_come_first(baked):
    """After the header and the imports, a reader meets the five functions a user
    edits (after the constant they use and the recipes' three settings) before
    anything else."""
    for case in IDS:
        code = (baked[1][case] / "main_multi_gpu.py").read_text()
        body = ast.parse(code).body
        imports = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))]
        rest = body[body.index(imports[-1]) + 1 :]
        # The same settings in every variant: an edit zone moves between them.
        settings = ["NUM_CLASSES = 10", "FIND_UNUSED_PARAMETERS = False"]
        settings += ["ALTERNATE = False", "DROP_LAST = False"]
        five = rest[len(settings) : len(settings) + 5]
        assert [ast.unparse(n) for n in rest[: len(settings)]] == settings, case
        assert [n.name for n in five if isinstance(n, ast.FunctionDef)] == list(
            USER_FUNCTIONS
        ), case
        assert code.index("# EDIT HERE") < code.index("\ndef build_datasets(")


# Packages users import in the edit zone: no module-level name of the generated file
# may be one of them, or `import datasets` there would be replaced by the file's own.
PACKAGES = [
    "accelerate",
    "albumentations",
    "datasets",
    "deepspeed",
    "einops",
    "evaluate",
    "hydra",
    "huggingface_hub",
    "lightning",
    "matplotlib",
    "mlflow",
    "np",
    "numpy",
    "omegaconf",
    "pandas",
    "pd",
    "peft",
    "PIL",
    "plt",
    "safetensors",
    "scipy",
    "sklearn",
    "tensorboard",
    "timm",
    "tokenizers",
    "torchaudio",
    "torchmetrics",
    "torchvision",
    "tqdm",
    "transformers",
    "trl",
    "wandb",
    "wds",
    "webdataset",
    "yaml",
]


def test_no_module_level_name_is_a_package_users_import(baked):
    for case in IDS:
        code = (baked[1][case] / "main_multi_gpu.py").read_text()
        names = set()
        for node in ast.parse(code).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            for child in ast.walk(node) if not hasattr(node, "name") else ():
                if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                    names.add(child.id)
                if isinstance(child, ast.alias):
                    names.add((child.asname or child.name).partition(".")[0])
        assert len(names) > 100, case
        assert names & set(PACKAGES) == set(), case


def test_the_edit_zone_is_the_same_code_in_every_variant(baked):
    """From NUM_CLASSES to compute_metrics, every variant has the same code (the
    docstrings alone say what differs): an edit zone moves unchanged between them."""

    def zone(case):
        body = ast.parse((baked[1][case] / "main_multi_gpu.py").read_text()).body
        start = next(i for i, n in enumerate(body) if isinstance(n, ast.Assign))
        names = [getattr(n, "name", "") for n in body]
        end = names.index("add_arguments") + 1
        for node in body[start:end]:
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node):
                node.body = node.body[1:]
        return [ast.dump(node) for node in body[start:end]]

    first = zone(IDS[0])
    assert len(first) == 10  # the four settings, the five functions, add_arguments
    for case in IDS[1:]:
        assert zone(case) == first, case


def test_ruff_check_and_format(baked):
    root = baked[0]
    # E501 on top of ruff's defaults: no line past the formatter's 88 columns.
    check = subprocess.run(
        ["ruff", "check", "--no-cache", "--extend-select", "E501", "."],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    fmt = subprocess.run(
        ["ruff", "format", "--check", "--no-cache", "."],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    )
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr
    # ruff formats main_multi_gpu.py and the Python blocks in README.md.
    assert f"{2 * len(COMBINATIONS)} files already formatted" in fmt.stdout


def test_the_edit_zones_imports_have_a_place_ruff_accepts(tmp_path):
    """Imports a user adds right under the EDIT HERE banner (after its isort split),
    unsorted against the template's, pass ruff check with the suite's settings;
    the same imports without that line would be an unsorted block (the control)."""
    project = bake(tmp_path)
    script = project / "main_multi_gpu.py"
    code = script.read_text()
    ours = "import datasets\nimport numpy as np\nfrom transformers import AutoModel\n\n"
    use = "USED = datasets, np, AutoModel\n"
    assert code.count("# isort: split\nNUM_CLASSES = 10\n") == 1
    script.write_text(
        code.replace("NUM_CLASSES = 10\n", ours + "NUM_CLASSES = 10\n" + use)
    )
    command = ["ruff", "check", "--no-cache", "--extend-select", "E501", "."]
    check = subprocess.run(command, cwd=project, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    script.write_text(script.read_text().replace("# isort: split\n", ""))
    check = subprocess.run(command, cwd=project, capture_output=True, text=True)
    assert "I001" in check.stdout, check.stdout


def test_shellcheck(baked):
    scripts = sorted(str(p) for p in baked[0].glob("*/*.sh"))
    scripts += sorted(str(p) for p in baked[0].glob("*/*.sbatch"))
    assert len(scripts) == sum(
        1 + (a["nodes"] == "multi") + (a["scheduler"] == "slurm") for a in COMBINATIONS
    )
    result = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_template_has_no_repo_only_files():
    (folder,) = TEMPLATE.glob("{{*}}")
    assert folder.name == "{{cookiecutter.project_slug}}"  # the design card's name
    names = {p.name for p in folder.iterdir()}
    assert names == COMMON_FILES | {"run_multi.sh", "run_slurm.sbatch"}


def test_template_sources_stay_small():
    """The template is split by concern (README: "Maintaining the template"): no
    source file grows back into one that interleaves every variant."""
    sources = [*TEMPLATE.glob("{{*}}/*"), *(TEMPLATE / "templates").rglob("*.*")]
    assert len(sources) > 30
    sizes = {
        path.relative_to(TEMPLATE).as_posix(): (
            path.read_text().count("\n"),
            path.read_text().count("{%"),
        )
        for path in sources
    }
    too_big = {name: size for name, size in sizes.items() if size[0] > 800}
    too_many_tags = {name: size for name, size in sizes.items() if size[1] > 40}
    assert too_big == too_many_tags == {}
