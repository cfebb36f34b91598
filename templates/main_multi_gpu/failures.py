# --------------------------------------------------------------------------------------
# Stops, failures and hangs: say which rank, and where
# --------------------------------------------------------------------------------------
COLLECTIVE_GRACE = 30  # seconds a collective waits beyond twice --dist-timeout
# Stop, save, exit 128 + the signal: a scheduler's, Ctrl-C, a terminal that closed
STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP_SIGNAL = None  # the first of STOPS received: stop, save, exit 128 + it
# stderr is line-buffered (Python 3.9+; unbuffered under -u): a write that ends a
# line reaches the file at once, before an os._exit too, with no flush.


def failure(message, status=1):
    """The exit for a clear error: rank 0 alone prints why, once, and every rank exits
    with `status` (2: an argument that cannot work)."""
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr)
{% if multi and not spawn %}
    if status == 2 and "ELASTIC_REFUSED" in os.environ:  # no round can go on: the job
        Path(os.environ["ELASTIC_REFUSED"]).touch()  # ends (see elastic_rendezvous)
{% endif %}
    return SystemExit(status)


def on_stop_signal(signum, frame):
    """SIGTERM (how Slurm and Kubernetes preempt), Ctrl-C (SIGINT) or SIGHUP (the
    terminal closed): training stops at the next check, saves a checkpoint, and exits
    with 128 + the signal's number. A second Ctrl-C stops at once, saving nothing."""
    global STOP_SIGNAL
    if STOP_SIGNAL is None:
        STOP_SIGNAL = signum
    elif signum == signal.SIGINT:
        stop_now(128 + signum)


def abort_if_asked(signum, stops):
    """A launcher's answer to SIGQUIT, or to a second Ctrl-C (`stops`: the signals it
    got): stop the workers at once, saving nothing."""
    if signum == signal.SIGQUIT or signum == signal.SIGINT and len(stops) > 1:
        how = "a second Ctrl-C" if signum == signal.SIGINT else "SIGQUIT"
        sys.stderr.write(f"aborted: {how} stopped the workers at once\n")
        stop_now(128 + signum)  # they, and all below them, at once


def leave(status):
    """End this worker process with `status` as a normal exit would (threads that are
    not daemons waited for, atexit handlers run), without the interpreter's teardown:
    there, a gloo thread that lets go of a tensor waits for the GIL, is ended, and
    aborts the process ("terminate called without an active exception"): now and
    then, a rank died by SIGABRT after a run that had finished and saved."""
    # What Python's own exit does before the teardown: stop the executors' threads,
    # wait for the threads that are not daemons, run the atexit handlers.
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()  # (stderr writes each line through)
    os._exit(status)


def stop_now(status):
    """Exit at once (from any thread), ending what this process started."""
    stop_children()
    os._exit(status)


def children(pid):
    """The processes that `pid` started (Linux, from /proc; elsewhere none)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            found += map(int, task.read_text().split())
    return found


def descendants(pid):
    """The processes below `pid`, each before its own."""
    return [each for child in children(pid) for each in (child, *descendants(child))]
{% if not spawn %}


def running(pid):
    """Whether this process's child `pid` has not ended (left for torchrun to reap)."""
    with contextlib.suppress(ChildProcessError):
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    return False
{% endif %}


def start_fork_server():
    """Start the DataLoader workers' fork server and resource tracker (quiet on what an
    os._exit left): both ignore SIGTERM, Ctrl-C; workers hold them. The fork server
    imports this file once, and with it what the edit zone imports: every worker of
    every pass is a fork of it, which imports nothing again."""
    multiprocessing.set_forkserver_preload(["__main__"])
    os.environ.setdefault("PYTHONWARNINGS", "ignore:resource_tracker:UserWarning")
    # CPython's fork server imports __main__ only when handed its path as main_path,
    # which get_preparation_data() stopped giving in 3.4 (gh-126631, fixed in 2025):
    # give it, with this file's folder on the path for its neighbours (before 3.13,
    # the fork server had no sys.path of ours).
    spawn, environment = multiprocessing.spawn, dict(os.environ)
    prepare = spawn.get_preparation_data
    if main := prepare("ignore").get("init_main_from_path"):
        spawn.get_preparation_data = lambda name: {**prepare(name), "main_path": main}
        paths = [os.path.dirname(main), os.environ.get("PYTHONPATH")]
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)  # meanwhile held for this process
    default = {signum: signal.signal(signum, signal.SIG_IGN) for signum in STOPS}
    multiprocessing.forkserver.ensure_running()  # SIG_IGN survives its exec
    spawn.get_preparation_data = prepare
    os.environ.clear()
    os.environ.update(environment)
    for signum, handler in default.items():
        signal.signal(signum, handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)  # delivered now, if sent


