def checked_datasets(args):
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
    train_set, val_set = checked_datasets(args)
    t.train_data, t.train_loader = build_loader(train_set, args, device, checkpoint)
    t.val_loader = build_val_loader(val_set, args, device)
    per_step = dist.get_world_size() * args.batch_size  # samples, over all ranks
    t.global_batch = batch = per_step * args.grad_accum
    t.alone = batch == args.batch_size  # one process, one micro-batch an update
    # Micro-batches per pass and rank, as the DataLoader makes them (the sampler pads
    # the shares to equal; DROP_LAST leaves out a short last one) or the StreamLoader.
    size = len(train_set) if isinstance(train_set, Sized) else None
    sampled = isinstance(t.train_data, ResumableSampler)
    steps = len(t.train_loader) if sampled else size and math.ceil(size / per_step)
    if steps == 0:  # DROP_LAST, and a share of the set smaller than --batch-size
        share = f"{t.train_data.num_samples} samples a process"
        line = f"error: DROP_LAST leaves no batch ({share}): lower --batch-size"
        raise failure(line, status=2)
    if size and batch > size:
        line = f"warning: the global batch ({batch}) is larger than the training set"
        print0(f"{line} ({size} samples): one update a pass", file=sys.stderr)
    if not (args.max_steps or size):
        line = "error: a training stream without a length needs --max-steps N"
        raise failure(line, status=2)
    # Optimizer updates per pass (its last may have fewer micro-batches; None for a
    # stream without a length) and in the whole run.
    t.updates_per_pass = steps and math.ceil(steps / args.grad_accum)
    t.total_updates = args.max_steps or args.epochs * t.updates_per_pass
    # float16 needs loss scaling against underflowing gradients; otherwise a no-op.
    t.scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
{{ par.wrap_model() }}


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


def build_loader(train_set, args, device, checkpoint):
    """The training set's ResumableSampler (a stream's StreamShard) and DataLoader.
    DDP change 2: each rank reads a different 1/world_size of the training set (a
    single-GPU script would pass shuffle=True to the DataLoader instead)."""
    if isinstance(train_set, IterableDataset):
        # Kept by checkpoints: a resume reads the stream as the run began to.
        shards = stream_shards(train_set, checkpoint, args, say=True)
        train_data = StreamShard(train_set, args, shards, every=args.grad_accum)
        return train_data, StreamLoader(train_data, args, device, lockstep=True)
    common = loader_options(train_set, args, device)
    train_set = Seeded(train_set, args.seed)
    train_data = ResumableSampler(train_set, shuffle=True, seed=args.seed)
{% if cookiecutter.use_batch_sampler %}
    batch_sampler = BatchSampler(train_data, args.batch_size, drop_last=DROP_LAST)
    return train_data, DataLoader(train_set, batch_sampler=batch_sampler, **common)
{% else %}
    return train_data, DataLoader(
        train_set, args.batch_size, sampler=train_data, drop_last=DROP_LAST, **common
    )
{% endif %}


def build_val_loader(val_set, args, device):
    """Validation shards take every world_size-th sample with no padding, so the
    summed metrics count each sample exactly once (DistributedSampler would repeat
    some); a stream is cut as for training (each item read once where it can be
    split by shard)."""
    if isinstance(val_set, IterableDataset):
        shard = StreamShard(val_set, args, stream_shards(val_set, None, args))
        return StreamLoader(shard, args, device, lockstep={{ fsdp }})
    options = loader_options(val_set, args, device)
    mine = range(dist.get_rank(), len(val_set), dist.get_world_size())
    shard = Subset(Seeded(val_set, args.seed), mine)  # (always pass 0: see Seeded)
    return DataLoader(shard, batch_size=args.batch_size, **options)


def stream_shards(stream, checkpoint, args, say=False):
    """How many sub-streams a stream is read as (None: whole, by every reader): its
    n_shards, where it has shard() and at least one shard per process; a resumed
    run's, as its checkpoint says. say: in one line where readers idle or read all."""
    if checkpoint is not None:
        return checkpoint["stream_shards"]
    world_size = dist.get_world_size()
    readers = world_size * max(args.num_workers, 1)
    n = getattr(stream, "n_shards", 0) if hasattr(stream, "shard") else 0
    if say and n < readers > 1:
        has = f"{n} shards" if hasattr(stream, "shard") else "no shard()"
        how = f"{readers - n} idle" if n >= world_size else "each reads all of it"
        print0(f"note: the training stream has {has}, {readers} readers: {how}")
    return n if n >= world_size else None


