"""Projects as users of Hugging Face libraries write them, with the real libraries:
their imports at the top of the edit zone stay theirs (`import datasets`,
`import evaluate`: no name of the generated file replaces them), and a Hugging Face
`datasets.Dataset` trains. Flags of the
project's own, from add_arguments() in the edit zone."""

import functools
import re

import pytest
import torch

from conftest import (
    PYTHON,
    bake,
    error_lines,
    load_weights,
    max_difference,
    replace_user_functions,
    run_job,
    run_single,
    run_warm,
)
from test_streams import readme_block

# The Hugging Face libraries the tests' edit zones import, imported once by the warm
# interpreter their ranks fork from (not by each rank of each run: 3 s each).
HUGGING_FACE = ["datasets", "evaluate", "peft", "transformers"]
HUGGING_FACE += ["transformers.models.gpt2.modeling_gpt2"]
warm = functools.partial(run_warm, preload=HUGGING_FACE)

HUGGING_FACE_NAMES = """
import datasets
import evaluate


def build_datasets(args):
    generator = torch.Generator().manual_seed(args.seed)
    n = args.train_size + args.val_size
    x = torch.randn(n, 12, generator=generator)
    columns = {"x": x.tolist(), "y": x[:, :3].argmax(1).tolist()}  # learnable
    table = datasets.Dataset.from_dict(columns).with_format("torch")
    cut = args.train_size
    return table.select(range(cut)), table.select(range(cut, n))


def build_model(args):
    assert isinstance(evaluate.load, types.FunctionType)  # the library's, not ours
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))


def compute_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"]), len(batch["y"])


def compute_metrics(model, batch):
    logits, y = model(batch["x"]), batch["y"]
    return {
        "loss": (F.cross_entropy(logits, y, reduction="sum"), len(y)),
        "acc": ((logits.argmax(1) == y).sum(), len(y)),
    }
"""


def test_import_datasets_and_evaluate_in_the_edit_zone(tmp_path):
    project = bake(tmp_path / "project")
    replace_user_functions(project, "import types\n" + HUGGING_FACE_NAMES)
    args = ["--epochs", "2", "--train-size", "64", "--val-size", "37"]
    args += ["--num-workers", "0", "--lr", "0.05"]
    output = warm(project, tmp_path / "out", 2, *args, "--batch-size", "8")
    accuracy = [float(x) for x in re.findall(r"val_acc ([0-9.]+)", output)]
    assert len(accuracy) == 2 and accuracy[1] > 0.4, output  # 3 classes: it learns


TABULAR_DATA = """
def build_datasets(args):
    generator = torch.Generator().manual_seed(args.seed)
    n = args.train_size + args.val_size
    x, y = torch.randn(n, 12, generator=generator), torch.randint(3, (n,), generator=generator)
    cut = args.train_size
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])
"""

OWN_FLAGS = """
import math


def build_model(args):
    return nn.Sequential(nn.Linear(12, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 3))


def add_arguments(parser):
    parser.add_argument("--train-size", type=int, default=64)
    parser.add_argument("--val-size", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=16, help="hidden units")
    parser.add_argument("--label-smoothing", type=float, default=math.pi / 100)
"""


def test_flags_of_your_own(tmp_path):
    """add_arguments() in the edit zone: its flags show in --help in a group of their
    own with their defaults, refuse a bad value in one line (exit 2), reach
    build_model, and are kept in the checkpoint's args; a resume takes the command
    line's value, as for the template's flags."""
    project = bake(tmp_path / "project")
    replace_user_functions(project, TABULAR_DATA + OWN_FLAGS)
    code, output = run_job([PYTHON, "main_multi_gpu.py", "--help"], project)
    assert code == 0, output
    group = output.split("this project's:\n")[1]
    assert re.search(r"--hidden HIDDEN +hidden units \(default: 16\)", group), output
    assert "--label-smoothing LABEL_SMOOTHING" in group, output

    args = ["--train-size", "64", "--val-size", "20", "--batch-size", "8"]
    args += ["--num-workers", "0"]
    out = tmp_path / "out"
    output = run_single(project, out, 2, *args, "--hidden", "x", expect=2)
    line = "error: argument --hidden: invalid int value: 'x' (see --help)"
    assert error_lines(output) == [line], output
    run_warm(project, out, 2, *args, "--epochs", "1", "--hidden", "8")
    checkpoint = load_weights(out / "checkpoint_last.pt")
    assert checkpoint["args"]["hidden"] == 8
    assert checkpoint["args"]["label_smoothing"] == pytest.approx(0.0314159)
    assert load_weights(out / "model_final.pt")["0.weight"].shape == (8, 12)
    run_warm(project, out, 2, *args, "--epochs", "2", "--hidden", "8")
    assert load_weights(out / "checkpoint_last.pt")["epoch"] == 2


