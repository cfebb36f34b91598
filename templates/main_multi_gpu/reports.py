# --------------------------------------------------------------------------------------
# Reports: progress, metrics.csv, the time per epoch, the trackers, preflight
# --------------------------------------------------------------------------------------
class Reports(contextlib.ExitStack):
    """Everything a run reports besides the training itself: where the time goes,
    metrics.csv, the trackers and the line per evaluation. Every rank
    times its own steps; rank 0 alone shows and writes. What it starts ends with the
    `with` block (an ExitStack)."""

    def __init__(self, t, at, out_dir):
        super().__init__()
        self.t, self.out_dir, self.is_main = t, out_dir, dist.get_rank() == 0
        # The exit status the trackers get: a stop sets it.
        self.trackers, self.code = None, 0
{% if fsdp %}
        self.memory_shown = False
        for optimizer in t.optimizers.values():
            self.callback(optimizer.register_step_post_hook(self.show_memory).remove)
{% endif %}
        if t.args.tracker:  # rank 0's (they start in the background)
            self.trackers = by_rank_0(t.device, Trackers, t, out_dir, at.step)
            if self.trackers:  # ended with the right status however the run ends
                self.push(lambda err, *_: self.trackers.end(1 if err else self.code))
        self.start_interval()
        # Progress inside a pass, at each check: rank 0's, unless --no-progress; on
        # a terminal (live), one line drawn again in place.
        self.live = self.is_main and not t.args.no_progress and sys.stdout.isatty()
        self.shown = None, time.perf_counter()  # the last line's mark, and time
        self.callback(self.end_line)
{% if fsdp %}

    def show_memory(self, optimizer, *_):
        """FSDP2, after the first update (the optimizer's state exists from then on):
        the memory this rank holds, about 1/world_size of a whole copy's."""
        if self.memory_shown:
            return
        self.memory_shown = True
        params = list(self.t.model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        state = [s for group in optimizer.state.values() for s in group.values()]
        sizes = [mib(params), mib(grads), mib(state)]
        line = "memory per rank: parameters {:.2f} MiB, gradients {:.2f} MiB, "
        line = (line + "optimizer state {:.2f} MiB").format(*sizes)
        if self.t.device.type == "cuda":  # the most this rank's GPU held at once
            peak = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
            line += "; GPU peak {:.0f} MiB allocated, {:.0f} reserved".format(
                *(size / 2**20 for size in peak)
            )
        print0(line)
{% endif %}

    def start_interval(self):
        """From here on the next row's numbers: time, samples, data wait."""
        self.since, self.data_s, self.samples = time.perf_counter(), 0.0, 0
        self.trained, self.aside_s, self.stepping = self.since, 0.0, False

    def step_done(self):
        """The step under way, if any, ends here: training stopped for the row. (On a
        GPU the CPU runs ahead; the check before an evaluation waits for the GPU, so a
        row's training time is right.)"""
        if self.stepping:
            self.stepping, self.trained = False, time.perf_counter()

    def save(self, at, names):
        """save_checkpoints(), between steps: not training, so in epoch_s, but kept
        out of the steps' times and samples_per_s."""
        tick = time.perf_counter()
        save_checkpoints(self.t, at, names)
        self.aside_s += time.perf_counter() - tick

    def batches(self, data, at):
        """The pass's (batch, ...) tuples from `data`, timed: the wait for each
        batch, and each step from its batch to the next request; and counted."""
        done = at.epoch_samples  # samples of the pass done, over all ranks
        while True:
            tick = time.perf_counter()
            item = next(data, None)
            self.data_s += time.perf_counter() - tick
            if item is None:
                return
            self.stepping = True
            WATCH.beats += 1
            self.samples, done = self.samples + item[2] - done, item[2]
            yield item
            self.step_done()

    def progress(self, at):
        """Rank 0, at a check (with the loss so far, over all ranks): where the pass
        and the run stand. On a terminal one line, drawn again in place; elsewhere (a
        log, a pipe) a line every tenth of a pass or 5 minutes, whichever is first."""
        t, now = self.t, time.perf_counter()
        if t.args.no_progress or not (self.is_main and at.epoch_samples):
            return  # (quiet; or a pass's end, whose row follows)
        done = math.ceil(at.epoch_samples / t.global_batch)  # the pass's updates done
        per_pass = t.updates_per_pass
        mark = at.epoch, 10 * done // per_pass if per_pass else 0  # the pass's tenth
        if not self.live and mark == self.shown[0] and now - self.shown[1] < 300:
            return  # (a stream without a length: a line every 5 minutes)
        self.shown = mark, now
        rate = self.samples / max(now - self.since - self.aside_s, 1e-9)  # samples/s

        def left(updates):
            return timedelta(seconds=round(updates * t.global_batch / rate))

        line = f"epoch {at.epoch + 1}  update {done}/{per_pass or '?'}  {rate:.1f} "
        line += f"samples/s  train_loss {t.sums.so_far:.4g}  left: "
        line += f"pass {left(per_pass - done)}, " if per_pass else ""
        line += f"run {left(t.total_updates - at.step)}"
        print(f"\r{line}\033[K" if self.live else f"{line}\n", end="", flush=True)

    def end_line(self):
        """Erase the live progress line (if any) before another line, or at the end."""
        if self.live:
            print("\r\033[K", end="", flush=True)

    def row(self, at, metrics):
        """An evaluation's row in metrics.csv (and the trackers), and its line: the
        training since the previous row (its steps; saves left out), then the
        validation metrics. Every rank calls it, after the check that summed the
        training loss over the ranks."""
        by_rank_0(self.t.device, self.write, at, self.t.sums.so_far, metrics)
        self.t.sums.sums.zero_()  # counted afresh from here (a checkpoint: from 0)
        self.t.sums.reduced = (0.0, 0.0)
        self.start_interval()

    def write(self, at, train_loss, metrics):
        """Rank 0: the row into metrics.csv and the trackers, and as a line."""
        trained_s = self.trained - self.since - self.aside_s  # saves left out
        epoch = at.epoch if not at.epoch_samples else at.epoch + 1  # done, or under way
        row = {"epoch": epoch, "step": at.step, "train_loss": train_loss}
        row |= {f"val_{name}": value for name, value in metrics.items()}
        row |= {  # each optimizer's: lr, or lr_NAME for several
            f"lr_{name}" if name else "lr": optimizer.param_groups[0]["lr"]
            for name, optimizer in self.t.optimizers.items()
        }
        row |= {
            "samples_per_s": self.samples / trained_s,
            "epoch_s": time.perf_counter() - self.since,
            "data_s": self.data_s,
            "compute_s": trained_s - self.data_s,
        }
        path = self.out_dir / "metrics.csv"  # a column new in it joins the header
        write_metrics(path, [*read_metrics(path), row])
        args, epoch, step = self.t.args, row.pop("epoch"), row.pop("step")
        if self.trackers:
            self.trackers.log({"epoch": epoch, **row}, step)
        head = f"epoch {epoch}/{args.epochs}  step {step}"
        if args.max_steps:  # the run's length in steps
            head = f"step {step}/{args.max_steps}  epoch {epoch}"
        self.end_line()
        print(f"{head}  {one_line(row)}", flush=True)


{% if fsdp %}
def mib(tensors):
    """MiB of this rank's shards of these tensors (DTensors, or plain ones)."""
    shards = [local(t) for t in tensors if torch.is_tensor(t)]
    sizes = [t.numel() * t.element_size() for t in shards]
    return sum(sizes) / 2**20


{% endif %}
def start_metrics(out_dir, done):
    """Make the output folder; keep metrics.csv's rows of the updates already done
    (none on a fresh start), drop the rest."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "metrics.csv"
    rows = read_metrics(path) if done else []
    write_metrics(path, [row for row in rows if int(row["step"]) <= done])


def read_metrics(path):
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def write_metrics(path, rows):
    """Rewrite metrics.csv whole (a row per evaluation: small), atomically."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with replacing(path, "w") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(  # floats to 8 significant digits
            {k: f"{v:.8g}" if isinstance(v, float) else v for k, v in row.items()}
            for row in rows
        )


