"""Recipes beyond the five functions, written in the edit zone only: the generated
README's "Recipes" examples, pasted over the default functions as a user would, keep
the guarantees. W processes x batch B equal 1 x W.B (with --grad-accum, --compile and
clipping where they apply), a stop (SIGTERM, or kill -9 with --save-every) and the same
command again equal a run never stopped, and evaluation, --evaluate and the saved
weights agree.
- unused parameters and activation checkpointing (FIND_UNUSED_PARAMETERS), and the
  one line a run gets without the setting;
- Muon and AdamW on one loss, each with its schedule, an lr column each, a new --lr
  on resume;
- a GAN's alternating updates (ALTERNATE), each with its own loss;
- an EMA of the weights declared with keep(), evaluated and saved beside the model."""

import math
import shutil

import pytest
import torch

from conftest import (
    act_after_step,
    bake,
    edit,
    error_lines,
    load_module,
    load_weights,
    max_difference,
    metrics,
    replace_user_functions,
    run_warm,
    without_batchnorm,
)
from test_faults import watch
from test_streams import readme_block

COMMON = ["--num-workers", "0", "--val-size", "37", "--train-size", "64"]
KILL = "os.kill(os.getpid(), signal.SIGKILL)"  # no handler runs: nothing saved
SIGTERM = "os.killpg(os.getpgrp(), signal.SIGTERM)"  # the whole job, as Slurm does


def recipe(tmp_path, marker, **answers):
    """The default project with the README's recipe that contains `marker`."""
    project = bake(tmp_path / "project", **answers)
    replace_user_functions(project, readme_block(project, marker))
    return project


def train(project, out_dir, nproc, *args, expect=0, env=None):
    return run_warm(project, out_dir, nproc, *COMMON, *args, env=env, expect=expect)


def final(out_dir, name="model_final.pt"):
    return load_weights(out_dir / name)


def start_weights(project):
    module = load_module(project)
    torch.manual_seed(0)
    return module.build_model(module.parse_args([])).state_dict()


def two_equal_one(project, tmp_path, args, batch, names=("model_final.pt",)):
    """2 processes x `batch`, then 1 x 2 `batch`: the same weights in each file of
    `names`. Returns the 2-process run's folder."""
    two, one = tmp_path / "w2", tmp_path / "w1"
    train(project, two, 2, *args, "--batch-size", str(batch))
    train(project, one, 1, *args, "--batch-size", str(2 * batch))
    for name in names:
        assert max_difference(final(two, name), final(one, name)) < 1e-5
    return two


def stopped(project, out_dir, *args):
    """A 2-process run that SIGTERM stops after update 2 (act_after_step): it saves
    and exits 143. Returns its output."""
    stop = {"TEST_ACT_AT": "0:0:1", "TEST_ACTION": SIGTERM}
    return train(project, out_dir, 2, *args, env=stop, expect=143)


def killed_and_rerun(project, out_dir, *args):
    """Rank 1 killed with kill -9 after its 2nd step of pass 2 (act_after_step), as a
    user launches the job; then the same command. Returns the rerun's output."""
    command = ["./run_single.sh", *COMMON, *args, "--output-dir", str(out_dir)]
    kill = {"NPROC_PER_NODE": "2", "TEST_ACT_AT": "1:1:1", "TEST_ACTION": KILL}
    code, output, _, left = watch(command, project, kill)
    assert code == 1 and left == [] and "error: rank 1 died (SIGKILL)" in output
    return train(project, out_dir, 2, *args)


# -- unused parameters, activation checkpointing ----------------------------------------


