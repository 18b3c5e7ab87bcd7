"""tests/zygote.py: a forked rank is what ``python SCRIPT ARGS`` would have been, as far as
the training tests look (argv, directory, environment, pipes, exit status, signals, session)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest
import zygote

SCRIPT = textwrap.dedent(
    """\
    import json, os, random, signal, sys, time
    what = sys.argv[1]
    if what == "report":
        print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("DP_ZYGOTE_TEST"),
                          "path0": sys.path[0], "random": random.random(), "sid": os.getsid(0) == os.getpid(),
                          "main": __name__}))
        print("to stderr", file=sys.stderr)
        sys.exit(3)
    if what == "raise":
        raise RuntimeError("on purpose")
    if what == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    if what == "sleep":
        time.sleep(30)
    """
)


@pytest.mark.timeout(120)
def test_a_forked_rank_is_what_the_script_started_by_python_would_be(tmp_path, monkeypatch):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    monkeypatch.setenv("DP_ZYGOTE_TEST", "seen")
    monkeypatch.chdir(tmp_path)
    reports = []
    for session in (False, True):
        proc = zygote.popen([str(script), "report", "x"], start_new_session=session)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 3 and err == "to stderr\n", (proc.returncode, err)
        reports.append(json.loads(out))
    for report, session in zip(reports, (False, True), strict=True):
        assert report["argv"] == [str(script), "report", "x"] and report["main"] == "__main__"
        assert report["cwd"] == str(tmp_path) and report["env"] == "seen" and report["path0"] == str(tmp_path)
        assert report["sid"] is session
    assert reports[0]["random"] != reports[1]["random"], "each child its own random state"

    raised = zygote.popen([str(script), "raise"])
    _, err = raised.communicate(timeout=60)
    assert raised.returncode == 1 and "RuntimeError: on purpose" in err

    termed = zygote.popen([str(script), "term"])
    termed.communicate(timeout=60)
    assert termed.returncode == -signal.SIGTERM

    sleeper = zygote.popen([str(script), "sleep"])
    assert sleeper.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.communicate(timeout=0.5)
    assert Path(f"/proc/{sleeper.pid}/stat").read_text().split(") ")[1][0] in "SR", "a live process of its own"
    sleeper.kill()
    sleeper.communicate(timeout=30)
    assert sleeper.returncode == -signal.SIGKILL
    assert not os.path.exists(f"/proc/{sleeper.pid}"), "reaped by the zygote once its status came"