TRACKER_GRACE = 30  # seconds a tracker may take to end, at the end of a run


class Trackers:
    """Rank 0's experiment trackers (--tracker): one tracker run per output folder.
    DIR/trackers.json keeps the runs' ids, so that a resume, a requeue, an elastic
    round or the same command after a crash go on with the same runs (--resume
    never: new ones). Each optimizer update is logged once, as step = updates done:
    those a crash makes the next attempt repeat, the runs already have. Each tracker
    works in a thread of its own (see serve()): the loop only queues its calls."""

    def __init__(self, t, out_dir, step):
        args, self.path = t.args, out_dir / "trackers.json"
        fresh = args.resume == "never" or not self.path.exists()
        self.saved = {} if fresh else json.loads(self.path.read_text())
        config = {key: plain(value) for key, value in vars(args).items()}
        config |= {"world_size": dist.get_world_size(), "global_batch": t.global_batch}
        config["template"] = (  # the answers this file was generated with
            "nodes={{ cookiecutter.nodes }} launcher={{ cookiecutter.launcher }} parallelism={{ cookiecutter.parallelism }} use_batch_sampler={{ cookiecutter.use_batch_sampler }} "
            "sync_bn={{ cookiecutter.sync_bn }} save_strategy={{ cookiecutter.save_strategy }} scheduler={{ cookiecutter.scheduler }}"
        )
        # A run gets the configuration once; a later attempt, what it changed (MLflow
        # refuses a changed value).
        old, attempt = self.saved.get("config", {}), self.saved.get("attempts", 0) + 1
        changed = {key: value for key, value in config.items() if old.get(key) != value}
        at = f"from attempt {attempt} at step {step}"
        self.lock = threading.Lock()  # trackers.json is written by their threads too
        self.save(config=old | config, attempts=attempt)
        self.threads, self.dropped = {}, {}  # by name
        for name in args.tracker:
            run_id = self.saved.get(name)
            values = {f"{k} {at}": v for k, v in changed.items()} if run_id else config
            begin = functools.partial(TRACKERS[name], run_id, values, out_dir, args)
            calls = queue.SimpleQueue()
            thread = threading.Thread(target=self.serve, args=(name, begin, calls))
            thread.daemon = True  # one still busy at the end ends with this process
            self.threads[name] = thread, calls
            thread.start()

    def save(self, **changes):
        with self.lock, replacing(self.path, "w") as f:
            self.saved |= changes
            json.dump(self.saved, f, indent=1)

    def serve(self, name, begin, calls):
        """A tracker's thread: its start, then each call the loop queues: log (0) a
        row, end (1) the run. A slow one (a server and its retries) never holds
        training up; one that raises is dropped, in one warning line, while training
        goes on, and is ended all the same once it started."""
        try:
            run_id, *methods = begin()
            self.save(**{name: run_id})
        except Exception as err:  # noqa: BLE001 (the tracker's failure, not training's)
            return self.drop(name, err)
        for method, *args in iter(calls.get, None):
            try:
                if method or name not in self.dropped:
                    methods[method](*args)
            except Exception as err:  # noqa: BLE001
                self.drop(name, err)

    def drop(self, name, err):
        if name not in self.dropped:
            self.dropped[name] = why = (str(err).strip() or repr(err)).splitlines()[0]
            print(f"warning: --tracker {name} failed ({why}): dropped", file=sys.stderr)

    def log(self, row, step):
        """An evaluation's row, at its step, unless the runs have it already."""
        if step > self.saved.get("step", 0):
            self.save(step=step)  # first: a crash can lose a row, never repeat it
            for _, calls in self.threads.values():
                calls.put((0, row, step))

    def end(self, code):
        """Every run ends with the exit status (0, 128 + a stop signal, or 1), each
        tracker given TRACKER_GRACE seconds to finish what is queued. All are told
        first, so they end side by side: a slow one holds no other's end back."""
        for _, calls in self.threads.values():
            calls.put((1, code))
            calls.put(None)
        for name, (thread, _) in self.threads.items():
            thread.join(TRACKER_GRACE)
            if thread.is_alive():  # a daemon: it ends with this process
                self.drop(name, f"no answer within {TRACKER_GRACE} s")
        self.threads = {}  # ended: a second end() does nothing