# A GPT-2 loaded with transformers' from_pretrained from a folder the test writes (a
# tiny random one, no download), trained on random tokens.
GPT2 = """
import transformers


def build_datasets(args):
    generator = torch.Generator().manual_seed(args.seed)
    n = args.train_size + args.val_size
    tokens = torch.randint(64, (n, 16), generator=generator)
    return TensorDataset(tokens[: args.train_size]), TensorDataset(tokens[args.train_size :])


def build_model(args):
    model = transformers.GPT2LMHeadModel.from_pretrained(os.environ["TEST_GPT2"])
    if os.environ.get("TEST_CHECKPOINTING"):  # each block's activations recomputed
        model.gradient_checkpointing_enable()
    return model


def build_optimizer(model, args, total_updates):
    return torch.optim.SGD(model.parameters(), lr=args.lr), None


def compute_loss(model, batch):
    (tokens,) = batch
    return model(input_ids=tokens, labels=tokens).loss, len(tokens)


def compute_metrics(model, batch):
    (tokens,) = batch
    loss = model(input_ids=tokens, labels=tokens).loss
    return {"loss": (loss * len(tokens), len(tokens))}
"""


def tiny_gpt2(folder, vocab_size=64, n_positions=16, eos=None):
    """A GPT-2 of 2 layers, 32 wide, no dropout, saved as from_pretrained reads it;
    returns its weights."""
    import transformers

    config = transformers.GPT2Config(
        vocab_size=vocab_size, n_positions=n_positions, n_embd=32, n_layer=2, n_head=2
    )
    if eos is not None:
        config.bos_token_id = config.eos_token_id = eos
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(folder)
    return model.state_dict()


def test_from_pretrained_under_fsdp2_ends_where_ddp_ends(tmp_path):
    """build_model calls from_pretrained: under FSDP2 (ranks other than 0 cannot
    build it on the meta device) it trains, from the saved weights (--lr 0 ends with
    them), each rank holding half the parameters, and 2 ranks x 4 end where DDP's
    2 x 4 end, with transformers' activation checkpointing of its blocks too."""
    saved = tiny_gpt2(tmp_path / "gpt2")
    env = {"TEST_GPT2": str(tmp_path / "gpt2")}
    args = ["--epochs", "1", "--train-size", "32", "--val-size", "12"]
    args += ["--batch-size", "4", "--num-workers", "0"]
    finals = {}
    for parallelism, checkpointing in (("ddp", ""), ("fsdp2", "1")):
        project = bake(tmp_path / parallelism, parallelism=parallelism)
        replace_user_functions(project, GPT2)
        out = tmp_path / f"{parallelism}-out"
        env |= {"TEST_CHECKPOINTING": checkpointing}
        output = warm(project, out, 2, *args, "--lr", "0.05", env=env)
        finals[parallelism] = load_weights(out / "model_final.pt")
    moved = max_difference(finals["ddp"], saved)
    assert moved > 1e-3
    assert max_difference(finals["fsdp2"], finals["ddp"]) < 1e-5
    # FSDP2's line: each of 2 ranks holds half the parameters (the tied embedding
    # and head once).
    whole = sum({p.data_ptr(): 4 * p.numel() for p in saved.values()}.values()) / 2**20
    held = float(re.search(r"memory per rank: parameters ([0-9.]+) MiB", output)[1])
    assert 0.4 * whole < held < 0.6 * whole, (held, whole)
    still = tmp_path / "still"
    warm(project, still, 2, *args, "--lr", "0", env=env)
    assert max_difference(load_weights(still / "model_final.pt"), saved) == 0


WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "under",
    "mat",
    "log",
    "red",
    "blue",
    "big",
    "small",
    "fast",
    "slow",
]


def tiny_language_model(folder, lines):
    """A word-level tokenizer trained on `lines` (tokenizers), and a tiny GPT-2 of
    its vocabulary, saved in `folder` as AutoTokenizer and AutoModelForCausalLM read
    them; returns the model's weights."""
    import tokenizers
    import transformers

    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"])
    tokenizer.train_from_iterator(lines, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>"
    )
    fast.save_pretrained(folder)
    return tiny_gpt2(folder, len(fast), 32, fast.eos_token_id)


def lora_project(tmp_path, **answers):
    """A project of the README's LoRA recipe as written, a tokenizer trained here and
    a tiny GPT-2 of its vocabulary: (project, its flags, the base's weights)."""
    generator = torch.Generator().manual_seed(0)
    lines = [
        " ".join(WORDS[i] for i in torch.randint(len(WORDS), (n,), generator=generator))
        for n in torch.randint(3, 12, (80,), generator=generator).tolist()
    ]
    base = tiny_language_model(tmp_path / "lm", lines)
    (tmp_path / "train.txt").write_text("\n".join(lines[:64]) + "\n")
    (tmp_path / "val.txt").write_text("\n".join(lines[64:]) + "\n")
    project = bake(tmp_path / "project", **answers)
    replace_user_functions(project, readme_block(project, "peft.LoraConfig("))
    args = ["--model", str(tmp_path / "lm"), "--seq-len", "16"]
    args += ["--train-file", str(tmp_path / "train.txt")]
    args += ["--val-file", str(tmp_path / "val.txt")]
    args += ["--epochs", "2", "--batch-size", "4", "--lr", "0.01"]
    return project, args, base