def test_unused_parameters_and_activation_checkpointing(tmp_path):
    project = recipe(tmp_path, "class Net(")
    args = ["--epochs", "2", "--lr", "0.05"]
    w2 = final(two_equal_one(project, tmp_path, args, 8))
    accum = [*args, "--batch-size", "8", "--grad-accum", "2", "--compile"]
    train(project, tmp_path / "accum", 1, *accum)
    start = start_weights(project)
    assert max_difference(w2, final(tmp_path / "accum")) < 1e-5
    assert max_difference(w2, start) > 1e-2  # it trained
    assert torch.equal(w2["extra.weight"], start["extra.weight"])  # no gradient

    # Stopped by SIGTERM after update 2 and resumed: the same end.
    act_after_step(project)
    cut = tmp_path / "cut"
    stopped(project, cut, *args, "--batch-size", "8")
    train(project, cut, 2, *args, "--batch-size", "8")
    assert max_difference(final(cut), w2) < 1e-6

    # Without the setting, the first step stops the run in one line that names them.
    edit(
        project, "FIND_UNUSED_PARAMETERS = True  #", "FIND_UNUSED_PARAMETERS = False  #"
    )
    output = train(project, tmp_path / "off", 2, *args, "--batch-size", "8", expect=1)
    line = (
        "error: the step left extra.weight, extra.bias out of its loss: set "
        "FIND_UNUSED_PARAMETERS = True at the top of this file (or freeze them with "
        "requires_grad_(False))"
    )
    assert error_lines(output) == [line], output
    assert (
        "Traceback" not in output and not (tmp_path / "off" / "model_final.pt").exists()
    )


# -- several optimizers on one loss ----------------------------------------------------


def cosine(lr, step, total):
    return lr * (1 + math.cos(math.pi * step / total)) / 2


def test_muon_and_adamw_on_one_loss(tmp_path):
    project = recipe(tmp_path, "torch.optim.Muon")
    without_batchnorm(project)
    act_after_step(project)
    args = ["--epochs", "2", "--lr", "0.02", "--clip-grad-norm", "0.5"]
    a = two_equal_one(project, tmp_path, args, 8)
    rows = metrics(a)
    assert "lr" not in rows[0] and [r["step"] for r in rows] == ["4", "8"]
    for row in rows:  # each optimizer on its own cosine
        step = int(row["step"])
        assert float(row["lr_muon"]) == pytest.approx(cosine(0.02, step, 8), abs=1e-9)
        assert float(row["lr_adamw"]) == pytest.approx(cosine(0.002, step, 8), abs=1e-9)

    # Stopped by SIGTERM after update 2, resumed on 1 process with the same global
    # batch: both optimizers' state came back.
    output = stopped(project, tmp_path / "c", *args, "--batch-size", "8")
    assert "preempted: saved" in output
    train(project, tmp_path / "c", 1, *args, "--batch-size", "16")
    assert max_difference(final(a), final(tmp_path / "c")) < 1e-5

    # One epoch, then a resume with another --lr: both schedules rebuilt for it.
    d, rest = tmp_path / "d", ["--clip-grad-norm", "0.5", "--batch-size", "8"]
    train(project, d, 2, "--epochs", "1", "--lr", "0.02", *rest)
    output = train(
        project, d, 2, "--epochs", "2", "--lr", "0.01", "--eval-every", "2", *rest
    )
    assert "resume: the LR schedule is rebuilt for --lr 0.01" in output, output
    (row,) = [row for row in metrics(d) if row["step"] == "6"]
    assert float(row["lr_muon"]) == pytest.approx(cosine(0.01, 6, 8), abs=1e-9)
    assert float(row["lr_adamw"]) == pytest.approx(cosine(0.001, 6, 8), abs=1e-9)


# -- alternating updates: a GAN ----------------------------------------------------------


def gan(tmp_path, **answers):
    """The README's GAN, with its noise drawn from the images instead of each rank's
    own generator, so that W x B can equal 1 x W.B exactly."""
    project = recipe(tmp_path, "class GAN(", **answers)
    edit(
        project,
        "noise = torch.randn(len(real), NOISE, device=real.device)",
        "noise = real[:, :NOISE]",
    )
    edit(
        project,
        "model.generator(torch.randn(len(real), NOISE, device=real.device))",
        "model.generator(real[:, :NOISE])",
    )
    act_after_step(project)
    return project