# Each tracker: its run's id (a new one for None), and how to log and end it.
def tensorboard_run(run_id, config, out_dir, args):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(out_dir / "tensorboard")
    writer.add_text("config", json.dumps(config, indent=1))

    def log(row, step):
        for key, value in row.items():
            writer.add_scalar(key, value, step)

    return "tensorboard", log, lambda code: writer.close()


def wandb_run(run_id, config, out_dir, args):
    import wandb

    run = wandb.init(
        project=args.experiment,
        name=args.run_name or out_dir.name,
        id=run_id,
        resume="allow",
        dir=out_dir,
        config=config,
        settings=wandb.Settings(console="off", silent=True),  # the lines are ours
    )

    def end(code):
        if code > 128:  # stopped by a signal, after a save: preempted
            run.mark_preempting()
        run.finish(exit_code=code)
        wandb.teardown()  # its service process, before stop_children()

    return run.id, run.log, end


def mlflow_run(run_id, config, out_dir, args):
    import mlflow

    for logger in ("mlflow", "alembic"):  # a new SQLite file's lines
        logging.getLogger(logger).setLevel(logging.WARNING)
    # Its store: $MLFLOW_TRACKING_URI, else a SQLite file in the output folder.
    default = f"sqlite:///{(out_dir / 'mlflow.db').absolute()}"
    mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI", default))
    if run_id is None:  # a new run (an old one knows its experiment)
        mlflow.set_experiment(args.experiment)
    run = mlflow.start_run(run_id, run_name=args.run_name or out_dir.name)
    mlflow.log_params(config)

    def end(code):
        mlflow.end_run("KILLED" if code > 128 else "FAILED" if code else "FINISHED")

    return run.info.run_id, mlflow.log_metrics, end


