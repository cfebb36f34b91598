# --------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------
def parse_args(argv=None):
    """The command line. A value that cannot work stops the run here, before anything
    starts: one line, exit status 2."""
{% if fsdp %}
    # FSDP2 trains from torch 2.7 on: 2.6's fails on a CPU, earlier ones lack it.
    if not (hasattr(fsdp, "fully_shard") and hasattr(torch.cpu.Stream, "record_event")):
        needs = "error: parallelism=fsdp2 needs torch 2.7 or newer"
        raise failure(f"{needs}, not {torch.__version__}", status=2)
{% endif %}
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=ShowDefaults)
    parser.error = usage_error
    add_training_arguments(parser.add_argument_group("training"))
    add_long_run_arguments(parser.add_argument_group("long runs"))
    add_speed_arguments(parser.add_argument_group("speed and insight"))
    add_running_arguments(parser.add_argument_group("processes and machines"))
    add_arguments(parser.add_argument_group("this project's"))  # (in EDIT HERE)
    args = parser.parse_args(argv)
    if args.tensorboard and "tensorboard" not in args.tracker:  # the older flag
        args.tracker += tracker_names("tensorboard")
    if not (args.evaluate or args.preflight):  # the modes that write nothing
        # Refuse a --output-dir that rank 0 could not make or write in (this only
        # looks: the folder is made when training starts).
        path = Path(args.output_dir).absolute()
        existing = next(p for p in (path, *path.parents) if p.exists())
        if not existing.is_dir():
            usage_error(f"argument --output-dir: {existing} is a file, not a folder")
        if not os.access(existing, os.W_OK | os.X_OK):
            usage_error(f"argument --output-dir: no permission to write in {existing}")
{% if spawn and multi %}
    if args.node_rank >= args.nnodes:
        usage_error(f"argument --node-rank: must be below --nnodes {args.nnodes}")
{% endif %}
    return args


class ShowDefaults(argparse.HelpFormatter):
    """--help: each flag's meaning, then its default ("off" for a switch or an
    option that is unset unless given)."""

    def _get_help_string(self, action):
        meaning = action.help or ""
        if "default" in meaning or action.default == argparse.SUPPRESS:
            return meaning  # it says its default in its own words
        unset = action.default is None or action.default is False
        return f"{meaning} (default: {'off' if unset else '%(default)s'})"


def usage_error(message):
    """argparse's errors and ours: one line (rank 0), exit 2, before anything starts."""
    raise failure(f"error: {message} (see --help)", status=2)


def at_least(least, most=math.inf, kind=int, above=False):
    """An argparse type: a whole number (kind=float: a finite number) from `least`
    (above=True: above it) to `most`."""

    def number(text):
        value = kind(text)
        low = value > least if above else value >= least
        if not low or value > most or value == math.inf:
            bound = f"above {least}" if above else f"at least {least}"
            top = "" if most == math.inf else f" and at most {most}"
            shown = value if kind is int else text  # a float as given: 1, not 1.0
            raise argparse.ArgumentTypeError(f"must be {bound}{top}, not {shown}")
        return value

    number.__name__ = kind.__name__  # argparse: "invalid int (float) value: ..."
    return number


def count(default=None, least=1):
    """A count flag's type, metavar and default: a whole number N, at least `least`."""
    return {"type": at_least(least), "metavar": "N", "default": default}


def real(default=None, above=False, metavar="F"):
    """A real flag's type, metavar and default: a finite number from 0 (above=True:
    above 0)."""
    number = at_least(0, kind=float, above=above)
    return {"type": number, "metavar": metavar, "default": default}