def stop_children():
    """End at once what this process started (DataLoader workers hold SIGTERM, and
    Python's exit would wait for them) but the resource tracker, which cleans up."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # else torch reports each end
    tracker = getattr(multiprocessing, "resource_tracker", None)  # with workers
    for pid in descendants(os.getpid()):
        if not tracker or pid != tracker._resource_tracker._pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def keep_freed_memory(limit=1 << 30):
    """glibc (Linux): let freed tensor memory stay in the process for the next step.
    It hands large freed blocks straight back to the kernel, so every step faulted the
    same memory in again (a fifth of the step time for the CPU default here)."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "mallopt"):  # glibc (other C libraries: absent or a no-op)
        libc.mallopt(-3, limit)  # M_MMAP_THRESHOLD: larger blocks get their own map
        libc.mallopt(-1, limit)  # M_TRIM_THRESHOLD: free heap top kept up to this
    # The same for processes started from here that do not fork (DataLoader workers
    # under the spawn or forkserver start method): glibc reads these.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(limit))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(limit))


def spare_the_garbage_collector():
    """Exempt the objects made so far (some 170,000, nearly all torch's), and at exit
    all the others, from full garbage collections: they live as long as the process,
    yet each one walked them all (about 0.8 s of CPU in each process)."""
    gc.freeze()
    atexit.register(gc.freeze)


# What each rank is doing when the job stalls, as the summary says it.
WAITS = "waits for the other ranks"
LOADER = "waits for its DataLoader workers"
{{ par.collectives() }}
# With NCCL a collective only queues work on the GPU: a rank waiting for the others
# stops at its next wait for the GPU instead. This file's functions that wait so
# (.item(), .tolist(), a copy; train_pass and lockstep: at a stream's end, whether any
# rank has more), and torch's: GradScaler's check for infs, clipping.
HOST_SYNCS = {"check", "run_validation", "by_rank_0"}
{% if fsdp %}
HOST_SYNCS |= {"broadcast_bytes", "preflight", "to_device", "train_pass", "lockstep"}
HOST_SYNCS |= {"fingerprints"}  # (a checkpoint's: the frozen parameters' sums)
{% else %}
HOST_SYNCS |= {"broadcast_bytes", "preflight", "to_device", "train_pass"}
{% endif %}
COLLECTIVES += ("torch/amp/grad_scaler", "torch/nn/utils/clip_grad")
# How gloo says that another rank went away or timed out, in plain RuntimeErrors
# (NCCL and the store raise DistErrors).
LOST = ("closed by peer", "reset by peer", "Timed out waiting", "caused pair closure")