GAN_ARGS = ["--epochs", "2", "--lr", "0.001", "--clip-grad-norm", "1.0"]


def test_muon_on_a_torch_without_it_stops_in_one_line(tmp_path):
    """The recipe on a torch before 2.9 (here: torch.optim.Muon taken away, as such a
    release lacks it): one line naming the release it needs, exit 2, nothing written."""
    project = recipe(tmp_path, "torch.optim.Muon")
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import torch.optim\ndel torch.optim.Muon\n")
    out = tmp_path / "out"
    code, output, _, left = watch(
        ["./run_single.sh", *COMMON, "--output-dir", str(out)],
        project,
        {"NPROC_PER_NODE": "2", "PYTHONPATH": str(shim)},
    )
    assert code == 2 and left == [] and "Traceback" not in output, output
    needs = "error: this build_optimizer needs torch.optim.Muon: torch 2.9 or newer"
    assert error_lines(output) == [f"{needs}, not {torch.__version__}"], output
    assert not out.exists()


def test_a_gan_alternates_its_updates(tmp_path):
    project = gan(tmp_path)
    args = [*GAN_ARGS, "--save-every", "3"]
    straight = tmp_path / "straight"
    train(project, straight, 2, *args, "--batch-size", "4", "--grad-accum", "2")
    train(project, tmp_path / "w1", 1, *args, "--batch-size", "16")
    start, done = start_weights(project), final(straight)
    assert max_difference(done, final(tmp_path / "w1")) < 1e-5
    for part in ("generator", "discriminator"):  # both turns trained
        moved = {k: v for k, v in done.items() if k.startswith(part)}
        assert max_difference(moved, {k: start[k] for k in moved}) > 1e-4
    assert {"val_loss", "val_fooled", "lr_discriminator", "lr_generator"} <= set(
        metrics(straight)[0]
    )

    # Rank 1 killed after update 5 (pass 2, its 2nd step), the same command again:
    # update 3's save, both Adams' moments, and the end of the straight run.
    out = tmp_path / "killed"
    output = killed_and_rerun(
        project, out, *args, "--batch-size", "4", "--grad-accum", "2"
    )
    assert "resumed from" in output
    assert max_difference(final(out), done) < 1e-6


# -- an EMA of the weights, kept ------------------------------------------------------------


def test_an_ema_is_kept_evaluated_and_saved(tmp_path):
    project = recipe(tmp_path, "AveragedModel(")
    without_batchnorm(project)
    act_after_step(project)
    args = ["--epochs", "2", "--lr", "0.05"]
    names = ("model_final.pt", "model_final_ema.pt")
    a = two_equal_one(project, tmp_path, args, 8, names)
    ema, trained = final(a, "model_final_ema.pt"), final(a)
    assert 1e-4 < max_difference(ema, trained)  # an average, not the weights

    # Evaluation scored the EMA: --evaluate of its file and of the checkpoint agree.
    last = metrics(a)[-1]
    for path in (a / "model_final_ema.pt", a / "checkpoint_last.pt"):
        output = train(project, a, 2, "--evaluate", str(path))
        assert f"val_loss {float(last['val_loss']):.6g}" in output, output
    # The trained weights, as the README says: numbers of their own, in no row.
    output = train(project, a, 2, "--evaluate", str(a / "model_final.pt"))
    [line] = [x for x in output.splitlines() if x.startswith("evaluate ")]
    val_loss = line.split("val_loss ")[1].split()[0]
    rows = [f"{float(row['val_loss']):.6g}" for row in metrics(a)]
    assert val_loss not in rows, (line, rows)

    # SIGTERM after update 2, resumed: the EMA came back with the model.
    c = tmp_path / "c"
    stopped(project, c, *args, "--batch-size", "8")
    train(project, c, 2, *args, "--batch-size", "8")
    assert max_difference(final(c, "model_final_ema.pt"), ema) < 1e-6

    # Rank 1 killed after update 6 (pass 2), the same command again: from update 4's
    # save, the EMA with it, to the same end.
    killed = tmp_path / "killed"
    output = killed_and_rerun(
        project, killed, *args, "--batch-size", "8", "--save-every", "3"
    )
    assert "resumed from" in output and "after epoch 1" in output, output
    assert max_difference(final(killed, "model_final_ema.pt"), ema) < 1e-6
    # The done line names the evaluated weights beside the trained ones.
    [done] = [line for line in output.splitlines() if line.startswith("done: ")]
    files = f"{killed}/model_final.pt, evaluated {killed}/model_final_ema.pt, metrics"
    assert done.startswith(f"done: weights {files}"), done

    # A checkpoint saved before the EMA was added: one line, not a KeyError.
    plain = bake(tmp_path / "plain")
    without_batchnorm(plain)
    old = tmp_path / "old"
    train(plain, old, 2, "--epochs", "1", "--lr", "0.05", "--batch-size", "8")
    output = train(project, old, 2, *args, "--batch-size", "8", expect=1)
    line = (
        f"error: {old / 'checkpoint_last.pt'} keeps no 'ema'; start afresh with "
        "--resume never or another --output-dir"
    )
    assert error_lines(output) == [line], output