def add_training_arguments(parser):
    parser.add_argument("--epochs", **count(10), help="passes over the training set")
    parser.add_argument(
        "--batch-size",
        **count(32),
        help="samples per process and step: the global batch is N x processes x "
        "--grad-accum",
    )
    parser.add_argument(
        "--lr", **real(0.1), help="learning rate (0: every step runs, no weight moves)"
    )
    parser.add_argument(
        "--seed",
        **count(0, least=0),
        help="initial weights and data order, the same on every rank",
    )
    parser.add_argument(
        "--num-workers", **count(2, least=0), help="DataLoader workers per process"
    )
    parser.add_argument(
        "--output-dir",
        default="outputs",
        metavar="DIR",
        help="where checkpoints, final weights and metrics go",
    )
    parser.add_argument(
        "--resume",
        default="auto",
        metavar="{auto,never,PATH}",
        help="auto: continue from DIR/checkpoint_last.pt when it exists",
    )
    parser.add_argument(
        "--evaluate",
        metavar="PATH",
        help="only evaluate the weights in PATH (model_final.pt or a checkpoint) on "
        "the validation set and print the metrics; writes nothing",
    )
    parser.add_argument(
        "--grad-accum",
        **count(),
        help="micro-batches per optimizer update (default 1; when resuming, what "
        "keeps the checkpoint's global batch of processes x batch x N)",
    )
    parser.add_argument(
        "--allow-batch-change",
        action="store_true",
        help="resume with a global batch other than the checkpoint's",
    )
    parser.add_argument(
        "--clip-grad-norm", **real(above=True), help="clip the gradients' norm to F"
    )


def add_long_run_arguments(parser):
    parser.add_argument(
        "--max-steps",
        **count(),
        help="the run's length in optimizer updates, instead of --epochs: the data "
        "repeats, with a new shuffle each pass, as often as it takes",
    )
    parser.add_argument(
        "--save-every",
{% if strategy == "final_only" %}
        **count(0, least=0),
        help="also write checkpoint_last.pt every N optimizer updates, so that a "
        "crash without a signal loses at most N (0: never; final_only removes it at "
        "the end)",
{% else %}
        **count(1000, least=0),
        help="also replace checkpoint_last.pt every N optimizer updates, so that a "
        "crash without a signal loses at most N (0: at the end of each pass only)",
{% endif %}
    )
    parser.add_argument(
        "--eval-every",
        **count(),
        help="also evaluate every N optimizer updates (a row of metrics.csv each; "
        "default: at the end of each pass and of the run)",
    )


def add_speed_arguments(parser):
    parser.add_argument(
        "--amp",
        choices=tuple(AMP_DTYPES),
        default="none",
        help="mixed precision: autocast to bfloat16 or float16 (with loss scaling)",
    )
{{ par.compile_flag() }}
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic algorithms, no cudnn.benchmark, no TF32: GPU runs repeat "
        "bit for bit, somewhat slower",
    )
    parser.add_argument(
        "--tracker",
        type=tracker_names,
        default=[],
        metavar="NAMES",
        help="rank 0 logs each evaluation's metrics there too: a comma list of "
        "tensorboard, wandb, mlflow (one tracker run per output folder, continued "
        "by every resume)",
    )
    parser.add_argument(
        "--tensorboard", action="store_true", help="the same as --tracker tensorboard"
    )
    parser.add_argument(
        "--experiment",
        default="{{ cookiecutter.project_slug }}",
        help="the W&B project, the MLflow experiment",
    )
    parser.add_argument("--run-name", help="tracker runs' name (default: DIR's name)")
    parser.add_argument("--no-progress", action="store_true", help="quiet in a pass")


def tracker_names(text):
    """--tracker's type: each name once, known and installed (else one line, before
    any process starts)."""
    names = list(dict.fromkeys(name for name in text.split(",") if name))
    for name in names:
        if name not in TRACKERS:
            choices = ", ".join(TRACKERS)
            raise argparse.ArgumentTypeError(f"{name!r} is not one of {choices}")
        if importlib.util.find_spec(name) is None:  # (found, not imported: rank 0's)
            line = f"error: --tracker {name} needs {name}: pip install {name}"
            raise failure(line, status=2)
    return names


def add_running_arguments(parser):
    parser.add_argument(
        "--backend",
        choices=("auto", "nccl", "gloo"),
        default="auto",
        help="auto: nccl when CUDA is usable, else gloo",
    )
    parser.add_argument(
        "--dist-timeout",
        **real(os.environ.get("DIST_TIMEOUT", "600"), above=True, metavar="S"),
        help="seconds to wait for the other processes at start-up, and that a process "
        "may go without progress before the job ends with a report of where each "
        "one was (default: $DIST_TIMEOUT, else 600)",
    )
    parser.add_argument(
        "--preflight", action="store_true", help="check ranks and network, then exit"
    )
{{ launcher.launcher_flags() }}
    parser.add_argument("--local-rank", "--local_rank", help=argparse.SUPPRESS)