class HangWatch:
    """A thread in every process that ends the job once the process has made no
    progress for --dist-timeout seconds, instead of letting the others wait in a
    collective until they time out with an error that names only themselves. Every
    rank then prints its stack (all threads, and its DataLoader workers'), each line
    starting with [rank N]; one rank prints where each rank stood; all exit 1.

    Progress is a step (beats), or, between steps (torch.compile, a save), a change of
    the main thread's line. A rank waiting longer than the timeout for another's slow
    work (rank 0 saving a huge checkpoint) counts as stuck too: raise --dist-timeout
    for such jobs. The ranks agree through the store, not a collective."""

    beats, reporting = 0, False  # (also before start(): this file imported elsewhere)

    def start(self, store, timeout):
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.store, self.timeout = dist.PrefixStore(f"hang/{restart}", store), timeout
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.watch, name="watch", daemon=True)
        self.thread.start()

    def stop(self):
        self.done.set()
        self.thread.join()

    def watch(self):
        last, since = None, time.monotonic()
        # The store may go with its host (rank 0, a launcher), which ends this rank too.
        with contextlib.suppress(dist.DistError):
            while not self.done.wait(1.0):
                # If this thread cannot run (a C call holding the GIL), faulthandler
                # prints every thread's stack and ends the process in its place.
                faulthandler.dump_traceback_later(self.timeout + 30, exit=True)
                # The main thread's line: the same one, for long, is no progress either.
                frame = sys._current_frames()[threading.main_thread().ident]
                now = (self.beats, frame.f_code, frame.f_lineno)
                if now != last:
                    last, since = now, time.monotonic()
                elif time.monotonic() - since > self.timeout:
                    self.store.set("declared", str(self.rank))
                if self.store.check(["declared"]):
                    return self.report()
        faulthandler.cancel_dump_traceback_later()  # stopped (report() never returns)

    def report(self):
        """Print this rank's stack, say where it stands, and end the job. Rank 0
        summarizes, and leaves last: it may hold the store the others use."""
        self.reporting = True
        where, kind = locate(sys._current_frames()[threading.main_thread().ident])
        print_stacks(self.rank, loader_workers=kind == LOADER)
        try:
            self.store.set(f"where/{self.rank}", f"{kind}\t{where}")
            self.count("reported", 1)
            if self.rank == 0:
                self.wait_for(lambda: self.count("reported") == self.world_size)
                self.summarize()
                self.store.set("summarized", "1")
                self.wait_for(lambda: self.count("left") == self.world_size - 1, 5)
            else:
                self.wait_for(lambda: self.store.check(["summarized"]), 15)
                self.count("left", 1)
        finally:
            stop_now(1)

    def count(self, name, add=0):
        return self.store.add(name, add)

    def wait_for(self, done, seconds=10):
        deadline = time.monotonic() + seconds
        while not done() and time.monotonic() < deadline:
            time.sleep(0.1)

    def summarize(self):
        """Where each rank stood, and which one the others are waiting for."""
        lines, stuck = [], []
        for rank in range(self.world_size):
            if not self.store.check([f"where/{rank}"]):
                lines.append(f"  rank {rank}: no answer (its Python is blocked)")
                continue
            kind, where = self.store.get(f"where/{rank}").decode().split("\t")
            lines.append(f"  rank {rank}: {where}  ({kind})")
            if kind != WAITS:
                stuck.append(str(rank))
        verdict = "every rank waits in a collective: not all in the same one "
        verdict += "(a rank skipped or added one), or the network between them stalled."
        if stuck:
            who = ("rank " if len(stuck) == 1 else "ranks ") + ", ".join(stuck)
            verdict = f"{who}: no progress outside a collective, while the others wait;"
            verdict += f" see the lines above that start with [rank {stuck[0]}]."
        head = f"hang: no progress for {self.timeout:g} s (--dist-timeout); where each"
        print("\n".join([f"{head} rank stood:", *lines, verdict]), file=sys.stderr)


WATCH = HangWatch()


def locate(frame):
    """Where a stack stands: its innermost line in this file, and what it waits for."""
    stack = traceback.extract_stack(frame)
    inner = ([entry for entry in stack if in_this_file(entry)] or stack)[-1]
    below = " ".join(entry.filename for entry in stack[stack.index(inner) + 1 :])
    # On GPUs, a wait of this file's (.item()) for a collective queued before.
    host_sync = not below and inner.name in HOST_SYNCS
    where = f"{inner.name}, line {inner.lineno}: {inner.line}"
    if "torch/utils/data" in below:
        return where, LOADER
    # Waits too: in a collective, DDP's forward, the gradient all-reduce.
    if host_sync or any(part in below for part in COLLECTIVES):
        return where, WAITS
    return where, "busy outside any collective"


def in_this_file(entry):
    """Whether a traceback entry, code object or path is of this file."""
    path = getattr(entry, "filename", getattr(entry, "co_filename", entry))
    return os.path.realpath(path) == os.path.realpath(__file__)