class ResumableSampler(DistributedSampler):
    """DDP change 2: a DistributedSampler (this rank's shard of each pass), from a
    given position: a run stopped mid-pass resumes with the next batch, without
    reading the ones already done."""

    start = 0  # this rank's samples of the pass to skip

    def set_epoch(self, epoch, samples=0, state=None):
        """Pass `epoch`, after `samples` of it (over all ranks); a sampler needs no
        `state` to get there."""
        super().set_epoch(epoch)
        self.dataset.set_epoch(epoch)  # (a Seeded: the dataset's own, where it has one)
        self.start = samples // self.num_replicas

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.start, None)

    def __len__(self):
        return self.num_samples - self.start


class Seeded(Dataset):
    """A map-style dataset whose items draw the same random numbers (an augmentation's:
    torch's, numpy's, Python's random) wherever they are read: before each item, they
    are seeded from --seed, the pass and the item's index, whichever rank or DataLoader
    worker reads it, and wherever the pass was resumed (a TensorDataset, which draws
    nothing, is spared the seeding). set_epoch(epoch), before each pass of the
    training set, calls the dataset's own where it has one (a curriculum); the
    validation set's stays at pass 0, so every evaluation draws alike."""

    def __init__(self, data, seed):
        self.data, self.seed, self.epoch = data, seed, 0
        self.draws = not isinstance(data, TensorDataset)  # (which only indexes)

    def set_epoch(self, epoch):
        self.epoch = epoch
        if hasattr(self.data, "set_epoch"):
            self.data.set_epoch(epoch)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        if self.draws:  # (about 10 µs an item)
            seed_draws(mixed(self.seed, self.epoch, index))
        return self.data[index]


