# --------------------------------------------------------------------------------------
# Checkpoints and resuming (rank 0 writes; every rank reads through rank 0)
# --------------------------------------------------------------------------------------
def snapshot(t, at):
    """Everything a resume needs: the state at `at`, right after a check (which
    summed the loss over the ranks). Every rank calls it: a stream's states are
    gathered."""
    frozen = left_out(t)  # a frozen base, not written again at every save
    return {
{{ saving.snapshot_tensors() }}
        "scheduler": packed({k: s and s.state_dict() for k, s in t.schedulers.items()}),
        "kept": {name: thing.state_dict() for name, (thing, _) in KEPT.items()},
        "scaler": t.scaler.state_dict(),
        # Where training stands (see Position), with the stream's states of every
        # rank's readers in place of this rank's (at.stream).
        **asdict(at),
        "stream": stream_states(t, at),
        "stream_shards": getattr(t.train_data, "shards", None),  # see StreamShard
        "train_sums": list(t.sums.reduced),  # loss sum and units, over all ranks
        "global_batch": [dist.get_world_size(), t.args.batch_size, t.args.grad_accum],
        "total_updates": t.total_updates,
        "frozen": frozen,  # the parameters left out, with their fingerprints
{% if strategy == "best" %}
        "best_val_loss": t.best_val_loss,
{% endif %}
        "args": {key: plain(value) for key, value in vars(t.args).items()},
    }


def stream_states(t, at):
    """A stream's states at `at`, each rank's readers' sub-streams', on every rank;
    None for a sampler, or at a pass's end."""
    if at.stream is None:
        return None
    each = gathered(pickle.dumps(at.stream), t.device)
    return {c: state for data in each for c, state in pickle.loads(data).items()}


def packed(states):
    """{name: state} of the optimizers (or schedulers) as a checkpoint holds them:
    build_optimizer()'s one (named "") alone, as torch.optim saves it."""
    return states.get("", states)


def unpacked(t, saved):
    return {"": saved} if "" in t.optimizers else saved


def plain(value):
    """A value weights_only=True loads (a bool is an int): a Path (say, from a flag
    you add) as text."""
    return value if isinstance(value, (int, float, str, type(None))) else str(value)


def save_atomic(obj, path):
    """torch.save(obj) to `path`, whole or not at all (see replacing), on the CPU: it
    loads on a machine without a GPU, and never onto cuda:0 of another job."""
    with replacing(path, "wb") as f:
        torch.save(to_device(obj, torch.device("cpu")), f)


