"""The status page and the ``top`` view of a real job, for the docs: three ranks train a small
model with ``dp.fit`` (zmq, gloo) and rank 2's data loader stalls for a while; meanwhile the
driver's page (``status_http``) is screenshotted with headless Chromium and ``dataparallel
top`` prints one look.

    python -m benchmarks.status_page            # writes docs/img/status-page.png, docs/img/status-top.txt

Needs Chromium (Debian: ``apt-get install chromium``) and ``dataparallel[observe]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

import dataparallel as dp
from dataparallel.testing import free_port

JOB = "demo"


class SlowAfter(torch.utils.data.Dataset):
    """A dataset whose ``at``-th read waits ``seconds`` (a data loader that stalls)."""

    def __init__(self, inner: torch.utils.data.Dataset, at: int, seconds: float) -> None:
        self.inner, self.at, self.seconds, self.reads = inner, at, seconds, 0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        self.reads += 1
        if self.reads == self.at:
            time.sleep(self.seconds)
        time.sleep(0.002)  # a step of some milliseconds
        return self.inner[i]


def rank(url: str, r: int, web: int, stall: float) -> None:
    torch.manual_seed(0)
    x = torch.randn(1536, 16)
    data = torch.utils.data.TensorDataset(x, x @ torch.randn(16, 1))
    train = SlowAfter(data, 900, stall) if r == 2 else data
    with dp.connect(url, rank=r, world_size=3, job=JOB, timeout=60) as ch:
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
        options = dp.TrainOptions(epochs=3, batch_size=16, progress=False, status_http=f"127.0.0.1:{web}")
        dp.fit(ch, model, torch.nn.functional.mse_loss, lambda p: torch.optim.SGD(p, lr=0.01), train, options=options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs/img", help="where the screenshot and the top view go")
    parser.add_argument("--stall", type=float, default=25.0, help="seconds rank 2's loader stalls")
    args = parser.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("needs chromium: apt-get install chromium")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    url, web = f"zmq://127.0.0.1:{free_port()}", free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank, args=(url, r, web, args.stall)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 120
        while True:  # until the stall shows
            try:
                with dp.observe(url, job=JOB, timeout=2) as ch:
                    view = dp.read_job(ch)
            except dp.ControlError:  # not started yet
                view = {"stalls": []}
            try:  # a look at the driver's page: each one a point of its step-time plots
                urllib.request.urlopen(f"http://127.0.0.1:{web}/status.json", timeout=5).close()
            except OSError:
                pass
            if any(s["rank"] == 2 for s in view["stalls"]) and view["ranks"][2]["phase_s"] > 8:
                break
            if time.monotonic() > deadline:
                sys.exit("the stall never showed")
            time.sleep(0.5)
        top = subprocess.run(
            [sys.executable, "-m", "dataparallel", "top", url, "--job", JOB, "--iterations", "1"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        (out / "status-top.txt").write_text(top)
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run(
                [
                    browser,
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--hide-scrollbars",
                    f"--user-data-dir={profile}",
                    f"--screenshot={(out / 'status-page.png').resolve()}",
                    "--window-size=1500,570",
                    f"http://127.0.0.1:{web}/",
                ],
                capture_output=True,
                check=True,
                timeout=120,
            )
        print(top)
        print(f"wrote {out / 'status-page.png'} and {out / 'status-top.txt'}")
    finally:
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()


if __name__ == "__main__":
    main()