def saved_model_keys(path):
    """The model's keys a checkpoint holds (a file, or FSDP2's folder), and its
    size in bytes."""
    if path.is_dir():
        from torch.distributed.checkpoint import FileSystemReader

        names = FileSystemReader(path).read_metadata().state_dict_metadata
        keys = {key.removeprefix("model.") for key in names if key.startswith("model.")}
        return keys, sum(f.stat().st_size for f in path.iterdir())
    return set(load_weights(path)["model"]), path.stat().st_size


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp2"])
def test_the_readmes_lora_fine_tune_of_a_language_model(tmp_path, parallelism):
    """The README's recipe as written (transformers, peft, datasets.map, the
    collator as collate_fn, flags of its own), on a tokenizer trained here and a tiny
    GPT-2: 2 processes train the adapters alone (the base as loaded), rank 0 saved
    the tokenizer, and the README's save_adapter.py writes an adapter folder that
    peft's PeftModel.from_pretrained loads to the weights of model_final.pt.

    Its checkpoints hold the adapters, not the frozen base, which a resume builds
    again with build_model (checked against the fingerprints the checkpoint keeps):
    stopped after a pass and resumed, the run ends where one never stopped ends;
    --evaluate of the checkpoint prints the numbers of the pass that wrote it; a
    base that build_model() now loads otherwise is refused in one line."""
    import peft
    import transformers

    project, args, base = lora_project(tmp_path, parallelism=parallelism)
    args += ["--num-workers", "0"]
    out, cut = tmp_path / "out", tmp_path / "cut"
    output = warm(project, out, 2, *args)
    assert output.count("val_loss") == 2, output

    final = load_weights(out / "model_final.pt")
    adapters = {k: v for k, v in final.items() if "lora_" in k}
    frozen = {
        k.replace("base_model.model.", "").replace("base_layer.", ""): v
        for k, v in final.items()
        if "lora_" not in k
    }
    assert max_difference(frozen, base) == 0  # the base as from_pretrained loaded it
    assert max(v.abs().max().item() for k, v in adapters.items() if "lora_B" in k) > 0
    assert (out / "tokenizer" / "tokenizer.json").exists()

    (project / "save_adapter.py").write_text(readme_block(project, "# save_adapter.py"))
    code, said = run_job(
        [PYTHON, "save_adapter.py", *args, "--output-dir", str(out)], project
    )
    assert code == 0, said
    written = {p.name: p.stat().st_size for p in (out / "adapter").iterdir()}
    assert written["adapter_model.safetensors"] < 100_000, written
    assert "adapter_config.json" in written, written
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lm")
    loaded = peft.PeftModel.from_pretrained(model, out / "adapter").state_dict()
    assert max_difference(loaded, final) == 0

    # The checkpoint after one pass: the adapters, and the base's names alone.
    pass_1 = warm(project, cut, 2, *args, "--epochs", "1")

    name = "checkpoint_last" + ("" if parallelism == "fsdp2" else ".pt")
    after_one = load_weights(cut / "model_final.pt")  # the whole model
    keys, size = saved_model_keys(cut / name)
    state = cut / name / "train_state.pt" if parallelism == "fsdp2" else cut / name
    base_names = {k for k in after_one if "lora_" not in k}
    assert keys == set(after_one) - base_names, keys  # the adapters alone
    assert set(load_weights(state)["frozen"]) == base_names
    # With the base it would be more than the whole model, its optimizer state besides.
    assert size < (cut / "model_final.pt").stat().st_size

    # --evaluate of it: the numbers of the pass that wrote it.
    evaluated = warm(project, cut, 2, *args, "--evaluate", str(cut / name))
    scores = [re.findall(r"val_\w+ \S+", text) for text in (pass_1, evaluated)]
    assert scores[0] == scores[1] != [], (pass_1, evaluated)

    warm(project, cut, 2, *args)  # resumed: pass 2
    assert max_difference(load_weights(cut / "model_final.pt"), final) < 1e-6

    # Another base where the checkpoint's was: one line, no resume.
    other = tmp_path / "other"
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lm")
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[0, 0] += 0.01
    model.save_pretrained(other)
    for file in (tmp_path / "lm").glob("*token*"):
        (other / file.name).write_bytes(file.read_bytes())
    changed = [*args, "--model", str(other), "--epochs", "3"]
    output = warm(project, cut, 2, *changed, expect=1)
    weight = "base_model.model.transformer.h.1.mlp.c_fc.weight"
    said = f"error: {cut / name} leaves out {weight} (frozen), which build_model()"
    assert [line[: len(said)] for line in error_lines(output)] == [said], output
