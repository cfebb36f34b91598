{# launcher=torchrun: what main_multi_gpu.py says and does when torchrun starts the
   workers, where spawn.py has its own version: macros called from the section files
   (`{{ launcher.launching() }}`), in the order the generated file uses them. #}

{% macro launcher_flags() %}
    parser.add_argument(
        "--torchrun",
        metavar="OPTIONS",
        help="run torchrun with these options in this process, to start the workers "
        "(as the run scripts do)",
    )
    # DDP change 1: torch.distributed.launch passes --local-rank=N; LOCAL_RANK from the
    # environment (set by torchrun and by torch.distributed.launch) is what counts.
{%- endmacro %}

{% macro launching() %}
# --------------------------------------------------------------------------------------
# Launching: one worker process per GPU (or 2 on a CPU)
# --------------------------------------------------------------------------------------
# torchrun's log lines that repeat what the workers or launch() say themselves.
TORCHRUN_CHATTER = {
    "Received %s death signal, shutting down workers",
    "Sending process %s closing signal %s",
    "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
{% if multi %}
    "has failed to shutdown the rendezvous",  # elastic: its host is gone
    "has failed to send a keep-alive heartbeat",
{% endif %}
}


def launch(options, timeout, backend):
    """DDP change 1, as the run scripts start it: torchrun, with these options, starts
    one worker per GPU (and restarts them all after a failure, with MAX_RESTARTS). It
    runs inside this process, not as the torchrun command, so that a failure, Ctrl-C
    or SIGTERM ends in one line and the exit status the README gives: the workers', or
    128 + the signal that stopped them. A stop signal reaches the workers, which get
    `timeout` seconds (--dist-timeout) to save and stop before they are killed. A
    `backend` (--backend) that cannot serve the workers stops it before they start.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it, silently
    spare_the_garbage_collector()
    quiet_torch_logs("torch.distributed", TORCHRUN_CHATTER)
    stops = []  # signals received

    def on_signal(signum, frame):
        stops.append(signum)
        abort_if_asked(signum, stops)
        if len(stops) == 1:  # the workers save and stop; then torchrun ends
            workers = children(os.getpid())
            for pid in workers:
                os.kill(pid, signum)
            deadline = time.monotonic() + timeout
            while any(map(running, workers)) and time.monotonic() < deadline:
                time.sleep(0.1)
            raise SignalException(f"signal {signum}", sigval=signal.Signals(signum))

    for signum in (*STOPS, signal.SIGQUIT):
        signal.signal(signum, on_signal)
    # torchrun sets its own handler for these as it starts the workers: this one, so
    # that every torch release treats them alike.
    torch.distributed.elastic.multiprocessing.api._terminate_process_handler = on_signal
    # The workers run this file with the same arguments.
    command = shlex.split(options)
    parsed = get_args_parser().parse_args([*command, __file__])
{% if multi %}
    if parsed.rdzv_backend == "elastic":  # NNODES=MIN:MAX in run_multi.sh
        rendezvous_handler_registry.register("elastic", elastic_rendezvous)
{% endif %}
    nproc = parsed.nproc_per_node
    if problem := cuda_problem(backend, int(nproc) if nproc.isdigit() else 1):
        raise failure(problem)
    try:
        torchrun([*command, __file__, *sys.argv[1:]])
    except SignalException:
        return 128 + stops[0]
    except (RendezvousError, dist.DistError) as err:
{% if multi %}
        raise failure(elastic_failed(err, parsed)) from None
{% else %}
        raise failure(rendezvous_failed(err, endpoint(parsed))) from None
{% endif %}
    except ChildFailedError as error:
        rank, failed = min(error.failures.items(), key=lambda item: blame(item[1]))
        if failed.exitcode < 0:
            raise worker_failed(rank, f"died ({failed.signal_name()})") from None
        return failed.exitcode  # the worker said why
    return 0


{% if multi %}
def elastic_failed(err, options):
    """The one line for a rendezvous that failed. Only a connection to its host that
    failed after a round had formed says the host is gone: no round within
    DIST_TIMEOUT means too few machines joined (one lost, one stalled that long, or
    one never started), while the host answered all along; a rendezvous closed was
    closed by another machine's torchrun."""
    at = endpoint(options)
    if isinstance(err, RendezvousTimeoutError):  # (it says nothing itself)
        least = options.nnodes.split(":")[0]
        waited = os.environ.get("DIST_TIMEOUT", "600")
        return (
            f"error: no round of the rendezvous at {at} within {waited} s "
            f"(DIST_TIMEOUT): fewer than {least} machines (NNODES) joined; start the "
            "missing ones, or give a slow one longer with DIST_TIMEOUT"
        )
    if isinstance(err, RendezvousClosedError):
        return (
            f"error: the rendezvous at {at} was closed by another machine's torchrun "
            "(its job ended, or failed after its restarts): see that machine's output"
        )
    lost = isinstance(err, (RendezvousConnectionError, dist.DistNetworkError))
    if lost and "ELASTIC_ROUND" in os.environ:  # it had formed: its host is gone
        return (
            f"error: lost the rendezvous at {at}, with the machine that hosts it "
            "(MASTER_ADDR): the others cannot go on without it; RDZV_FILE on a disk "
            "every machine shares lets any machine go"
        )
    return rendezvous_failed(err, at)


def elastic_rendezvous(params):
    """torchrun's c10d rendezvous, as run_multi.sh names it for NNODES=MIN:MAX: its
    workers keep their keys in its own store (which stays as machines come and go),
    under a name new each round (its rank 0 picks it), so that no round reads the
    keys of one before it. torchrun's store for workers goes unused: it would keep
    old keys under the same names (pytorch#135712), and its address after the machine
    that held it left; a machine that joins would wait for it forever. A round its
    workers refused (exit 2: a global batch it cannot keep, a stream without
    --max-steps; rank 0 said why) ends the job instead of restarting it: failure()
    leaves a file, on every machine."""
    backend, store = create_backend(params)
    handler = create_handler(store, backend, params)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # and so it is not made
    join = handler.next_rendezvous
    os.environ["ELASTIC_STORE"] = f"{params.get('store_type', 'tcp')} {params.endpoint}"
    refused = Path(os.environ.get("TMPDIR", "/tmp"), f"elastic-refused-{os.getpid()}")
    os.environ["ELASTIC_REFUSED"] = str(refused)
    atexit.register(refused.unlink, missing_ok=True)

    def next_rendezvous():
        if refused.exists():  # the last round's workers refused it: none can go on
            raise SystemExit(2)
        info = join()
        if info.rank == 0:
            info.store.set("workers", os.urandom(8).hex())
        os.environ["ELASTIC_ROUND"] = info.store.get("workers").decode()
        return info

    handler.next_rendezvous, handler.get_backend = next_rendezvous, lambda: "elastic"
    return handler


{% endif %}
def endpoint(options):
    """host:port of the rendezvous that torchrun's (parsed) options name."""
    if options.standalone:  # torchrun picks a free local port
        return "localhost"
    return options.rdzv_endpoint or f"{options.master_addr}:{options.master_port}"


def blame(failed):
    """Sort key for a failed worker, the cause first: killed by a signal; exited (and
    said why); killed by SIGTERM, which is torchrun stopping the others."""
    return failed.exitcode == -signal.SIGTERM, failed.exitcode >= 0


if __name__ == "__main__":
    args = parse_args()
    if args.torchrun and "RANK" not in os.environ:
        sys.exit(launch(args.torchrun, args.dist_timeout, args.backend))
    leave(run(args))
{%- endmacro %}