def test_distillation_from_a_frozen_teacher(tmp_path):
    """The README's recipe: the default model trained first is the teacher of a
    student (the default model without BatchNorm). 2 x 8 equals 1 x 16, which the
    teacher's BatchNorm allows only in eval mode (its running statistics, not each
    batch's); the teacher is in no checkpoint; a SIGTERM resume ends the same; and
    the student learns from it (other weights than without it)."""
    teacher = bake(tmp_path / "teacher")
    train(teacher, tmp_path / "t", 1, "--epochs", "2", "--batch-size", "16")
    project = recipe(tmp_path, "TEACHER_WEIGHTS")
    shutil.copy(tmp_path / "t" / "model_final.pt", project / "teacher.pt")
    # The student without BatchNorm (build_model's; build_teacher's, above it, stays).
    script = project / "main_multi_gpu.py"
    head, mark, student = script.read_text().partition("\ndef build_model(")
    for channels in (32, 64):
        student = student.replace(f"nn.BatchNorm2d({channels}),", "nn.Identity(),", 1)
    script.write_text(head + mark + student)
    act_after_step(project)
    args = ["--epochs", "2", "--lr", "0.05"]
    a = two_equal_one(project, tmp_path, args, 8)
    assert list(final(a)) == list(start_weights(project))  # the student's alone
    assert list(final(a, "checkpoint_last.pt")["model"]) == list(final(a))
    c = tmp_path / "c"
    stopped(project, c, *args, "--batch-size", "8")
    train(project, c, 2, *args, "--batch-size", "8")
    assert max_difference(final(c), final(a)) < 1e-6
    plain = bake(tmp_path / "plain")
    without_batchnorm(plain)
    train(plain, tmp_path / "p", 2, *args, "--batch-size", "8")
    assert max_difference(final(tmp_path / "p"), final(a)) > 1e-3  # it was taught


def test_a_gan_drawing_its_noise_resumes_mid_pass_exactly(tmp_path):
    """The README's GAN as written, its noise drawn with torch.randn in compute_loss:
    each process's generator is seeded again at every micro-batch, so a SIGTERM after
    update 2 (saved at update 3's check, in the middle of the first pass) and a resume
    end like a run never stopped. The control: without that seeding, it differs."""
    project = recipe(tmp_path, "class GAN(")
    act_after_step(project)
    args = [*GAN_ARGS, "--batch-size", "8", "--save-every", "3"]
    train(project, tmp_path / "straight", 2, *args)
    cut = tmp_path / "cut"
    stopped(project, cut, *args)
    output = train(project, cut, 2, *args)
    assert "in epoch 1 after 3 batches" in output, output
    straight = final(tmp_path / "straight")
    assert max_difference(final(cut), straight) < 1e-6
    # The control: without the seeding at every micro-batch, the resume draws other
    # noise.
    edit(project, "                reseed(t, at.step, k, i)\n", "")
    again = tmp_path / "again"
    stopped(project, again, *args)
    train(project, again, 2, *args)
    assert max_difference(final(again), straight) > 1e-4