@contextlib.contextmanager
def replacing(path, mode):
    """A temporary file to write, renamed to `path` once complete: a crash or a
    failed write (a full disk) leaves `path` as it was; a failed write ends the run
    with one line."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open(mode, newline=None if "b" in mode else "") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:  # torch.save's failed writes: RuntimeError
        tmp.unlink(missing_ok=True)
        raise cannot_write(path, err) from None


def cannot_write(path, err):
    """The error for a write of `path` that failed with `err` (or with the OSError
    beneath torch.save's RuntimeError): the run stops, and path stays as it was."""
    err = err.__context__ if isinstance(err.__context__, OSError) else err
    reason = getattr(err, "strerror", None) or str(err).strip().splitlines()[0]
    free = shutil.disk_usage(path.parent).free / 2**30
    why = f"{reason}; {free:.1f} GB free"
    return failure(f"error: cannot write {path} ({why}): left as it was")


def by_rank_0(device, task, *args):
    """DDP change 4: rank 0 alone calls task(*args), which writes files (or reads
    one), and returns what it returned (None on the other ranks). The others wait for
    it (as they would at the next collective), so that a task that fails there ends
    every rank together, with one line from rank 0."""
    failed, result = torch.zeros((), device=device), None
    if dist.get_rank() == 0:
        try:
            result = task(*args)
        except (SystemExit, OSError) as err:  # SystemExit: it failed, and said so
            if isinstance(err, OSError):  # a folder not made, copied or moved
                failure(f"error: cannot write {err.filename}: {err.strerror or err}")
            failed.fill_(1)
    dist.broadcast(failed, src=0)
    if failed.item():
        raise SystemExit(1)
    return result


{{ saving.load_checkpoint() }}


def load_shared(path, device, verb, keys=()):
    """The dict saved in `path` (None for no path), on every rank. Rank 0 reads the
    file and sends its bytes to the others, so machines need not share a disk; each
    rank loads them with weights_only=True. A file that cannot be read or loaded, or
    whose dict lacks one of `keys`: one line, "error: cannot <verb> <path>: <why>"."""
    data = broadcast_bytes(by_rank_0(device, read_bytes, path, verb), device)
    if data is None:
        return None
    try:
        # weights_only=True: a checkpoint is data; never run code from a pickle.
        loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        if not isinstance(loaded, dict):
            raise TypeError(f"it holds a {type(loaded).__name__}, not a dict")
        if missing := [key for key in keys if key not in loaded]:
            raise TypeError(f"it lacks {', '.join(missing)}: another version's?")
    except Exception as err:  # torch.load raises many kinds on a corrupt file
        lines = [line for line in str(err).splitlines() if line.strip()] or [repr(err)]
        # weights_only says why in one of its lines: "unsupported GLOBAL posix.system"
        # (a pickle that would run code: refused), or "Unsupported operand" (no pickle).
        telling = (s for s in lines if "GLOBAL" in s or s.startswith("Unsupported"))
        said = next(telling, lines[0]).rstrip(".")
        # GLOBAL: a pickle's code, refused (not a broken file)
        why = "refused by weights_only=True" if "GLOBAL" in said else "not a checkpoint"
        raise failure(f"error: cannot {verb} {path}: {why} ({said})") from err
    return loaded


def read_bytes(path, verb):
    """The bytes in `path` (None for no path), or one line saying why not."""
    try:
        return None if path is None else path.read_bytes()
    except OSError as err:
        raise failure(f"error: cannot {verb} {path}: {err.strerror or err}") from None


def load_weights(model, weights, path, advice=""):
    """Load a state_dict into the model build_model() made, or say in one line why
    it does not fit (build_model() changed since it was saved, another project's)."""
    try:
{{ saving.load_state() }}
    except (RuntimeError, TypeError) as err:
        reason = str(err).strip().splitlines()[-1].strip()
        why = f"does not fit the model build_model() makes ({reason}){advice}"
        raise failure(f"error: {path} {why}") from err


def fingerprints(model, names=None):
    """{name: [sum, sum of squares]} in float64 of the model's parameters `names`
    (by default those that do not train: a frozen base, peft's, a teacher's): what
    tells whether one is still as build_model() made it."""
    if names is None:
        named = model.named_parameters(remove_duplicate=False)  # tied: each name
        names = [name for name, p in named if not p.requires_grad]
    params = model.state_dict(keep_vars=True)  # (FSDP2's: sharded, as it saves them)
    names = [name for name in names if name in params]
    if not names:
        return {}
    f64 = torch.float64
{% if fsdp %}
    weights = [local(params[name]) for name in names]
{% else %}
    weights = [params[name] for name in names]
{% endif %}
    sums = [torch.stack([w.sum(dtype=f64), w.square().sum(dtype=f64)]) for w in weights]
    sums = torch.stack(sums)
{% if fsdp %}
    dist.all_reduce(sums)  # over every rank's shards
{% endif %}
    return dict(zip(names, sums.tolist(), strict=True))


def left_out(t):
    """The frozen parameters a checkpoint leaves out, with their fingerprints: those
    still as build_model() made them at the start of this run (t.frozen), which a
    resume builds again. One trained, or loaded from a checkpoint, is saved."""
    now = fingerprints(t.model)
    return {name: sums for name, sums in now.items() if t.frozen.get(name) == sums}


def frozen_as_built(model, checkpoint, path, advice=""):
    """{name: the model's own} of the frozen parameters `checkpoint` left out (see
    left_out), once checked: the model build_model() made holds them as they were,
    or one line."""
    saved = checkpoint.get("frozen", {})  # (none before template 1.5.0)
    now = fingerprints(model, list(saved))
    close = functools.partial(math.isclose, rel_tol=1e-6, abs_tol=1e-6)
    for name, sums in saved.items():
        if not all(map(close, now.get(name, [math.nan] * 2), sums)):  # (nan: gone)
            why = "which build_model() now makes otherwise"
            raise failure(f"error: {path} leaves out {name} (frozen), {why}{advice}")
    return {k: v for k, v in model.state_dict().items() if k in saved}


def broadcast_bytes(data, device, src=0):
    """Rank src's bytes, on every rank, as a bytearray (None where it has None): a
    size, then the bytes as a uint8 tensor. (all_gather_object and friends would need
    NumPy.)"""
    size = torch.tensor(-1 if data is None else len(data), device=device)
    dist.broadcast(size, src=src)
    if size.item() < 0:
        return None
    buffer = bytearray(data) if dist.get_rank() == src else bytearray(size.item())
    if buffer:
        received = torch.frombuffer(buffer, dtype=torch.uint8).to(device)
        dist.broadcast(received, src=src)
        torch.frombuffer(buffer, dtype=torch.uint8).copy_(received)
    return buffer


def gathered(data, device):
    """Every rank's bytes, in rank order, on every rank: broadcast in turn."""
    return [broadcast_bytes(data, device, src) for src in range(dist.get_world_size())]


def settle_global_batch(args, checkpoint, world_size):
    """Set args.grad_accum. A resumed run keeps the checkpoint's global batch (processes
    x batch x grad-accum), whatever its number of processes: then every update trains
    on the same samples as before, in the same order. It derives the grad-accum that
    does so, or refuses in one line unless --allow-batch-change."""
    if checkpoint is None:
        args.grad_accum = args.grad_accum or 1
        return
    old = checkpoint["global_batch"]  # [processes, batch, grad-accum]
    target, per_update = math.prod(old), world_size * args.batch_size
    if args.grad_accum is None:
        args.grad_accum = max(1, target // per_update)
{% if multi and not spawn %}
        # Elastic (NNODES=MIN:MAX), after machines left or joined: the batch too, at
        # most --batch-size, in the fewest micro-batches.
        elastic = "ELASTIC_ROUND" in os.environ and world_size != old[0]
        for accum in range(1, target + 1) if elastic else ():
            batch, rest = divmod(target, world_size * accum)
            if not rest and batch <= args.batch_size:
                args.batch_size, args.grad_accum = batch, accum
                break
{% endif %}
    new = [world_size, args.batch_size, args.grad_accum]
    if math.prod(new) != target and not args.allow_batch_change:
        hint = f"e.g. --batch-size {target // world_size} --grad-accum 1"
        if target % world_size:  # no --batch-size keeps it with these processes
            hint = f"use a number of processes that divides {target}"
        raise failure(
            f"error: the checkpoint's global batch is {target} ({describe(*old)}); "
            f"{describe(*new)} make {math.prod(new)}: {hint}, or pass "
            f"--allow-batch-change to go on with {math.prod(new)}",
            status=2,
        )
    if new != old:
        kept = "kept" if math.prod(new) == target else f"changed from {target}"
        print0(
            f"resume: global batch {math.prod(new)} {kept}: {describe(*new)} "
            f"(the checkpoint had {describe(*old)})"
        )


def describe(processes, batch, accum):
    noun = "process" if processes == 1 else "processes"
    return f"{processes} {noun} x batch {batch} x grad-accum {accum}"


def resume(t, checkpoint, out_dir):
    """Restore the state a checkpoint holds, trim metrics.csv to its updates, and
    return the Position training goes on from."""
    at, carried = Position(), (0.0, 0.0)
    t.frozen = fingerprints(t.model)  # as build_model() made them (see left_out)
    if checkpoint is not None:
        advice = "; start afresh with --resume never or another --output-dir"
        if not same_optimizer(t, checkpoint):  # build_optimizer() changed since
            other = "another optimizer or LR schedule than build_optimizer() makes"
            raise failure(f"error: {checkpoint['path']} holds {other}{advice}")
        # This run's optimizer settings, before the checkpoint's replace them.
        fresh = {n: [dict(g) for g in o.param_groups] for n, o in t.optimizers.items()}
{{ saving.resume_tensors() }}
        for name, (thing, _) in KEPT.items():
            if name not in checkpoint.get("kept", {}):  # saved before keep() was
                raise failure(f"error: {checkpoint['path']} keeps no {name!r}{advice}")
            thing.load_state_dict(checkpoint["kept"][name])
        if checkpoint["scaler"]:  # empty when it was saved without --amp fp16
            t.scaler.load_state_dict(checkpoint["scaler"])
        at = Position(*(checkpoint[field.name] for field in fields(Position)))
        carried = tuple(checkpoint["train_sums"])  # over all ranks: rank 0 adds them
{% if strategy == "best" %}
        t.best_val_loss = checkpoint.get("best_val_loss", math.inf)
{% endif %}
        resume_position(t, at, math.prod(checkpoint["global_batch"]))
        restore_schedule(t, checkpoint, at.step, fresh)
        print0(f"resumed from {checkpoint['path']} {where(at, t.args.batch_size)}")
        if finished(t.args, at):
            length = "--max-steps" if t.args.max_steps else "--epochs"
            print0(
                f"resume: the run is done ({at.step} updates, {at.epoch} passes); a "
                f"larger {length} goes on, --resume never starts afresh"
            )
    t.sums = LossSums(t.device, carried if dist.get_rank() == 0 else (0, 0))
    # metrics.csv's rows count updates as the checkpoint did
    by_rank_0(t.device, start_metrics, out_dir, checkpoint["step"] if checkpoint else 0)
    return at


def resume_position(t, at, saved_batch):
    """The checkpoint's position as this run reads it. A sampler starts at a whole
    step, and a stream without a saved state is read up to it. After a change of the
    global batch (--allow-batch-change), the samples of a step begun are trained
    again, and the updates done are counted in updates of the new global batch."""
    if isinstance(t.train_data, StreamShard):
        if at.epoch_samples and None in at.stream.values():
            again = f"every reader reads its first {at.epoch_samples} items again"
            if shards := t.train_data.shards:
                again = f"each of its {shards} shards is read again, by one reader,"
            line = "resume: the training stream has no state_dict(), so"
            print0(f"{line} {again} to get there")
    elif again := at.epoch_samples % (t.args.batch_size * dist.get_world_size()):
        print0(f"resume: {again} samples of this pass are trained again")
        at.epoch_samples -= again
    if t.global_batch != saved_batch and t.updates_per_pass:
        at.step = at.epoch * t.updates_per_pass + at.epoch_samples // t.global_batch
    elif t.global_batch != saved_batch:  # a stream of unknown length: by samples
        at.step = at.step * saved_batch // t.global_batch


def restore_schedule(t, checkpoint, done, fresh):
    """The LR schedule. A run whose length (--epochs, --max-steps), --lr or global
    batch changed gets the schedule a run with its arguments would have followed from
    the start, at the update it has reached (`done`), and one line saying so; its
    optimizer keeps the checkpoint's statistics and takes this run's settings
    (`fresh`)."""
    args, saved = t.args, checkpoint["args"]
    # A schedule counts updates: its length and the samples per update (the global
    # batch) place a run on it. Without a scheduler, only the LR matters.
    was = checkpoint["total_updates"], math.prod(checkpoint["global_batch"])
    same_length = was == (t.total_updates, t.global_batch)
    schedulers = {name: s for name, s in t.schedulers.items() if s}
    if saved["lr"] == args.lr and (same_length or not schedulers):
        for name, scheduler in schedulers.items():
            scheduler.load_state_dict(unpacked(t, checkpoint["scheduler"])[name])
        return
    # Keep the optimizers' statistics (momentum, Adam moments); take the new settings.
    for name, optimizer in t.optimizers.items():
        for group, settings in zip(optimizer.param_groups, fresh[name], strict=True):
            group.update(settings)
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()"
        warnings.simplefilter("ignore")
        for scheduler in schedulers.values():
            for _ in range(min(done, t.total_updates)):
                scheduler.step()
    lr = next(iter(t.optimizers.values())).param_groups[0]["lr"]
    print0(
        f"resume: the LR schedule is rebuilt for --lr {args.lr}, {t.total_updates} "
        f"updates of {t.global_batch} samples (the checkpoint's: --lr {saved['lr']}, "
        f"{was[0]} updates of {was[1]}); continuing at update {done}, LR {lr:.6g}"
    )


def same_optimizer(t, checkpoint):
    """Whether the checkpoint's optimizers and schedulers are of the kinds
    build_optimizer() makes: the same names, settings, parameter groups and state
    names."""

    def shape(state):  # an optimizer's or a scheduler's state_dict, or None
        if isinstance(state, dict) and "param_groups" in state:
            return [(sorted(g), len(g["params"])) for g in state["param_groups"]]
        return sorted(state) if isinstance(state, dict) else state

    def shapes(states):  # by name
        return isinstance(states, dict) and {k: shape(s) for k, s in states.items()}

    made = (t.optimizers, t.schedulers)
    ours = [{k: x and x.state_dict() for k, x in d.items()} for d in made]
    saved = [unpacked(t, checkpoint[key]) for key in ("optimizer", "scheduler")]
    return list(map(shapes, ours)) == list(map(shapes, saved))