TRACKERS = {"tensorboard": tensorboard_run, "wandb": wandb_run, "mlflow": mlflow_run}


def preflight(device, backend):
    """Every rank reports where it runs, then one all-reduce and a bandwidth probe."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    payload = torch.ones(8 * 2**20, device=device)  # 32 MiB of float32
    dist.all_reduce(payload)  # the check, and a warm-up
    if (total := payload[0].item()) != world_size:  # on a GPU: waits for it
        raise failure(f"error: all-reduce gave {total}, not {world_size}")
    start, repeats = time.perf_counter(), 5
    for _ in range(repeats):
        dist.all_reduce(payload)
    payload[0].item()
    each = (time.perf_counter() - start) / repeats
    # Bus bandwidth, as nccl-tests reports it: what each link carries in a ring.
    gb_per_s = payload.numel() * 4 * 2 * (world_size - 1) / world_size / each / 1e9
    label = str(device)
    if device.type == "cuda":
        label += f" {torch.cuda.get_device_name(device)}"
    local_rank = os.environ.get("LOCAL_RANK", "0")
    row = f"{rank:>4}  {socket.gethostname():<20} {local_rank:>5}  {label:<29}"
    rows = gathered(f"{row} {gb_per_s:>8.2f}".encode(), device)
    print0(f"preflight: {world_size} ranks, backend {backend}, all-reduce ok")
    print0(f"{'rank':>4}  {'host':<20} {'local':>5}  {'device':<29} {'GB/s':>8}")
    print0("\n".join(row.decode() for row in rows))


