"""DataLoader workers start from a fresh interpreter (the fork server), never as forks
of a training process, whose communication threads can deadlock a fork (CPython
gh-112275); a dataset they cannot receive is refused in one line."""

import pytest

from conftest import (
    TINY,
    bake,
    error_lines,
    replace_user_functions,
    run_single,
    run_warm,
)

# Random images and labels in train_size + val_size samples, split in two (train and
# val), for a build_datasets() that wraps them in a dataset of its test.
SPLIT_DATA = """
def build_datasets(args):
    generator = torch.Generator().manual_seed(args.seed)
    images = torch.randn(args.train_size + args.val_size, 3, 16, 16, generator=generator)
    labels = torch.randint(10, (len(images),), generator=generator)
    data = TensorDataset(images, labels)
    train = Subset(data, range(args.train_size))
    val = Subset(data, range(args.train_size, len(data)))
"""

# The default data, each sample checked in the worker that loads it: started by the
# fork server (not by the training process), with this file imported as __mp_main__.
CHECKED_ORIGIN = """
class Checked(torch.utils.data.Dataset):
    def __init__(self, data):
        self.data, self.trainer = data, os.getpid()

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        info = torch.utils.data.get_worker_info()
        if info is None:
            raise RuntimeError("loaded in the training process")
        if os.getppid() == self.trainer:
            raise RuntimeError("a DataLoader worker forked from the training process")
        if sys.modules["__main__"].__name__ != "__mp_main__":
            raise RuntimeError("not a fresh interpreter")
        return self.data[index]


"""
CHECKED_ORIGIN += SPLIT_DATA + "    return Checked(train), Checked(val)\n"


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_loader_workers_are_not_forks_of_the_trainer(tmp_path, launcher):
    project = bake(tmp_path, launcher=launcher)
    replace_user_functions(project, CHECKED_ORIGIN)
    assert TINY[-2:] == ["--num-workers", "0"]
    output = run_single(project, tmp_path / "out", 2, *TINY[:-1], "2")
    assert output.count("val_loss") == 2, output


UNPICKLABLE = """
def build_datasets(args):
    class Local(torch.utils.data.Dataset):  # a class no other process can import
        def __len__(self):
            return 16

        def __getitem__(self, index):
            return torch.zeros(3, 16, 16), 0

    return Local(), Local()
"""


def test_a_dataset_workers_cannot_receive_is_one_line(tmp_path):
    project = bake(tmp_path)
    replace_user_functions(project, UNPICKLABLE)
    output = run_single(project, tmp_path / "out", 2, *TINY[:-1], "1", expect=1)
    [line] = error_lines(output)
    assert line.startswith(
        "error: build_datasets() returned a training set that DataLoader workers "
        "cannot receive (Can't pickle local object"
    ), output
    assert line.endswith("or --num-workers 0"), line
    assert "Traceback" not in output
    # With --num-workers 0 nothing is pickled, and the same data trains.
    run_warm(project, tmp_path / "zero", 2, *TINY)


# Each DataLoader worker, as it starts, sends SIGTERM to every process of its rank, as
# a scheduler stopping the job would at that moment: once while it unpickles its copy
# of the dataset (before a line of torch's or this file's own), and once right after
# torch's worker loop installed its own SIGTERM handler (before worker_init_fn runs).
SIGNALLED_AS_IT_STARTS = """
class SignalOnArrival(torch.utils.data.Dataset):
    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.signal_the_job()
        handlers = torch.utils.data._utils.signal_handling
        torch_own = handlers._set_worker_signal_handlers

        def then_signal():
            torch_own()
            self.signal_the_job()

        handlers._set_worker_signal_handlers = then_signal

    @staticmethod
    def signal_the_job():
        os.killpg(os.getpgrp(), signal.SIGTERM)
        time.sleep(0.5)  # the signal arrives here, if not ignored


"""
SIGNALLED_AS_IT_STARTS += SPLIT_DATA + "    return SignalOnArrival(train), val\n"


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_a_sigterm_to_the_job_as_workers_start_saves_and_stops(tmp_path, launcher):
    """SIGTERM and Ctrl-C reach every process of a job, a DataLoader worker still
    starting too: it holds them from birth (as its fork server), so the run saves
    and stops as after any SIGTERM (before: the worker died, and the run ended in a
    traceback, "DataLoader worker ... exited unexpectedly", saving nothing)."""
    project = bake(tmp_path, launcher=launcher, save_strategy="last")
    replace_user_functions(project, SIGNALLED_AS_IT_STARTS)
    args = [*TINY[:-2], "--num-workers", "2"]
    output = run_single(project, tmp_path / "out", 2, *args, expect=143)
    assert "Traceback" not in output and "exited unexpectedly" not in output, output
    assert error_lines(output) == [], output
    assert output.count("preempted: saved ") == 1, output
