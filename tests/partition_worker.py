"""One rank for the partition tests: barriers in a loop for DURATION seconds, then a report.

    DP_URL=... DP_RANK=r DP_WORLD_SIZE=n python partition_worker.py DURATION

Prints ``joined`` once the job has met, then one JSON line: {"rank", "rounds", "error", "at"}
(``at``: wall time of the error).
"""

import json
import sys
import time

import dataparallel as dp

duration = float(sys.argv[1])
ch = dp.connect(timeout=60)
ch.rendezvous()
print("joined", flush=True)  # the test cuts links only once every rank is in the job
rounds, error, at = 0, None, None
deadline = time.monotonic() + duration
try:
    while True:
        stop = ch.broadcast("stop", b"1" if time.monotonic() > deadline else b"0", src=0, timeout=30)
        ch.barrier("round", timeout=30)
        rounds += 1
        if stop == b"1":
            break
        time.sleep(0.05)
except dp.ControlError as err:
    error, at = f"{type(err).__name__}: {err}", time.time()
print(json.dumps({"rank": ch.rank, "rounds": rounds, "error": error, "at": at}), flush=True)
if error is None:
    ch.close()
sys.exit(1 if error else 0)
