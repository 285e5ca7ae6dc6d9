"""A process that used a process group ends cleanly through ``exit_rank``.

The race it closes (pytorch#179291's discussion): ``destroy_process_group`` does not join gloo's
worker threads while anything (DDP's reducer, a hook's state) still holds the backend, and a
worker that is still releasing a ``Future.then`` callback when the interpreter finalises aborts
the process ("terminate called without an active exception"). Here the release is made slow on
purpose (its ``__del__`` sleeps), so the race is lost every time unless the exit avoids it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import torch, torch.distributed as dist
    from superneurons.train.rank import exit_rank, leave_process_group

    class SlowRelease:
        def __del__(self):
            time.sleep(0.3)  # the GIL is released, and taken back during finalisation

    torch.set_num_threads(1)
    leave_process_group()  # no group yet: nothing to do
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    backend = dist.group.WORLD  # kept alive into shutdown, as DDP's reducer keeps it
    work = dist.all_reduce(torch.ones(1000), async_op=True)
    slow = SlowRelease()
    done = work.get_future().then(lambda fut, slow=slow: fut.value())
    del slow
    done.wait()
    print("work done", end="")  # unflushed: exit_rank must flush it
    exit_rank(int(sys.argv[2]))
    """
)


@pytest.mark.parametrize("status", [0, 3])
def test_exit_rank_ends_cleanly_while_gloo_still_releases_a_callback(
    tmp_path: Path, status: int
) -> None:
    script = tmp_path / "rank.py"
    script.write_text(_SCRIPT, encoding="utf-8")
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store"), str(status)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == status, result.stderr[-2000:]
    assert "terminate called" not in result.stderr
    assert result.stdout == "work done"