class StreamShard(IterableDataset):
    """DDP change 2 for a stream (an IterableDataset, from build_datasets): what one
    reader reads of it, a DataLoader worker or the process itself (of processes x
    workers readers). Each item has a place in the pass. A stream that can be split
    by shard (n_shards and shard(), as Hugging Face's) is read as `shards` sub-streams,
    the n-th item of sub-stream c in place n x shards + c, and reader q reads the
    sub-streams q, q + readers, ... alone. Another stream is read whole by every
    reader, its n-th item in place n, and reader q takes the places q, q + readers,
    ...: so a process takes every processes-th, as DistributedSampler does, its
    workers in turn. A pass is cut into blocks of processes x batch_size places, one
    micro-batch of every process. So each item of a pass is used once, and the items
    of a global batch depend on the stream and `shards` alone, never on the
    processes or workers.

    A reader yields its part of every block, without end, with whether it has run out
    and, at an update's end, each sub-stream's state_dict() there (where it has one).
    A resume starts a pass at a place: a sub-stream with load_state_dict() goes there
    at once; another is read up to there, by its reader only."""

    def __init__(self, stream, args, shards, every=0):
        self.stream, self.shards, self.every = stream, shards, every
        self.seed = args.seed  # each item's draws: from it, the pass and the place
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.width = self.world_size * args.batch_size  # places in a block
        self.workers = max(args.num_workers, 1)
        self.epoch, self.start, self.states = 0, 0, {}
        # A part crosses to the training process collated (default_collate: a few
        # tensors, not one per item), unless the stream collates its own way.
        self.pack = list if getattr(stream, "collate_fn", None) else default_collate

    def set_epoch(self, epoch, samples=0, state=None):
        """Pass `epoch`, from place `samples` on, where the sub-streams' states were
        `state` ({sub-stream: its state_dict(), or True: it had run out})."""
        self.epoch, self.start, self.states = epoch, samples, state or {}

    def __iter__(self):
        worker = getattr(get_worker_info(), "id", 0)  # (None without workers)
        # A reader reads its sub-streams whole: hide the workers from a stream that
        # would split itself among them (as Hugging Face's does).
        torch.utils.data._utils.worker._worker_info = None
        # Reader q of the processes' readers (processes first, then their workers)
        # reads the sub-streams q, q + readers, ..., or a whole stream's places so.
        readers = self.world_size * self.workers
        reader = self.rank + self.world_size * worker
        owned = range(reader, self.shards, readers) if self.shards else [0]
        subs = [self.read(c) for c in owned]
        heads = [next(sub) for sub in subs]  # each one's next (place, item, state)
        for block in itertools.count(1):
            end, part = self.start + block * self.width, []
            for i, sub in enumerate(subs):
                while heads[i][0] < end:
                    if self.shards or heads[i][0] % readers == reader:
                        part.append(heads[i][1])
                    heads[i] = next(sub)
            done = all(place == math.inf for place, _, _ in heads)
            states = {c: state for c, (*_, state) in zip(owned, heads)}
            yield self.pack(part) if part else None, done, states

    def read(self, c):
        """Sub-stream c from the pass's start on, as (place, item, state), and at its
        end (inf, None, True); state: its state_dict() before the item was read, where
        an update ends between it and the item before (else None)."""
        step, state = self.shards or 1, self.states.get(c)  # items `step` places apart
        sub = self.stream.shard(self.shards, c) if self.shards else self.stream
        if hasattr(sub, "set_epoch"):
            sub.set_epoch(self.epoch)
        n = max(0, -(-(self.start - c) // step))  # its items before the start
        if state is True:  # it had run out
            sub, items = (), iter(())
        elif state is not None and hasattr(sub, "load_state_dict"):
            sub.load_state_dict(state)
            items = iter(sub)
        else:
            items = itertools.islice(sub, n, None)  # read up to there
        span = self.width * self.every or math.inf  # places in an update
        ends = self.start + span  # where the update of the item before ends
        for place in itertools.count(n * step + c, step):
            keep = place >= ends and hasattr(sub, "state_dict")
            state = copy.deepcopy(sub.state_dict()) if keep else None
            seed_draws(mixed(self.seed, self.epoch, place))
            if (item := next(items, StreamShard)) is StreamShard:  # none left
                yield math.inf, None, True
                return
            yield place, item, state
            ends = self.start + ((place - self.start) // span + 1) * span


class StreamLoader(DataLoader):
    """A stream's micro-batches on this rank: its readers' parts of each block (from
    the workers in turn), gathered and collated, the whole micro-batch at once. With
    lockstep (training; FSDP2's validation), where every rank takes every step, as
    (batch, real, places done after it, more: this rank has items after it, states)
    for every block, a stand-in that weighs nothing (real False) where this rank has
    no items: a stream read whole ends for every rank at once, one read by shard goes
    on until the caller learns that no rank has more. Without lockstep, the batches
    alone, until this rank's readers have run out."""

    def __init__(self, shard, args, device, lockstep):
        options = loader_options(shard.stream, args, device)
        whole = options["collate_fn"]  # the stream's own, on the whole micro-batch
        join = (lambda parts: whole([*itertools.chain(*parts)])) if whole else joined
        pin = pin_memory if options["pin_memory"] else lambda batch: batch  # here
        self.collate, self.lockstep = lambda parts: pin(join(parts)), lockstep
        options.update(collate_fn=tuple, pin_memory=False)  # parts pass as they are
        super().__init__(shard, batch_size=None, **options)

    def __iter__(self):
        shard, parts, batch = self.dataset, super().__iter__(), None
        # A block at a time; `place`: where it ends, the pass's places done after it.
        for place in itertools.count(shard.start + shard.width, shard.width):
            got = [next(parts) for _ in range(shard.workers)]
            filled = [part for part, _, _ in got if part is not None]
            more = not all(done for _, done, _ in got)
            states = {c: state for *_, kept in got for c, state in kept.items()}
            if filled:  # (the latest batch stands in where this rank has none)
                batch = self.collate(filled)
            elif self.lockstep and batch is None:  # none yet: one item to stand in
                if not (first := list(itertools.islice(shard.stream, 1))):
                    return  # an empty stream
                batch = self.collate([shard.pack(first)])
            if self.lockstep:
                yield batch, bool(filled), place, more, states
            elif filled:
                yield batch
            if not (more or self.lockstep and shard.shards):  # read whole: all end
                return


def joined(batches):
    """default_collate's batches of consecutive items (the parts of a micro-batch), as
    the batch of them all: their tensors concatenated, their lists of strings joined."""

    def join(*xs):  # the same field of each batch: tensors, or lists of strings
        return torch.cat(xs) if torch.is_tensor(xs[0]) else [*itertools.chain(*xs)]

    def strings(value):
        return isinstance(value, list) and all(isinstance(s, str) for s in value)

    return tree_map(join, *batches, is_leaf=strings)


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


