# --------------------------------------------------------------------------------------
# The training loop, and the four DDP changes
# --------------------------------------------------------------------------------------
LOG_EVERY = 20  # optimizer updates between progress reports and checks (each waits)
{{ par.constants() }}
AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def run(args):
    """One process's life: join the group, train (or check), stop what it started.
    Returns the exit status: 0; 1 when another rank was lost; 1 or 2 after a clear
    error line (failure()); or 128 + the signal that stopped training."""
    keep_freed_memory()  # before any tensor, and so before any DataLoader worker
    if args.num_workers:  # the DataLoader workers' fork server (loader_options), now:
        start_fork_server()  # before any signal handler of this file's
    spare_the_garbage_collector()
    faulthandler.enable()  # a crash in C code (an abort) still shows the Python stack
{% if not spawn %}
    # A torchrun worker runs in a session of its own: were torchrun killed (kill -9,
    # out of memory), it would train on alone, holding its GPU. It gets SIGTERM
    # instead, so it saves and stops.
    if "TORCHELASTIC_RUN_ID" in os.environ:
        signal_when_parent_ends(signal.SIGTERM)
{% endif %}
    device, store = setup_distributed(args.backend, args.dist_timeout)
    choose_kernels(device, args.deterministic)
    # From here on, SIGTERM and Ctrl-C stop training at the next check, with a save
    # (before, at once: the rendezvous waits in C++, where no Python handler runs).
    for signum in STOPS:
        signal.signal(signum, on_stop_signal)
    WATCH.start(store, args.dist_timeout)
    try:
        status = 0  # (--preflight and --evaluate: an error raises)
        if args.preflight:
            preflight(device, dist.get_backend())
        elif args.evaluate:
            evaluate_saved(args, device)
        else:
            status = train(args, device)
        dist.barrier()  # everyone finishes together, after rank 0's last save
    except Exception as err:  # noqa: BLE001 (each is reported, in its own way)
        if WATCH.reporting:  # a hang report ends the ranks and their workers: finish it
            WATCH.thread.join()
        if isinstance(err, dist.DistError) or any(s in str(err) for s in LOST):
            report_lost_peer(err)
        else:  # an error raised here, in your code as a rule
            report_error(err)
        return 1
    except SystemExit as stop:  # failure(): rank 0 has said why
        status = stop.code
    finally:
        WATCH.stop()
        stop_children()
    # No destroy_process_group(): the process ends at once (see leave()), and that
    # would wait for a lost rank's collective, or (gloo, torch 2.4) deadlock with a
    # gloo thread that waits for the GIL to free the last collective's tensors.
    return status


def cuda_problem(backend, processes_here):
    """Why `backend` cannot serve this machine's processes, as an error line; or None.
    The launchers ask before they start any (rank 0 says it, before others exit)."""
    if backend == "nccl" and not torch.cuda.is_available():
        return "error: --backend nccl needs a CUDA GPU; none is visible"
    if backend == "nccl" and processes_here > torch.cuda.device_count():
        return (
            f"error: {processes_here} processes on this machine, "
            f"{torch.cuda.device_count()} GPUs visible: NCCL needs one GPU per process"
        )
    return None


def setup_distributed(backend, timeout):
    """DDP change 1: join the process group and pick this process's device (a
    single-GPU script would only pick a device)."""
    cuda = torch.cuda.is_available()
    backend = ("nccl" if cuda else "gloo") if backend == "auto" else backend
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if problem := cuda_problem(backend, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))):
        raise failure(problem)
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)  # before anything else touches CUDA
    timeout = timedelta(seconds=timeout)
{% if not spawn %}
    if "RANK" not in os.environ:  # started without a launcher: a group of one
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
        return device, store
{% endif %}
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        # The rendezvous gives a store the hang watch uses too. A collective fails
        # after twice the timeout and COLLECTIVE_GRACE, so the hang watch (the timeout
        # without progress) speaks first: NCCL's watchdog counts from when a collective
        # was queued, which can be steps before this rank stopped making progress.
{% if spawn %}
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
{% elif multi %}
        if "ELASTIC_ROUND" in os.environ:  # NNODES=MIN:MAX: see elastic_rendezvous()
            store = elastic_store(timeout)
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        else:
            store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        if os.environ.get("GROUP_WORLD_SIZE") == "1":  # one torchrun, one count
            # torchrun's own store outlives a restart: keys of this attempt only.
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"attempt {attempt}", store)
{% else %}
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        # torchrun's own store outlives a restart: keys of this attempt only.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"attempt {attempt}", store)
{% endif %}
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=2 * timeout + timedelta(seconds=COLLECTIVE_GRACE),
            device_id=device if backend == "nccl" else None,  # NCCL: connect now
        )
    except dist.DistError as err:  # every rank says why: each may be on its own machine
        sys.exit(rendezvous_failed(err, address))
    return device, store


