"""Run tests again and again, and count: the tests that once failed now and then (a
DataLoader worker forked from a training process, a port picked and bound later, a
restart reading the previous attempt's keys), or any you name. Not part of the suite.

    python tests/stress.py                        # the default set, 10 rounds
    python tests/stress.py --rounds 30 tests/test_streams.py::test_a_stream_...

Each round is one pytest run of all the tests (-n 2); at the end, one line per test:
passed and failed counts. Exit status 1 if any failed."""

import argparse
import collections
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = [
    # DataLoader workers (now from a fork server) with streams and kills
    "tests/test_streams.py::test_a_stream_without_state_reads_up_to_where_it_stopped",
    "tests/test_streams.py::test_a_stream_killed_without_warning_resumes_from_its_last_save",
    "tests/test_streams.py::test_a_stream_on_two_processes_equals_one_with_twice_the_batch",
    "tests/test_fresh_workers.py",
    # torchrun's store: shared by the workers, with and without restarts
    "tests/test_faults.py::test_torchrun_restarts_from_the_checkpoint_and_ends_the_same",
    "tests/test_faults.py::test_torchrun_workers_use_no_port_of_their_own",
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests", nargs="*", default=DEFAULT)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    counts = collections.defaultdict(collections.Counter)
    start = time.monotonic()
    for round_ in range(1, args.rounds + 1):
        command = [sys.executable, "-m", "pytest", "-n", "2", "-q", "-rA"]
        command += ["-p", "no:cacheprovider", *args.tests]
        output = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        for outcome, test in re.findall(
            r"^(PASSED|FAILED|ERROR) (\S+)", output.stdout, re.MULTILINE
        ):
            counts[test][outcome] += 1
        failed = sum(c["FAILED"] + c["ERROR"] for c in counts.values())
        print(
            f"round {round_}: {failed} failures so far, "
            f"{time.monotonic() - start:.0f} s",
            flush=True,
        )
    for test, c in sorted(counts.items()):
        print(f"{c['PASSED']:4d} passed {c['FAILED'] + c['ERROR']:3d} failed  {test}")
    return 1 if any(c["FAILED"] or c["ERROR"] for c in counts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
