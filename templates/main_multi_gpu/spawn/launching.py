{# launcher=spawn: what main_multi_gpu.py says and does when it starts the workers
   itself with torch.multiprocessing, where torchrun.py has its own version: macros
   called from the section files (`{{ launcher.launching() }}`), in the order the
   generated file uses them. #}

{% macro launcher_flags() %}
    parser.add_argument(
        "--nproc-per-node",
        **count(torch.cuda.device_count() or 2),
        help="processes on this machine (default: one per GPU, or 2 on CPU)",
    )
{% if multi %}
    parser.add_argument("--nnodes", **count(1), help="machines taking part")
    parser.add_argument(
        "--node-rank",
        **count(0, least=0),
        help="this machine's number, 0 to nnodes - 1",
    )
    parser.add_argument(
        "--master-addr", default="127.0.0.1", metavar="A", help="machine 0's address"
    )
    parser.add_argument(
        "--master-port",
        type=at_least(1, 65535),
        metavar="P",
        help="port on machine 0 (default: a free port; 29500 when nnodes > 1)",
    )
{% else %}
    parser.add_argument(
        "--master-port",
        type=at_least(1, 65535),
        metavar="P",
        help="the rendezvous port (default: a free port)",
    )
{% endif %}
    # Accepted for torch.distributed.launch compatibility and ignored: workers get their
    # rank from mp.spawn.
{%- endmacro %}

{% macro launching() %}
# --------------------------------------------------------------------------------------
# Launching: one worker process per GPU (or 2 on a CPU)
# --------------------------------------------------------------------------------------
def hold_free_port(sock):
    """Bind sock to a free port and return the port. Keep sock open while the workers
    run: bound with address reuse and not listening, it lets rank 0's store (which
    binds with reuse too) listen there, but no other program can take the port first,
    as it could one picked and let go."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", 0))
    return sock.getsockname()[1]


def worker(local_rank, args, master_port):
    """Entry point of each process that mp.spawn starts, with local_rank 0..nproc-1."""
    # DDP change 1: describe this process in the environment, as torchrun would.
    os.environ.update(
{% if multi %}
        MASTER_ADDR=args.master_addr,
        MASTER_PORT=str(master_port),
        RANK=str(args.node_rank * args.nproc_per_node + local_rank),
        WORLD_SIZE=str(args.nnodes * args.nproc_per_node),
{% else %}
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        RANK=str(local_rank),
        WORLD_SIZE=str(args.nproc_per_node),
{% endif %}
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(args.nproc_per_node),
    )
    # Share the CPU cores between processes instead of oversubscribing them.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.nproc_per_node))
    # Were the launcher killed (kill -9, out of memory), torch's spawn would send
    # SIGINT, once per launcher thread, and a second SIGINT is a second Ctrl-C (stop
    # at once, saving nothing). SIGTERM instead: this rank saves and stops.
    signal_when_parent_ends(signal.SIGTERM)
    leave(run(args))


# torch's log line for each worker it stops after another one failed.
SPAWN_CHATTER = {"Terminating process %s via signal SIGTERM"}


def main():
    """Check the arguments, start one worker per GPU (DDP change 1), wait for them.

    Returns the exit status: the workers' (128 + a signal that stopped them).
    """
    args = parse_args()
    spare_the_garbage_collector()
    if problem := cuda_problem(args.backend, args.nproc_per_node):
        raise failure(problem)
    held = socket.socket()  # closed as main() returns: see hold_free_port()
{% if multi %}
    master_port = args.master_port or (
        29500 if args.nnodes > 1 else hold_free_port(held)
    )
    first_rank = args.node_rank * args.nproc_per_node
{% else %}
    master_port = args.master_port or hold_free_port(held)
    first_rank = 0
{% endif %}
    stops = []  # the signals received

    def on_signal(signum, frame):
        stops.append(signum)
        abort_if_asked(signum, stops)
        # Passed on (each worker saves, then exits), but Ctrl-C, which reaches the
        # workers too: a second one would stop them at once; SIGTERM in its place.
        for process in multiprocessing.active_children():  # the workers started
            os.kill(process.pid, signal.SIGTERM if signum == signal.SIGINT else signum)

    for signum in (*STOPS, signal.SIGQUIT):
        signal.signal(signum, on_signal)  # before they start: the workers reset it
    quiet_torch_logs("torch", SPAWN_CHATTER)
    # Its resource tracker, which the workers share, frees what their os._exit left.
    os.environ.setdefault("PYTHONWARNINGS", "ignore:resource_tracker:UserWarning")
    workers = mp.start_processes(
        worker, args=(args, master_port), nprocs=args.nproc_per_node, join=False
    )
    try:
        while not workers.join():
            pass
    except mp.ProcessRaisedException as error:
        print(error, file=sys.stderr)
        raise worker_failed(first_rank + error.error_index, "failed") from None
    except mp.ProcessExitedException as error:
        if error.exit_code < 0:
            rank = first_rank + error.error_index
            raise worker_failed(rank, f"died ({error.signal_name})") from None
        return error.exit_code  # the worker said why (130 or 143: it saved first)
    return 0


if __name__ == "__main__":
    sys.exit(main())
{%- endmacro %}