{% if not spawn and multi %}
def elastic_store(timeout):
    """This round's keys in the elastic rendezvous's own store: on the machine that
    holds MASTER_ADDR, or in the file RDZV_FILE names."""
    kind, where = os.environ["ELASTIC_STORE"].split(" ", 1)
    if kind == "file":
        store = dist.FileStore(where)
    else:
        host, port = where.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    return dist.PrefixStore(os.environ["ELASTIC_ROUND"], store)


{% endif %}
def choose_kernels(device, deterministic):
    """On GPUs, cuDNN's fastest algorithm for each shape, and TF32 for float32; with
    --deterministic neither, and deterministic algorithms only: runs repeat exactly."""
    fast = device.type == "cuda" and not deterministic
    torch.backends.cudnn.benchmark = fast
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = fast
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's need
        torch.use_deterministic_algorithms(True)


def rendezvous_failed(err, address):
    """The one line for a rendezvous that failed: why, and what to check."""
    reason = (str(err).strip() or type(err).__name__).splitlines()[0]
{% if spawn %}
    if "EADDRINUSE" in reason:
        return f"error: port {address} is in use; choose another --master-port"
{% endif %}
{% if multi %}
    return (
        f"error: rendezvous with {address} failed ({reason}); check MASTER_ADDR, "
        "MASTER_PORT, NNODES, the firewall, and that every node was started"
    )
{% else %}
    return f"error: rendezvous with {address} failed ({reason})"
{% endif %}


def print0(*args, **kwargs):
    """DDP change 4: only rank 0 prints, so messages appear once, not once per rank."""
    if dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


class Training(argparse.Namespace):
    """What the loop works with, built by build_training() (sums, frozen: by
    resume()), as t.NAME:
    - args, device: the command line; this process's device
{{ par.training_fields() }}
    - evaluated: the model, or what keep(..., evaluate=) named instead
    - optimizers, schedulers: {name: optimizer}, {name: its LR scheduler or None};
      build_optimizer()'s one is named ""
    - scaler: --amp fp16's loss scaler (otherwise it does nothing)
    - train_data: what places a pass: a ResumableSampler, or a StreamShard
    - train_loader, val_loader: the DataLoaders (StreamLoaders for streams)
    - updates_per_pass: optimizer updates in a pass (None: a stream's, unknown)
    - global_batch, total_updates: samples per optimizer update, over all ranks;
      optimizer updates in the whole run
    - alone: one process, one micro-batch an update (the global batch is
      --batch-size): an update's gradients are its micro-batch's own (see update())
    - sums: the LossSums of the training since the last evaluation
    - frozen: the fingerprints of the parameters that do not train, as built (see
      left_out)
    - trained: every parameter of the Step, whose gradients update() clears
{% if strategy == "best" %}
    - best_val_loss: the lowest validation loss so far
{% endif %}
    """


KEPT = {}  # what keep() declared: name -> (thing, the module it evaluates or None)


def keep(name, thing, evaluate=None):
    """Call it in build_optimizer(): thing.state_dict() goes into every checkpoint
    under `name`, and a resume loads it back (an EMA of the weights, a counter: any
    object with state_dict() and load_state_dict()). evaluate: the module that
    evaluation, --evaluate and DIR/model_final_NAME.pt use instead of the trained
    model (an EMA's averaged copy, AveragedModel.module)."""
    KEPT[name] = thing, evaluate


def named(built):
    """build_optimizer()'s answer as ({name: optimizer}, {name: scheduler or None});
    a single (optimizer, scheduler) is named ""."""
    built = built if isinstance(built, Mapping) else {"": built}
    return {k: o for k, (o, _) in built.items()}, {k: s for k, (_, s) in built.items()}


@dataclass
class Position:
    """Where training stands, as a checkpoint keeps it (under the same names)."""

    epoch: int = 0  # passes over the training data done
    epoch_samples: int = 0  # samples of the pass under way trained, over all ranks
    step: int = 0  # optimizer updates done
    stream: dict = None  # the training stream's state_dict() there, where it has one