def print_stacks(rank, main_traceback=None, loader_workers=False):
    """Every thread's stack, each line starting with [rank N] (the main thread's as
    main_traceback has it, if given); then, if asked, the DataLoader workers'."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    frames, main = sys._current_frames(), threading.main_thread().ident
    frames = {main: frames.pop(main), **frames}  # the main thread first
    lines = []
    for ident, frame in frames.items():
        if names.get(ident) == WATCH.thread.name:
            continue  # it only reports
        tb = main_traceback if ident == main else None  # where it raised, if given
        stack = traceback.format_tb(tb) if tb else traceback.format_stack(frame)
        lines.append(f"thread {names.get(ident, ident)} (most recent call last):")
        lines += "".join(stack).rstrip().splitlines()
    sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in lines))
    for child in multiprocessing.active_children() if loader_workers else ():
        head = f"[rank {rank}] DataLoader worker {child.pid}:"
        if not handles(child.pid, signal.SIGUSR1):  # the signal would end it
            print(head, "stuck before its first line (no stack)", file=sys.stderr)
            continue
        print(head, file=sys.stderr)
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(child.pid, signal.SIGUSR1)  # faulthandler prints its stack
        time.sleep(0.5)  # before the next one, and before they are stopped


def handles(pid, signum):
    """Whether process pid has a handler for signum, as Linux tells (elsewhere:
    assumed). A DataLoader worker gets its own in loader_worker_init()."""
    with contextlib.suppress(OSError):  # no /proc (not Linux), or the process is gone
        caught = re.search(r"SigCgt:\s(\w+)", Path(f"/proc/{pid}/status").read_text())
        return bool(int(caught[1], 16) >> (signum - 1) & 1)  # a mask of hex digits
    return sys.platform != "linux"


def report_lost_peer(err):
    """This rank's stack, and one line: where it was, and what broke (nothing where
    another rank raised an error: its report says it)."""
    with contextlib.suppress(dist.DistError):  # the store may have gone with its host
{% if spawn %}
        # Rank 0 holds the store: the others cannot ask it once rank 0 has gone.
        if WATCH.rank == 0 and WATCH.count("raised"):
{% else %}
        if WATCH.count("raised"):
{% endif %}
            return
{% if multi and not spawn %}
    elastic = "ELASTIC_ROUND" in os.environ  # NNODES=MIN:MAX: torchrun goes on
    if not elastic:
        print_stacks(WATCH.rank, err.__traceback__)
{% else %}
    print_stacks(WATCH.rank, err.__traceback__)
{% endif %}
    ours = [f for f in traceback.extract_tb(err.__traceback__) if in_this_file(f)]
    where = f"{ours[-1].name}, line {ours[-1].lineno}" if ours else "a collective"
    reason = str(err).strip().splitlines()[0].split("] ")[-1].split(". ")[0]
    line = f"[rank {WATCH.rank}] error: a collective failed in {where} ({reason}); if "
    line += "another rank ended, the launcher's line names it"
{% if multi and not spawn %}
    if elastic:
        line = f"[rank {WATCH.rank}] elastic: lost a peer in {where} ({reason}); the "
        line += "others go on without it, from the last checkpoint"
{% endif %}
    print(line, file=sys.stderr)


def report_error(err):
    """An exception this rank raised: the first rank to raise one prints its traceback,
    from the first frame of the edit zone on, then one line naming the rank, the
    function and the line; other ranks that raise one are counted, not repeated."""
    rank, raised, first = dist.get_rank(), 1, True
    with contextlib.suppress(dist.DistError):  # the store may have gone with its host
        first = WATCH.count("raised", 1) == 1
        if first:  # a moment for the others that fail alike
            WATCH.wait_for(lambda: WATCH.count("raised") == WATCH.world_size, 1)
        else:  # the first one's report
            WATCH.wait_for(lambda: WATCH.store.check(["reported"]), 5)
        raised = WATCH.count("raised")
    tb, yours = err.__traceback__, run.__code__.co_firstlineno  # the edit zone ends
    while tb and not (in_this_file(tb.tb_frame.f_code) and tb.tb_lineno < yours):
        tb = tb.tb_next  # this file's frames above yours, and torch's between
    text = "".join(traceback.format_exception(type(err), err, tb or err.__traceback__))
    # This file's frames, with those in a DataLoader worker's traceback (the text).
    frames = re.findall(r'File "(.+)", line (\d+), in (\S+)', text)
    ours = [(int(n), name) for path, n, name in frames if in_this_file(path)]
    line, name = ([p for p in ours if p[0] < yours] or ours or [(0, "?")])[-1]
    why = (str(err).strip().splitlines() or [""])[0]
    also = f"; {raised} of {dist.get_world_size()} ranks failed" if raised > 1 else ""
    text += f"[rank {rank}] error: {type(err).__name__} in {name}, line {line}: "
    if first:
        print(f"{text}{why} (the traceback above{also})", file=sys.stderr)
    with contextlib.suppress(dist.DistError):  # rank 0 leaves last: it may hold the
        WATCH.store.set("reported", "1")  # store the others ask
        if rank:
            WATCH.count("left", 1)
        else:
            WATCH.wait_for(lambda: WATCH.count("left") >= WATCH.count("raised") - 1, 5)


def returned(name, value, expected):
    """The error for a value that cannot work, which `name` (one of the five functions
    above) returned."""
    return failure(f"error: {name} returned {shown(value)}; it must return {expected}")


def shown(value):
    """A value as an error line describes it: its kind, and a tensor's shape."""
    if torch.is_tensor(value):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {shown(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(map(shown, value)) + ")"
    return f"a {type(value).__name__}"


def quiet_torch_logs(logger, messages):
    """Drop torch's log lines that repeat what this script says in its own words."""
    for handler in logging.getLogger(logger).handlers:
        handler.addFilter(lambda log: not any(m in str(log.msg) for m in messages))


def worker_failed(rank, how):
    """A launcher's exit after a worker failed or died (`how`, said in its line)."""
    return failure(f"error: rank {rank} {how}; the other workers were stopped")