def test_a_gan_under_fsdp2_and_fp16(tmp_path):
    """The same GAN sharded with FSDP2 (2 x 4 equals 1 x 8; the generator is sharded on
    its own, the discriminator stays in the root), and under --amp fp16, whose loss
    scaling each turn applies on its own: it trains close to the float32 run."""
    project = gan(tmp_path, parallelism="fsdp2")
    done = final(two_equal_one(project, tmp_path, GAN_ARGS, 4))
    fp16 = tmp_path / "fp16"
    train(project, fp16, 2, *GAN_ARGS, "--batch-size", "4", "--amp", "fp16")
    moved = max_difference(done, start_weights(project))
    assert max_difference(final(fp16), done) < 0.1 * moved


def test_a_ddp_edit_zone_moves_unchanged_to_fsdp2_and_spawn(tmp_path):
    """The GAN as the DDP project's README writes it (FIND_UNUSED_PARAMETERS = True
    among its settings), pasted into an FSDP2 project started by mp.spawn on
    "several machines": it trains there, as the FSDP2 README's own GAN does (the
    setting has no effect under FSDP2)."""
    ddp = bake(tmp_path / "ddp")
    zone = readme_block(ddp, "class GAN(")
    assert "FIND_UNUSED_PARAMETERS = True" in zone
    project = bake(
        tmp_path / "fsdp2", parallelism="fsdp2", launcher="spawn", nodes="multi"
    )
    replace_user_functions(project, zone)
    moved = tmp_path / "moved"
    output = train(project, moved, 2, *GAN_ARGS, "--batch-size", "4")
    assert output.count("val_loss") == 2, output
    theirs = recipe(tmp_path / "own", "class GAN(", parallelism="fsdp2")
    own = tmp_path / "own-run"
    train(theirs, own, 2, *GAN_ARGS, "--batch-size", "4")
    assert max_difference(final(moved), final(own)) < 1e-6


SGD_AND_ADAMW = '''
def build_optimizer(model, args, total_updates):
    """SGD for the weight matrices and kernels, AdamW for the rest (FSDP2 shards)."""
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    sgd = torch.optim.SGD(matrices, lr=args.lr, momentum=0.9)
    adamw = torch.optim.AdamW(others, lr=args.lr / 10)
    linear = torch.optim.lr_scheduler.LinearLR
    return {"sgd": (sgd, linear(sgd, 1.0, 0.1, total_updates)), "adamw": (adamw, None)}
'''


def test_several_optimizers_under_fsdp2_resume_exactly(tmp_path):
    """Two optimizers over FSDP2's shards: one checkpoint folder holds both states
    (torch.distributed.checkpoint), and a SIGTERM then a resume on 1 process ends like
    the straight run on 2, which equals 1 x 16; --amp fp16 scales and unscales both."""
    project = bake(tmp_path / "project", parallelism="fsdp2")
    replace_user_functions(project, SGD_AND_ADAMW)
    without_batchnorm(project)
    act_after_step(project)
    args = ["--epochs", "2", "--lr", "0.02", "--clip-grad-norm", "1.0"]
    a = two_equal_one(project, tmp_path, args, 8)
    assert {"lr_sgd", "lr_adamw"} <= set(metrics(a)[0])
    c = tmp_path / "c"
    stopped(project, c, *args, "--batch-size", "8")
    train(project, c, 1, *args, "--batch-size", "16")
    assert max_difference(final(a), final(c)) < 1e-5
    fp16 = tmp_path / "fp16"
    train(project, fp16, 2, *args, "--batch-size", "8", "--amp", "fp16")
    moved = max_difference(final(a), start_weights(project))
    assert max_difference(final(fp16), final(a)) < 0.1 * moved
