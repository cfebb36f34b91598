def datasets(args):
    """build_datasets(), refusing in one line an empty set (a stream without a
    length: when it yields nothing), or one DataLoader workers cannot receive."""
    train_set, val_set = build_datasets(args)
    for name, data in (("training", train_set), ("validation", val_set)):
        if isinstance(data, Sized) and len(data) == 0:
            raise failure(f"error: build_datasets() returned an empty {name} set")
        try:  # each DataLoader worker gets a pickled copy (see loader_options)
            pickle.dumps(data if args.num_workers else None)
        except Exception as err:
            raise failure(
                f"error: build_datasets() returned a {name} set that DataLoader "
                f"workers cannot receive ({err}): define its classes and functions "
                "at a module's top level, keep no open file in it, or --num-workers 0"
            ) from err
    return train_set, val_set


def build_training(args, device, checkpoint):
{{ par.build_training_doc() }}
    settle_global_batch(args, checkpoint, dist.get_world_size())
    torch.manual_seed(args.seed)  # reproducible initial weights and data
{% if strategy == "best" %}
    t = Training(args=args, device=device, best_val_loss=math.inf)
{% else %}
    t = Training(args=args, device=device)
{% endif %}
    train_set, val_set = datasets(args)
    loaders = build_loaders(train_set, val_set, args, device)
    t.train_data, t.train_loader, t.val_loader = loaders
    t.steps_per_pass = pass_steps(train_set, t.train_loader, args)
    size = len(train_set) if isinstance(train_set, Sized) else math.inf
    if (batch := dist.get_world_size() * args.batch_size * args.grad_accum) > size:
        line = f"warning: the global batch ({batch}) is larger than the training set"
        print0(f"{line} ({size} samples): one update a pass", file=sys.stderr)
    if not (args.max_steps or t.steps_per_pass):
        raise failure(
            "error: build_datasets() returned a training stream without a length: "
            "give the run's length in optimizer updates, --max-steps N",
            status=2,
        )
    epochs = args.epochs * math.ceil((t.steps_per_pass or 0) / args.grad_accum)
    t.total_updates = args.max_steps or epochs  # updates in the whole run
    # float16 needs loss scaling against underflowing gradients; otherwise a no-op.
    t.scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
{{ par.wrap_model() }}


def pass_steps(train_set, train_loader, args):
    """Micro-batches per pass and rank; None for a stream without a length."""
    if not isinstance(train_set, IterableDataset):
        return len(train_loader)
    if not isinstance(train_set, Sized):
        return None
    return math.ceil(len(train_set) / (args.batch_size * dist.get_world_size()))


def loader_options(data, args, device):
    """The DataLoader settings every loader here shares. Its workers start from the
    fork server, a fresh interpreter that imported this file once (see run()), never
    as forks of this process: its communication threads can deadlock a fork
    (CPython gh-112275, before 3.12 and 3.11.10)."""
    return {
        "collate_fn": getattr(data, "collate_fn", None),
        "num_workers": args.num_workers,
        "multiprocessing_context": "forkserver" if args.num_workers else None,
        "pin_memory": device.type == "cuda",
        "worker_init_fn": functools.partial(loader_worker_init, os.getpid(), Held()),
    }


class Held:
    """Unpickled in a new DataLoader worker (before torch's SIGTERM handler is set
    there), it holds SIGTERM and Ctrl-C back for good: never delivered there."""

    def __reduce__(self):
        return signal.pthread_sigmask, (signal.SIG_BLOCK, STOPS)


def build_loaders(train_set, val_set, args, device):
    """DDP change 2: each rank reads a different 1/world_size of the training set
    (a single-GPU script would pass shuffle=True to the DataLoader instead)."""
    if isinstance(train_set, IterableDataset):
        train_data = StreamShard(
            train_set, args.batch_size, lockstep=True, keep_state=True
        )
        options = loader_options(train_data, args, device)
        train_loader = DataLoader(train_data, batch_size=None, **options)
        return train_data, train_loader, build_val_loader(val_set, args, device)
    common = loader_options(train_set, args, device)
    shard = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_data = ResumableSampler(shard)
{% if cookiecutter.use_batch_sampler %}
    batch_sampler = BatchSampler(train_data, args.batch_size, drop_last=False)
    train_loader = DataLoader(train_set, batch_sampler=batch_sampler, **common)
{% else %}
    train_loader = DataLoader(
        train_set, batch_size=args.batch_size, sampler=train_data, **common
    )
{% endif %}
    return train_data, train_loader, build_val_loader(val_set, args, device)


def build_val_loader(val_set, args, device):
    """Validation shards take every world_size-th sample with no padding, so the
    summed metrics count each sample exactly once (DistributedSampler would repeat
    some); a stream is cut the same way."""
    if isinstance(val_set, IterableDataset):
        shard = StreamShard(val_set, args.batch_size, lockstep={{ fsdp }})
        return DataLoader(shard, batch_size=None, **loader_options(shard, args, device))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shard = Subset(val_set, range(rank, len(val_set), world_size))
    options = loader_options(val_set, args, device)
    return DataLoader(shard, batch_size=args.batch_size, **options)


