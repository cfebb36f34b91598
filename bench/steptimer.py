"""The one measurement every contender shares: a global optimizer-step post-hook.

Each contender calls install() once, before training. torch then calls the hook after
every optimizer.step() of any optimizer in the process; the training loops themselves
are not touched. Accelerate's and Fabric's optimizer wrappers end in the wrapped SGD's
step(), so the hook fires at the same point of the step for all four contenders.

Configuration comes from the environment, set by run.py for every contender alike:
  BENCH_RESULT     where rank 0 writes its JSON
  BENCH_STEPS      optimizer steps in the run
  BENCH_WARMUP     steps left out of the steady-state rate
  BENCH_SAMPLES    samples per optimizer step over all ranks (global batch)
  BENCH_LAUNCH_T0  time.time() just before run.py started the launcher
  BENCH_PROFILE    (optional, CUDA) a folder: rank 0 records the GPU's kernels over 10
                   steps after the warm-up (torch.profiler, CUDA activity only) and
                   writes there what they took a step, how long the GPU sat idle, and
                   the kernels by time (profile()); that run's rates are not the loop's
On CUDA the hook synchronizes at three steps only (the first, the last warm-up step and
the last step), so the timestamps there include the GPU work queued before them; the
steps in between run exactly as the loop alone would run them.
"""

import json
import os
import resource
import time


def process_start():
    """time.time() when this process started (Linux: from /proc, 10 ms resolution)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()  # elsewhere: when install() was called


def install(contender):
    """Register the hook; rank 0 writes the result JSON right after the last step."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    result_path = os.environ["BENCH_RESULT"]
    total = int(os.environ["BENCH_STEPS"])
    warmup = int(os.environ["BENCH_WARMUP"])
    samples_per_step = int(os.environ["BENCH_SAMPLES"])
    launch_t0 = float(os.environ["BENCH_LAUNCH_T0"])
    started = process_start()
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()
    synced = {1, warmup, total}
    stamps = []  # perf_counter() after each step
    rusage = {}  # (minor faults, user s, sys s), all threads, at the steady boundaries
    first_step_wall = []  # time.time() after the first step
    profiled = os.environ.get("BENCH_PROFILE") if cuda and rank == 0 else None
    recorder = []  # the profiler, while it records

    def hook(optimizer, args, kwargs):
        step = len(stamps) + 1
        if step > total:
            return
        if cuda and (step in synced or profiled and step in (warmup, warmup + 10)):
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
        if profiled and step == warmup + 10 and recorder:
            profile(recorder.pop(), stamps[-1] - stamps[warmup - 1], 10)
        if profiled and step == warmup and warmup + 10 <= total:
            recorder.append(torch.profiler.profile(activities=[cuda_activity]))
            recorder[0].__enter__()
        if step in (warmup, total):
            usage = resource.getrusage(resource.RUSAGE_SELF)
            rusage[step] = (usage.ru_minflt, usage.ru_utime, usage.ru_stime)
        if step == 1:
            first_step_wall.append(time.time())
        if step == total:
            write(optimizer)

    def write(optimizer):
        with torch.no_grad():  # a checksum of the trained weights (after timing)
            param_sum = sum(
                whole(p).double().abs().sum().item()
                for group in optimizer.param_groups
                for p in group["params"]
            )
        group = torch.distributed.is_available() and torch.distributed.is_initialized()
        checks = {
            "rank": rank,
            # Every rank's weights must be equal after the same steps: the proof that
            # the loop really averaged gradients over the group run.py asked for.
            "param_abs_sum": param_sum,
            "group_size": torch.distributed.get_world_size() if group else None,
        }
        if rank != 0:
            dump(checks, f"{result_path}.rank{rank}")
            return

        def per_step(field, scale):
            done, begun = rusage[total][field], rusage[warmup][field]
            return scale * (done - begun) / (total - warmup)

        steady_s = stamps[total - 1] - stamps[warmup - 1]
        steps_s = sorted(b - a for a, b in zip(stamps[warmup - 1 :], stamps[warmup:]))
        result = {
            "contender": contender,
            "steps": total,
            "warmup_steps": warmup,
            "samples_per_step": samples_per_step,
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "device": "cuda" if cuda else "cpu",
            "steady_samples_per_s": samples_per_step * (total - warmup) / steady_s,
            "steady_step_ms": 1000 * steady_s / (total - warmup),
            # The median step (CPU only: on CUDA the steps between syncs are not timed).
            "median_step_ms": None if cuda else 1000 * steps_s[len(steps_s) // 2],
            # CPU time of rank 0's main process per steady step: less sensitive than
            # wall time to other load on the machine (DataLoader workers not counted).
            "steady_cpu_ms_per_step": per_step(1, 1000) + per_step(2, 1000),
            # Minor page faults per steady step, and the CPU time split into user and
            # kernel (sys): memory the C allocator gave back and takes again shows here.
            "steady_page_faults_per_step": per_step(0, 1),
            "steady_user_ms_per_step": per_step(1, 1000),
            "steady_sys_ms_per_step": per_step(2, 1000),
            "first_step_from_launch_s": first_step_wall[0] - launch_t0,
            "first_step_from_process_start_s": first_step_wall[0] - started,
            "process_start_from_launch_s": started - launch_t0,
            "step_end_s": [t - stamps[0] for t in stamps],
            "torch_threads": torch.get_num_threads(),
            **checks,
        }
        dump(result, result_path)

    def profile(recorder, wall_s, steps):
        """The recorded kernels (and copies) a step: their time, how long the GPU had
        none running, and the 25 that took longest in all."""
        recorder.__exit__(None, None, None)
        events = [e for e in recorder.events() if e.device_type.name == "CUDA"]
        spans = sorted((e.time_range.start, e.time_range.end) for e in events)
        busy, reach = 0.0, -float("inf")  # the union of the spans, in µs
        for start, end in spans:
            busy += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        by_name = {}
        for e in events:
            count, us = by_name.get(e.name, (0, 0.0))
            by_name[e.name] = count + 1, us + e.time_range.end - e.time_range.start
        kernels_ms = sum(us for _, us in by_name.values()) / steps / 1000
        head = f"{contender}: {steps} steps, {1000 * wall_s / steps:.3f} ms a step "
        head += f"(wall, profiled), kernels {kernels_ms:.3f} ms a step, the GPU busy "
        head += (
            f"{busy / steps / 1000:.3f} ms, {len(events) / steps:.0f} kernels a step"
        )
        lines = [head, "ms a step  calls a step  kernel"]
        top = sorted(by_name.items(), key=lambda item: -item[1][1])[:25]
        lines += [
            f"{us / steps / 1000:9.3f}  {n / steps:12.1f}  {name[:110]}"
            for name, (n, us) in top
        ]
        os.makedirs(profiled, exist_ok=True)
        path = os.path.join(profiled, f"{contender}-{os.getpid()}.txt")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")

    def whole(param):
        """A parameter as one tensor: an FSDP2 shard (a DTensor) gathered from every
        rank (all ranks call this at the same step)."""
        param = param.detach()
        return param.full_tensor() if hasattr(param, "full_tensor") else param

    def dump(obj, path):
        with open(path + ".tmp", "w") as f:
            json.dump(obj, f)
        os.replace(path + ".tmp", path)

    if warmup < 1 or total <= warmup:
        raise SystemExit(f"need 1 <= warm-up steps < steps, got {warmup}, {total}")
    cuda_activity = torch.profiler.ProfilerActivity.CUDA
    register_optimizer_step_post_hook(hook)