def train(args, device):
    """Build, resume, train pass by pass, save. Returns the exit status: 0, or
    128 + the signal (SIGTERM, Ctrl-C) that stopped it after saving a checkpoint."""
    out_dir = Path(args.output_dir)
{{ saving.last_path() }}
    checkpoint = load_checkpoint(args.resume, last_path, device)
    t = build_training(args, device, checkpoint)
    at = resume(t, checkpoint, out_dir)
    with Reports(t, at, out_dir) as reports:
        while not finished(args, at):
            if train_pass(t, at, reports):  # a stop signal: saved, so stop
                reports.end_line()
                reports.code = stopped(last_path, at, args.batch_size)
                return reports.code
        # (The final save inside: a failed one ends the tracker runs as failed.)
{{ saving.final_weights() | indent(4, first=True) }}
        kept = {k: e.state_dict() for k, (_, e) in KEPT.items() if e is t.evaluated}
        by_rank_0(device, save_final, weights, kept, out_dir, reports.trackers)
    return 0


def save_final(weights, evaluated, out_dir, trackers):
    """Rank 0, at the run's end: model_final.pt (and the evaluated weights, when
    keep() named others), the trackers' end, and one line: where the results are (the
    README's "Experiment trackers" says how to look at each tracker's), and the
    trackers dropped."""
    save_atomic(weights, out_dir / "model_final.pt")
    parts = [f"weights {out_dir}/model_final.pt"]
    for name, state in evaluated.items():
        save_atomic(state, out_dir / f"model_final_{name}.pt")
        parts.append(f"evaluated {out_dir}/model_final_{name}.pt")
    parts.append(f"metrics {out_dir}/metrics.csv")
{% if strategy == "final_only" %}
    # final_only: the checkpoint a stop or --save-every wrote goes
{{ saving.remove_last_checkpoint() }}
{% endif %}
    if trackers:  # ended before the line that says which were dropped
        trackers.end(0)
        parts += [f"dropped: {name} ({why})" for name, why in trackers.dropped.items()]
    print("done: " + ", ".join(parts), flush=True)


def finished(args, at):
    return at.step >= args.max_steps if args.max_steps else at.epoch >= args.epochs


def train_pass(t, at, reports):
    """Train on this rank's share of a pass, from `at` to the pass's end (or to
    --max-steps): forward, backward, an optimizer update every --grad-accum
    micro-batches, and after each update what falls due (a check, an evaluation, a
    save). Returns True when a stop signal asks to stop, after saving."""
    args, device = t.args, t.device
    t.{{ par.wrapper }}.train()
    t.sums.epoch = at.epoch
    t.sums.next_step = at.epoch_samples // (args.batch_size * dist.get_world_size())
    # An update steps every optimizer; with ALTERNATE, each in its own turn.
    turns = [(name,) for name in t.optimizers] if ALTERNATE else [()]
    micro, held = 0, []  # micro-batches of this pass in this run; of this update
    apart = getattr(t.train_data, "shards", None)  # read by shard: ranks end apart
    for batch, real, position, more, state in reports.batches(pass_data(t, at), at):
        held.append((to_device(batch, device), real))
        micro += 1
        sync = micro % args.grad_accum == 0 or not (more or apart)  # or at the end
        if ALTERNATE and not sync:
            continue  # every turn trains on all the update's micro-batches: held
        for k, turn in enumerate(turns):
            for i, (batch, real) in enumerate(held, 1):
                end = sync and i == len(held)  # the update's last micro-batch
                reseed(t, at.step, k, i)
                loss, n = backward(t, batch, real, turn, end, end and apart and more)
                if turn == turns[0]:  # train_loss is the first turn's
                    t.sums.recent.append((loss.detach(), n))  # see LossSums
            if sync:
                update(t, turn)
        held = []
        if sync:
            # Where this rank's stream shards ran out: has any rank's not? The news
            # came with the gradients (see Step): a wait here, at a pass's end only.
            last = not (more or apart and t.units[0, 1].item())
            at.step, at.epoch_samples, at.stream = at.step + 1, position, state
            if last:  # the pass is done
                at.epoch, at.epoch_samples, at.stream = at.epoch + 1, 0, None
            stop = after_update(t, at, reports, last)
            if stop or last or at.step == args.max_steps:  # or the pass's or run's end
                return stop
    # Every pass with items returns above, at its last update: only an empty stream
    # gets here.
    raise failure("error: build_datasets() returned an empty training stream")


def reseed(t, *where):
    """Seed the training process's random draws (dropout, a mixup weight, a coin drawn
    in your functions) before each micro-batch, from --seed and `where` it stands (the
    updates done, the turn, the micro-batch): a resume, even in the middle of a pass,
    draws what a run never stopped. Python's random and numpy's are the same on every
    rank (a draw for the whole batch holds for all of it, whatever the processes);
    torch's differ by rank (dropout masks)."""
    key = mixed(t.args.seed, *where)
    seed_draws(key)
    own = mixed(key, dist.get_rank())  # (torch.manual_seed: 0.5 ms, this: 2 µs)
    torch.default_generator.manual_seed(own)
    if t.device.type == "cuda":
        torch.cuda.default_generators[t.device.index].manual_seed(own)