class ResumableSampler(Sampler):
    """The shard of a DistributedSampler, from a given position: a run stopped
    mid-pass resumes with the next batch, without reading the ones already done."""

    def __init__(self, sampler):
        self.sampler, self.start = sampler, 0

    def set_epoch(self, epoch, samples=0, state=None):
        """Pass `epoch`, after `samples` of it (over all ranks); a sampler needs no
        `state` to get there."""
        self.sampler.set_epoch(epoch)
        self.start = samples // self.sampler.num_replicas

    def __iter__(self):
        return itertools.islice(self.sampler, self.start, None)

    def __len__(self):
        return len(self.sampler) - self.start


class StreamShard(IterableDataset):
    """DDP change 2 for a stream (an IterableDataset, from build_datasets): this
    rank's share of it, cut as DistributedSampler and BatchSampler cut a map-style
    set (the stream shuffles itself, or not). Each pass is read in blocks of
    world_size x batch_size items, one step of every rank; a rank takes every
    world_size-th item of a block from its rank on, and its DataLoader worker w the
    blocks w, w + workers, ... So within a pass every item is used once, a global
    batch is the same items for any number of processes and workers, and every rank
    takes the same steps: where the last block leaves a rank nothing, it takes a
    stand-in step on other items that weighs nothing (lockstep, where every rank must
    take every step).

    Every reader (rank and worker) reads the whole stream and skips the items of the
    others: keep them cheap to read, and decode in the dataset's collate_fn, which
    runs on a reader's own items only. A resume starts a pass in the middle: a stream
    with state_dict() and load_state_dict() goes there at once, another is read up to
    there again."""

    def __init__(self, stream, batch_size, lockstep, keep_state=False):
        self.stream, self.batch_size, self.lockstep = stream, batch_size, lockstep
        self.keep_state = keep_state  # training: rank 0's batches carry the state
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.collate = getattr(stream, "collate_fn", None) or default_collate
        self.epoch, self.start, self.state = 0, 0, None

    def set_epoch(self, epoch, samples=0, state=None):
        """Pass `epoch`, after `samples` of its items, where the stream's
        state_dict() was `state` (if it has one)."""
        self.epoch, self.start, self.state = epoch, samples, state

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        # This reader reads the whole stream: hide the workers from a stream that
        # would split itself among them (as Hugging Face's does).
        torch.utils.data._utils.worker._worker_info = None
        stream, width = self.stream, self.world_size * self.batch_size
        if hasattr(stream, "set_epoch"):
            stream.set_epoch(self.epoch)
        if self.state is not None and hasattr(stream, "load_state_dict"):
            stream.load_state_dict(self.state)
            items = iter(stream)
        else:
            items = itertools.islice(stream, self.start, None)  # read up to there
        # Rank 0's batches carry the state a checkpoint after them keeps.
        keep = self.keep_state and self.rank == 0 and hasattr(stream, "state_dict")
        position, pending = self.start, None
        for step in itertools.count():
            state = copy.deepcopy(stream.state_dict()) if keep and pending else None
            block = list(itertools.islice(items, width))
            if pending:  # the previous block's: now known to end the pass or not
                yield (*pending, not block, state) if self.lockstep else pending[0]
            if not block:
                return
            position += len(block)
            share = block[self.rank :: self.world_size]
            pending = None
            if step % workers == worker and (share or self.lockstep):
                # No share in the last block: a stand-in, other items of the block.
                batch = self.collate(share or block[: self.batch_size])
                pending = (batch, bool(share), position)


def loader_worker_init(trainer, held, worker_id):
    """DataLoader workers never see SIGTERM or Ctrl-C (`held`): the training process
    stops at its next check, saves, and shuts them down itself. They end when it
    ends, however it ends (kill -9 too): their fork server lives on."""
    faulthandler.register(signal.SIGUSR1, all_threads=False)  # for the hang watch
    if hasattr(os, "pidfd_open"):  # Linux
        threading.Thread(target=exit_with, args=(trainer,), daemon=True).start()


def exit_with(pid):
    """End this process as soon as process `pid` ends (at once if it has)."""
    with contextlib.suppress(ProcessLookupError):
        select.select([os.pidfd_open(pid)], [], [])
    os._exit(1)


def signal_when_parent_ends(signum):
    """Linux: the kernel sends this process `signum` when the process that started
    it ends, however it ends (kill -9 too)."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signum)  # PR_SET_PDEATHSIG


def to_device(batch, device):
    """Move every tensor of a batch (a tensor, or tuples, lists and dicts of them); to
    a GPU without waiting, to the CPU whole (a copy not yet done would be read)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=device.type != "cpu")
    if isinstance(batch, Mapping):  # dict, or e.g. transformers' BatchEncoding
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [to_device(value, device) for value in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