def seed_draws(key):
    """Seed torch's generator on the CPU, Python's random and numpy's global
    generator (where numpy is imported) with `key`."""
    torch.default_generator.manual_seed(key)
    random.seed(key)
    if numpy := sys.modules.get("numpy"):  # (None: where it failed to import)
        numpy.random.seed(key % (1 << 32))  # (32 bits: 2 µs; a pair of them: 13)


def mixed(*numbers):
    """One 64-bit seed from whole numbers: near ones give unrelated seeds."""
    return int(hashlib.blake2b(repr(numbers).encode(), digest_size=8).hexdigest(), 16)


def backward(t, batch, real, turn, sync, more):
    """One micro-batch's forward and backward pass (sync: the update's last, whose
    gradients are averaged over the ranks; more: it is, and this rank has items of a
    stream read by shard after it). Returns its loss and n."""
    args, device, amp = t.args, t.device, AMP_DTYPES[t.args.amp]  # amp: None or a dtype
{{ par.train_step() }}
    return loss, n


def pass_data(t, at):
    """This rank's batches of the pass from `at` on, each as (batch, real: False for
    a stand-in, the pass's samples done after it over all ranks, whether this rank has
    more, a stream's states there or None)."""
    # DDP change 2: a new shuffle each pass, the same on every rank. Without this
    # call every pass repeats the first one's order.
{% if cookiecutter.use_batch_sampler %}
    # (The BatchSampler draws from this same sampler, so it follows.)
{% endif %}
    t.train_data.set_epoch(at.epoch, at.epoch_samples, at.stream)
    if isinstance(t.train_data, StreamShard):
        yield from t.train_loader  # it says all of that itself (see StreamLoader)
        return
    start, per_step = at.epoch_samples, t.args.batch_size * dist.get_world_size()
    total = t.train_data.total_size  # the shares padded to equal
    steps = len(t.train_loader)
    for j, batch in enumerate(t.train_loader, 1):
        yield batch, True, min(start + j * per_step, total), j < steps, None


def after_update(t, at, reports, last):
    """What falls due after an update: every LOG_EVERY updates a check; an
    evaluation at --eval-every, a pass's end and the run's end; a checkpoint at
{% if strategy == "final_only" %}
    --save-every and a stop signal. Returns True when a stop signal asks to stop
    (after saving)."""
{% elif strategy == "best" %}
    --save-every, a pass's end, the run's end, a stop signal and a better
    evaluation. Returns True when a stop signal asks to stop (after saving)."""
{% else %}
    --save-every, a pass's end, the run's end and a stop signal. Returns True when a
    stop signal asks to stop (after saving)."""
{% endif %}
    end = last or at.step == t.args.max_steps
    evaluating = end or (t.args.eval_every and at.step % t.args.eval_every == 0)
    saving = t.args.save_every and at.step % t.args.save_every == 0
    if not (evaluating or saving or at.step % LOG_EVERY == 0):
        return False
    stop = check(t) and not finished(t.args, at)
    reports.step_done()  # the step ends here: evaluations and saves are not training
    reports.progress(at)
{% if strategy == "best" %}
    names = []  # the checkpoints to write
{% endif %}
    if evaluating:
{{ par.evaluation_comment() }}
        for buffer in t.evaluated.buffers():
            dist.broadcast(buffer, src=0)
        metrics = run_validation(t.evaluated, t.val_loader, t.device)
        reports.row(at, metrics)
{% if strategy == "best" %}
        if metrics["loss"] < t.best_val_loss:
            t.best_val_loss = metrics["loss"]
            names.append("checkpoint_best{{ saving.ext }}")
            print0("best val_loss so far: saving checkpoint_best{{ saving.ext }}")
    if stop or saving or end:
        names.append("checkpoint_last{{ saving.ext }}")
    if names:
        reports.save(at, names)
{% elif strategy == "every_epoch" %}
    if stop or saving or end:
        names = ["checkpoint_last{{ saving.ext }}"]
        if last:
            names.append(f"checkpoint_epoch{at.epoch:03d}{{ saving.ext }}")
        reports.save(at, names)
{% elif strategy == "final_only" %}
    if stop or saving:  # final_only keeps none at a pass's end
        reports.save(at, ["checkpoint_last{{ saving.ext }}"])
{% else %}
    if stop or saving or end:
        reports.save(at, ["checkpoint_last{{ saving.ext }}"])
{% endif %}
    return stop


{{ saving.save_checkpoints() }}


